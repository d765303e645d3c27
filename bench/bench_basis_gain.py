"""How far one update moves the model along each basis, at the base weights.

A SubCGE direction is, in every matrix, one U column times one V column (a signed rank-1
matrix), so a step along a basis moves the weights by lr / n_ref x (g . d) x d, where g is
the loss's gradient. Two numbers per basis say how long that step is and how much of it
descends: E|d|^2 (the direction's squared length) and E(g . d)^2 (the first-order
decrease per unit of lr, in expectation over the seeded (U column, V column, sign)
choices). Both are exact expectations over the basis's columns, not samples: per matrix
E(g . d)^2 = mean over (a, b) of (u_a^T G v_b)^2 and E|d|^2 = mean|u|^2 x mean|v|^2.

Why: on the full model at 64 peers the K-FAC basis leads at round 10 and drifts after
round 20 at the activation basis's lr (bench/results/gpu/README.md). If its steps descend
c times as fast per lr, an lr about 1/c as large is the matching step to try.

    python bench/bench_basis_gain.py --model smollm2-135m --task mr --train-examples 2400
    python bench/bench_basis_gain.py --model tiny-llama --task synthetic-sentiment  # seconds

Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def basis_stats(bases: list[tuple[torch.Tensor, torch.Tensor]], grads: list[torch.Tensor]) -> dict:
    """E|d|^2 and E(g . d)^2 over one basis (per matrix: U m x r, V n x r; G m x n)."""
    length = descent = 0.0
    for (u, v), g in zip(bases, grads, strict=True):
        u, v, g = u.double(), v.double(), g.double()
        length += float(u.pow(2).sum(0).mean() * v.pow(2).sum(0).mean())
        descent += float((u.T @ g @ v).pow(2).mean())
    return {"direction_sq_length": length, "descent_per_lr": descent}


def main() -> None:
    from seedflood_p2p.algorithm.objective import differentiable_example_losses, on_model_device
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.algorithm.trainer import make_basis
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.workload.batching import calibrated, make_batch
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.models import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--task", default="synthetic-sentiment")
    parser.add_argument("--train-examples", type=int, default=2400)
    parser.add_argument("--grad-examples", type=int, default=256, help="sentences for g")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--train-only", default="", help="as bench_rounds (default: all)")
    parser.add_argument("--adam-steps", type=int, default=0,
                        help="measure after this many first-order Adam steps (batch 16), "
                        "with the bases of the base weights and fresh ones")  # fmt: skip
    parser.add_argument("--adam-lr", type=float, default=1e-4)
    parser.add_argument("--calibration", default="", help='"content-free": as RunConfig')
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default="basis-gain")
    parser.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tokenizer = load_model(args.model)
    task = load_task(args.task)
    task.train = task.train[: args.train_examples]
    task.calibration = args.calibration  # the bases' G and the gradient read labels this way
    common = dict(model=args.model, dataset=args.task, train_only=args.train_only,
                  rank=args.rank, directions=16, salt="bench-seed0",
                  calibration=args.calibration)  # fmt: skip
    rows: dict[str, dict] = {}
    engines: dict[str, object] = {}

    def trainable(matrices) -> list[torch.Tensor]:
        """Only these matrices' weights take gradients (none: every weight frozen)."""
        for p in model.parameters():
            p.requires_grad_(False)
            p.grad = None
        for m in matrices:
            m.weight.requires_grad_(True)
        return [m.weight for m in matrices]

    def add_bases(suffix: str, kinds: tuple[str, ...]) -> None:
        """Bases of the model's weights as they are now (what a publisher would compute)."""
        trainable([])
        for kind in kinds:
            extra = {} if kind == "random" else {"basis": kind, "basis_refresh": 0}
            engine = make_estimator(model, RunConfig(**common, **extra))
            rows[kind + suffix] = {}
            if kind != "random":
                artifact = make_basis(engine, tokenizer, task, 0)
                engine.add_basis(0, artifact)
                rows[kind + suffix]["artifact_bytes"] = artifact.size
                print(f"{kind}{suffix} basis: {artifact.size:,} bytes ({time.time() - t0:.0f} s)")
            engines[kind + suffix] = engine

    add_bases("", ("random", "activation", "kfac"))
    matrices = engines["random"].matrices
    if args.adam_steps:
        # First-order Adam moves the weights the way a good run does (the label prior is
        # learned within ~10 steps); the bases above stay those of the base weights.
        opt = torch.optim.Adam(trainable(matrices), lr=args.adam_lr)
        pool = task.train[args.grad_examples :]
        for step in range(args.adam_steps):
            chunk = [pool[(step * 16 + i) % len(pool)] for i in range(16)]
            rows_i = calibrated(task, chunk)
            batch = on_model_device(model, make_batch(rows_i, tokenizer, task, 512))
            loss = differentiable_example_losses(model, batch, task.kind).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"{args.adam_steps} Adam steps, last batch loss {loss.item():.3f}", flush=True)
        add_bases("-now", ("activation", "kfac"))
    # The gradient at the weights as they are, mean loss over the first grad-examples sentences
    trainable(matrices)
    examples = task.train[: args.grad_examples]
    for i in range(0, len(examples), 16):
        rows_i = calibrated(task, examples[i : i + 16])
        batch = on_model_device(model, make_batch(rows_i, tokenizer, task, 512))
        loss = differentiable_example_losses(model, batch, task.kind).sum() / len(examples)
        loss.backward()
    grads = [m.weight.grad.detach().clone() for m in matrices]
    grad_sq = float(sum(g.double().pow(2).sum() for g in grads))
    print(f"gradient on {len(examples)} sentences: |g|^2 = {grad_sq:.4g}", flush=True)
    for name, engine in engines.items():
        assert [m.name for m in engine.matrices] == [m.name for m in matrices]
        rows[name].update(basis_stats(engine.basis(0), grads))
    ref = rows["random"]
    for row in rows.values():
        row["length_vs_random"] = row["direction_sq_length"] / ref["direction_sq_length"]
        row["descent_vs_random"] = row["descent_per_lr"] / ref["descent_per_lr"]
        row["descent_vs_activation"] = row["descent_per_lr"] / rows["activation"]["descent_per_lr"]
    out = {"model": args.model, "task": args.task, "rank": args.rank, "grad_sq": grad_sq,
           "calibration": args.calibration,
           "adam_steps": args.adam_steps, "adam_lr": args.adam_lr,
           "grad_examples": len(examples), "matrices": len(matrices), "rows": rows,
           "command": "python " + " ".join(sys.argv), "seconds": time.time() - t0}  # fmt: skip
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.out}.json").write_text(json.dumps(out, indent=1))
    lines = [
        f"# One update's length and descent per basis: {args.model} on {args.task}, rank "
        f"{args.rank}, "
        + (
            f"after {args.adam_steps} Adam steps (lr {args.adam_lr:g}, batch 16); "
            "`-now` bases are computed there, the others at the base weights"
            if args.adam_steps
            else "at the base weights"
        ),
        "",
        f"Command: `{out['command']}`. Gradient: the mean loss over the first "
        f"{len(examples)} training sentences ({len(matrices)} matrices, |g|^2 = {grad_sq:.4g}).",
        "E|d|^2 is a direction's squared length, E(g.d)^2 the first-order loss decrease a step"
        " takes per unit of lr (exact expectations over the basis's columns).",
        "",
        "| basis | artifact bytes | E\\|d\\|^2 / random | E(g.d)^2 / random "
        "| E(g.d)^2 / activation |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row.get('artifact_bytes', 0):,} | {row['length_vs_random']:.3g} | "
            f"{row['descent_vs_random']:.3g} | {row['descent_vs_activation']:.3g} |"
        )
    (results / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
