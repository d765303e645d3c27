#!/usr/bin/env python
"""Peak memory of one zeroth-order step against one inference forward (SmolLM2-135M, MR).

The issue's bound: a step's peak memory stays <= 1.2x an inference forward's. Each
measurement runs in a fresh process (peak RSS only grows), which loads the model, builds
one batch of 16 and then does either one inference forward (the per-example losses, as a
peer scoring its batch would) or one `zo_step` of the row's settings. Reported: the
process's peak RSS, and the part above what loading the model and batch took.

    python bench/bench_memory.py            # ~10 CPU-min (7 step rows, 4 artifacts first)
    python bench/bench_memory.py --device cuda --results-dir OUT   # on a GPU: allocated bytes

Writes bench/results/memory.{json,md} (memory-cuda.{json,md} on a GPU; --results-dir
elsewhere). On a GPU "peak" is torch's peak of allocated CUDA memory and "loaded" what the
model, batch and basis hold before the forward or step (RSS would count the CUDA runtime,
not the model's work).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CACHED = "cached_examples"  # a row's bench-only key: training examples cached before the step
ROWS = {
    "k=1, random bases": {},
    "k=16, 2-D weights": {"directions": 16},
    "k=16, norm scales": {"directions": 16, "train_norms": True, "train_only": "*norm*"},
    # What #26's full-model table trains: every matrix, along the run's activation basis.
    # The peer loads the artifact (computed by the basis publisher in another process, as
    # `seedflood bootstrap --basis activation` does), it never computes one.
    "k=16, rank 32, activation basis": {"directions": 16, "rank": 32, "basis": "activation"},
    # The same with U sides too (basis "kfac": an artifact about twice the size).
    "k=16, rank 32, K-FAC basis": {"directions": 16, "rank": 32, "basis": "kfac"},
    # Calibrated (the demo's and the GPU queue's rows): 16 content-free rows join the
    # batch's 16, one per direction, so a step scores 32 rows.
    "k=16, rank 32, K-FAC basis, calibrated": {
        "directions": 16,
        "rank": 32,
        "basis": "kfac",
        "calibration": "content-free",
    },
    # The demo's default peer (apps/demo.py): its top 2 blocks train along the K-FAC basis,
    # calibrated, with the frozen prefix of all 512 training sentences and of the 200
    # held-out ones peer 0 scores in its caches (what it holds once it has met them all;
    # the training cache is bounded by --prefix-cache-mb, 64 by default).
    "the demo's default (top 2 blocks, K-FAC, calibrated, 512 cached)": {
        "directions": 16,
        "rank": 32,
        "basis": "kfac",
        "calibration": "content-free",
        "train_only": "model.layers.2[89].*",
        "train_examples": 512,
        "step_rule": "round_mean",
        "n_ref": 16,
        "lr": 0.064,
        CACHED: 512,
    },
}


def basis_file(row: str) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in row).strip("-")
    return Path(f"/tmp/seedflood-bench-memory-{slug}.safetensors")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(mode: str, row: str, device: str = "cpu") -> dict:
    """In this process: load, then one inference forward or one step of `row`; peak RSS in
    MiB (on a GPU: peak allocated CUDA memory)."""
    import torch

    from seedflood_p2p.algorithm.objective import example_losses, on_model_device
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.algorithm.trainer import batch_seed, zo_step
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.workload.batching import make_batch, sample_batch
    from seedflood_p2p.workload.models import load_model
    from seedflood_p2p.workload.tasks import load_run_task

    torch.set_num_threads(1)
    overrides = dict(ROWS[row])
    cached = overrides.pop(CACHED, 0)
    config = RunConfig(model="smollm2-135m", dataset="mr", **overrides)
    model, tokenizer = load_model(config.model)
    model.to(device)
    task = load_run_task(config)  # the run's task: its training set, its calibration
    peer = b"local-0"
    examples = sample_batch(task, batch_seed(config.run_key, peer, 1), config.batch_size)
    batch = make_batch(examples, tokenizer, task, config.max_length)
    engine = make_estimator(model, config) if mode in ("step", "basis") else None
    if mode == "basis":  # the publisher's side: compute the artifact, write it, measure nothing
        from seedflood_p2p.algorithm.trainer import make_basis

        basis_file(row).write_bytes(make_basis(engine, tokenizer, task, 0).body)
        return {}
    if engine is not None and config.data_basis:
        from seedflood_p2p.algorithm.basis import decode

        engine.add_basis(0, decode(basis_file(row).read_bytes()))
    cache = None
    if cached:  # a peer that has met these sentences holds their frozen prefix
        from seedflood_p2p.algorithm.prefix_cache import ExamplePrefixCache

        cache = ExamplePrefixCache(model, engine.matrices)
        held_out = task.test[:200]
        for pool in (task.train[:cached], held_out):
            for start in range(0, len(pool), config.batch_size):
                chunk = pool[start : start + config.batch_size]
                with torch.no_grad():
                    cache.fill(chunk, make_batch(chunk, tokenizer, task, config.max_length))
    cuda = device.startswith("cuda")
    if cuda:
        batch = on_model_device(model, batch)
        if engine is not None:
            engine.basis(0)  # the artifact's tensors on the GPU before the peak is reset
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loaded = torch.cuda.memory_allocated() / 2**20
    else:
        loaded = peak_mib()
    if mode == "inference":
        with torch.no_grad():
            example_losses(model, batch, task.kind)
    else:
        zo_step(engine, tokenizer, task, peer, 1, cache)
    if cuda:
        torch.cuda.synchronize()
        return {"loaded_mib": loaded, "peak_mib": torch.cuda.max_memory_allocated() / 2**20}
    return {"loaded_mib": loaded, "peak_mib": peak_mib()}


def run(mode: str, row: str, device: str = "cpu") -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, row, device],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(measure(sys.argv[2], sys.argv[3], sys.argv[4])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (allocated GPU memory)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = args.device
    inference = run("inference", "k=1, random bases", device)
    basis_bytes = {}
    for row, settings in ROWS.items():
        if settings.get("basis", "random") != "random":  # the publisher computes it first
            run("basis", row, device)
            basis_bytes[row] = basis_file(row).stat().st_size
    rows = {}
    for row in ROWS:
        step = run("step", row, device)
        rows[row] = {
            **step,
            "peak_ratio": step["peak_mib"] / inference["peak_mib"],
            "above_load_ratio": (step["peak_mib"] - step["loaded_mib"])
            / (inference["peak_mib"] - inference["loaded_mib"]),
        }
        print(row, rows[row], flush=True)
    cuda = device.startswith("cuda")
    name = "memory-cuda" if cuda else "memory"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{name}.json").write_text(
        json.dumps(
            {"device": device, "inference": inference, "steps": rows, "basis_bytes": basis_bytes},
            indent=1,
        )
    )
    what = (
        "Peak allocated CUDA memory (torch); 'above load' is the peak minus what the model, "
        "batch and basis held before it"
        if cuda
        else "Peak RSS of a fresh process; 'above load' is the peak minus what loading the "
        "model and the batch took"
    )
    lines = [
        f"# Peak memory: one ZO step vs one inference forward (SmolLM2-135M, batch 16, MR, "
        f"{device})",
        "",
        f"{what}. Command: `python bench/bench_memory.py"
        + (f" --device {device}`." if cuda else "`."),
        "",
        f"| | peak {'allocated' if cuda else 'RSS'} (MiB) | above load (MiB) | peak / inference "
        "| above load / inference |",
        "|---|---:|---:|---:|---:|",
        f"| inference forward | {inference['peak_mib']:.0f} | "
        f"{inference['peak_mib'] - inference['loaded_mib']:.0f} | 1.00 | 1.00 |",
    ]
    for row, r in rows.items():
        lines.append(
            f"| step, {row} | {r['peak_mib']:.0f} | {r['peak_mib'] - r['loaded_mib']:.0f} | "
            f"{r['peak_ratio']:.2f} | {r['above_load_ratio']:.2f} |"
        )
    lines += [
        "",
        "A row with a data basis loads the run's artifact, computed beforehand in another "
        "process as the basis publisher does; its size is part of the row's peak: "
        + "; ".join(f"{row}: {size:,} bytes" for row, size in basis_bytes.items())
        + ". An activation artifact holds a k x 32 float32 V side for every trained linear "
        "matrix, a K-FAC one an m x 32 U side too. The demo's row first caches the frozen "
        "prefix of its 512 training sentences and of the 200 held-out ones peer 0 scores "
        "(what its caches hold once it has met them all), so its 'above load' is the step "
        "alone.",
    ]
    (args.results_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
