#!/usr/bin/env python
"""Would an honest peer on other CPU arithmetic be falsely accused by an audit?

Issue 45 asks whether peers whose float arithmetic differs (other CPU kernels, other
torch thread counts) recompute each other's updates within the audit rule. This bench
computes the same honest updates, with the project's own step (`trainer.zo_step`, the
scalars a peer publishes, float16) in one subprocess per hardware setting:

    native        this machine as it is (ATen picks its best kernels)
    aten-default  ATEN_CPU_CAPABILITY=default: ATen's scalar (unvectorized) kernels
    aten-avx2     ATEN_CPU_CAPABILITY=avx2
    aten-avx512   ATEN_CPU_CAPABILITY=avx512 (only where /proc/cpuinfo has avx512f)
    avx2-machine  as an AVX2-only CPU computes: ATen avx2, MKL_ENABLE_INSTRUCTIONS=AVX2
                  and ONEDNN_MAX_CPU_ISA=AVX2 (the matmuls are MKL's and oneDNN's, not
                  ATen's, so ATen's variable alone does not change them)

each at 1 and 2 torch threads, and the reference (native, 1 thread) again in a fresh
process: the control, which says whether the step is deterministic at all. With `--cuda`
(a machine with a GPU) two more: a peer computing on the GPU among the CPU peers,

    cuda          the model on CUDA, float32 matmuls at torch's default ("highest")
    cuda-tf32     the same with TF32 matmuls (`torch.set_float32_matmul_precision("high")`,
                  which some programs turn on for speed)
 Every setting
trains the same lockstep ledger: the reference computes rounds 0..R-1 for P peers and
applies its own claims; every other setting recomputes each (peer, round) on base + the
reference's claims of the earlier rounds (an auditor's settled state: the ledger holds
the claims, not its own recomputation), applied on its own arithmetic. Then for every
pair (X, Y) it asks the run's default rule (`AuditSettings().rule`,
`AuditRule.mismatches`) whether X's scalars, as a claim, mismatch Y's recomputation, and
reports bit-identical shares, max |c - r|, max |c - r| / max(|c|, |r|), and the margin:
the smallest bound / |c - r| over differing scalars (how many times the difference would
have to grow to accuse).

    taskset -c 0 nice -n 5 python bench/bench_audit_hardware.py --model tiny-llama \\
        --rounds 12 --peers 4                                  # ~2.5 min on one core
    taskset -c 0 nice -n 5 python bench/bench_audit_hardware.py --model smollm2-135m \\
        --rounds 4 --peers 4                                   # ~13 min on one core
    python bench/bench_audit_hardware.py --summarize   # audit-hardware.md: both side by side
    python bench/bench_audit_hardware.py --model smollm2-135m --rounds 4 --peers 4 \
        --cuda --only rerun-native-1t native-2t cuda cuda-tf32   # the GPU queue's row
Writes bench/results/audit-hardware-<model>.json and .md (`--name`). The GPU rows run
from `bench/gpu_rounds.sh audit` when a GPU machine is lent; none has run yet.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]  # for `harness` (the daemon tests' run)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
AVX2_MACHINE = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
# Variables a setting may set; all are cleared first, so a setting is only what it names.
ARITH_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (first processor of /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def settings(threads: list[int], cuda: bool = False) -> list[tuple[str, dict[str, str], int, str]]:
    """(name, environment, threads, device) for every hardware setting this machine can run
    (device: "cpu", "cuda" or "cuda-tf32")."""
    flags = cpu_flags()
    envs: list[tuple[str, dict[str, str]]] = [
        ("native", {}),
        ("aten-default", {"ATEN_CPU_CAPABILITY": "default"}),
    ]
    if "avx2" in flags:
        envs += [("aten-avx2", {"ATEN_CPU_CAPABILITY": "avx2"}), ("avx2-machine", AVX2_MACHINE)]
    if "avx512f" in flags:
        envs.append(("aten-avx512", {"ATEN_CPU_CAPABILITY": "avx512"}))
    out = [(f"{name}-{n}t", env, n, "cpu") for name, env in envs for n in threads]
    if cuda:  # threads only matter for the CPU side of the step there
        out += [("cuda", {}, threads[0], "cuda"), ("cuda-tf32", {}, threads[0], "cuda-tf32")]
    # The control: the reference again in a fresh process (is the step deterministic at all?)
    return [out[0], (f"rerun-{out[0][0]}", *out[0][1:]), *out[1:]]


def run_config(model: str) -> Any:
    """The run settings: the tiny model as the daemon tests run it (harness RUN); SmolLM2
    in the demo's two-block setting (seedflood_p2p/apps/demo.py) with a random basis (the
    demo's K-FAC basis is an artifact the bootstrap node computes; the forward passes,
    where kernels differ, are the same)."""
    from seedflood_p2p.core.config import RunConfig

    if model.startswith("smollm2"):
        from seedflood_p2p.apps.demo import DEMO_DEFAULTS, DEMO_PROMPT, MODEL_DEFAULTS

        body = {**DEMO_DEFAULTS, **MODEL_DEFAULTS[model], **DEMO_PROMPT, "basis": "random"}
        body["calibration"] = DEMO_DEFAULTS["calibration"]
        return RunConfig(**body)
    import dataclasses

    from harness.cluster import RUN  # the daemon tests' run

    return dataclasses.replace(RUN, model=model)


def worker(args: argparse.Namespace) -> None:
    """One setting: the scalars of every (round, peer), on base + the claims before it."""
    import torch

    torch.set_num_threads(args.threads)
    from seedflood_p2p.algorithm import trainer
    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.prefix_cache import ExamplePrefixCache
    from seedflood_p2p.algorithm.subcge import SubCGE
    from seedflood_p2p.algorithm.trainer import zo_step
    from seedflood_p2p.protocol.message import UpdateMessage
    from seedflood_p2p.workload.models import load_model
    from seedflood_p2p.workload.tasks import load_run_task

    config = run_config(args.model)
    model, tokenizer = load_model(config.model)
    device = args.device.split("-")[0]
    if args.device == "cuda-tf32":
        torch.set_float32_matmul_precision("high")
    model = model.to(device)
    task = load_run_task(config)
    engine = SubCGE(model, config, basis_cache=args.rounds // config.refresh_period + 3)
    live = LiveModel(engine)
    cache = ExamplePrefixCache(model, engine.matrices) if config.train_only else None
    if cache is not None and not cache.active:
        cache = None
    claims = json.loads(Path(args.claims).read_text())["scalars"] if args.claims else None
    peers = [f"hw-{i}".encode() for i in range(args.peers)]
    scalars: dict[str, list[float]] = {}
    raw: dict[str, list[float]] = {}  # the float estimates before float16 (same step)
    quantize = trainer.quantize_scalars
    seen: list[tuple[float, ...]] = []

    def keep_raw(values):
        seen.append(tuple(float(v) for v in values))
        return quantize(values)

    trainer.quantize_scalars = keep_raw  # zo_step's own call: the published path is unchanged
    started = time.process_time()
    for t in range(args.rounds):
        mine = []
        for peer in peers:
            message, _ = zo_step(engine, tokenizer, task, peer, t, cache)
            scalars[f"{t}/{peer.decode()}"] = list(message.scalars)
            raw[f"{t}/{peer.decode()}"] = list(seen.pop())
            mine.append(message)
        if claims is not None:  # the ledger holds the reference's claims
            mine = [UpdateMessage(t, p, tuple(claims[f"{t}/{p.decode()}"])) for p in peers]
        live.apply(mine)
        print(f"round {t} done, {time.process_time() - started:.0f} CPU-s", flush=True)
    result = {
        "capability": torch.cuda.get_device_name()
        if device == "cuda"
        else torch.backends.cpu.get_cpu_capability(),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k, "") for k in ARITH_VARS},
        "cpu_seconds": time.process_time() - started,
        "scalars": scalars,
        "raw": raw,
    }
    Path(args.out).write_text(json.dumps(result))


def compare(claimed: dict[str, list[float]], recomputed: dict[str, list[float]]) -> dict:
    """The default audit rule on X's scalars as claims against Y's as recomputations."""
    import numpy as np

    from seedflood_p2p.core.extra_settings import AuditSettings

    rule = AuditSettings().rule
    updates = identical = accused = scalars = differing = 0
    max_abs = max_rel = 0.0
    margin = float("inf")
    for key, c_list in claimed.items():
        c, r = np.asarray(c_list, np.float64), np.asarray(recomputed[key], np.float64)
        updates += 1
        scalars += c.size
        identical += bool(np.array_equal(c, r))
        accused += rule.mismatches(c_list, recomputed[key])
        diff = np.abs(c - r)
        scale = np.maximum(np.abs(c), np.abs(r))
        bound = rule.bounds(c, r)
        nz = diff > 0
        differing += int(nz.sum())
        if nz.any():
            max_abs = max(max_abs, float(diff.max()))
            max_rel = max(max_rel, float((diff[nz] / scale[nz]).max()))
            margin = min(margin, float((bound[nz] / diff[nz]).min()))
    return {
        "updates": updates,
        "bit_identical_updates": identical,
        "scalars": scalars,
        "differing_scalars": differing,
        "max_abs": max_abs,
        "max_rel": max_rel,
        "margin": None if margin == float("inf") else margin,
        "accused": accused,
    }


def tolerances(results: dict, rule: Any) -> list[dict]:
    """What a wider `absolute` tolerance (relative kept) would cost: for the rule's own,
    the smallest that accuses no pair here ("needed"), and 2x / 4x that, the honest
    updates accused over all pairs and the share of the reference's updates whose sign
    flip or x3 one audit still catches."""
    import numpy as np

    from seedflood_p2p.core.extra_settings import AuditRule

    names = list(results)
    needed = 0.0
    for x, y in itertools.combinations(names, 2):
        for key, c in results[x]["scalars"].items():
            cc, rr = np.asarray(c), np.asarray(results[y]["scalars"][key])
            diff = np.abs(cc - rr)
            uncovered = diff > rule.relative * np.maximum(np.abs(cc), np.abs(rr))
            if uncovered.any():
                needed = max(needed, float(diff[uncovered].max()))
    reference = results[names[0]]["scalars"]
    out = []
    for label, absolute in (
        ("rule", rule.absolute),
        ("needed", needed),
        ("2x needed", 2 * needed),
        ("4x needed", 4 * needed),
    ):
        candidate = AuditRule(
            relative=rule.relative, absolute=max(absolute, rule.absolute), spread=rule.spread
        )
        accused = sum(
            candidate.mismatches(c, results[y]["scalars"][key])
            for x, y in itertools.combinations(names, 2)
            for key, c in results[x]["scalars"].items()
        )
        out.append(
            {
                "label": label,
                "relative": candidate.relative,
                "absolute": candidate.absolute,
                "accused": accused,
                "audits": len(reference) * len(names) * (len(names) - 1) // 2,
                "catches_flip": float(
                    np.mean([candidate.mismatches(c, [-v for v in c]) for c in reference.values()])
                ),
                "catches_x3": float(
                    np.mean(
                        [candidate.mismatches(c, [3 * v for v in c]) for c in reference.values()]
                    )
                ),
            }
        )
    return out


def launch(
    model: str,
    name: str,
    env: dict[str, str],
    threads: int,
    device: str,
    rounds: int,
    peers: int,
    claims: Path | None,
    work: Path,
) -> dict:
    """Run one setting's worker in a fresh process (the variables are read at import)."""
    out = work / f"{name}.json"
    child = {k: v for k, v in os.environ.items() if k not in ARITH_VARS}
    child.update(env)
    child.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--model",
        model,
        "--threads",
        str(threads),
        "--device",
        device,
        "--rounds",
        str(rounds),
        "--peers",
        str(peers),
        "--out",
        str(out),
    ]
    if claims is not None:
        cmd += ["--claims", str(claims)]
    variables = " ".join(f"{k}={v}" for k, v in env.items()) or "(no variables)"
    print(f"{name}: {variables}, device {device}", flush=True)
    subprocess.run(cmd, env=child, check=True)
    return json.loads(out.read_text())


def rule_text(rule: dict) -> str:
    """The bound of a recorded rule, as the markdown states it."""
    spread = f", {rule['spread']} * rms(r)" if rule.get("spread") else ""
    return f"max({rule['absolute']}, {rule['relative']} * max(|c|, |r|){spread})"


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"# Audit mismatch across CPU arithmetic: {result['model']}",
        "",
        f"{result['peers']} peers x {result['rounds']} rounds = {result['updates']} honest "
        f"updates ({result['directions']} scalars each) per setting, each recomputed on "
        "base + the reference's claims of earlier rounds (an auditor's settled state). Rule: "
        f"mismatch iff some |c - r| > {rule_text(result['rule'])} (`AuditSettings().rule`). CPU: "
        f"{result['cpu']}. Produced by `{result['command']}`.",
        "",
        "## Settings",
        "",
        "| setting | device | variables | ATen capability (CPU) or GPU | threads | CPU-s |",
        "|---|---|---|---|---|---|",
    ]
    for name, info in s.items():
        env = ", ".join(f"{k}={v}" for k, v in info["env"].items() if v) or "-"
        lines.append(
            f"| {name} | {info.get('device', 'cpu')} | {env} | {info['capability']} | "
            f"{info['threads']} | "
            f"{info['cpu_seconds']:.1f} |"
        )
    lines += [
        "",
        "## Every pair of settings (the rule is symmetric: either may be the claimer)",
        "",
        "Published float16 scalars: bit-identical updates, differing scalars, max |c - r|, "
        "max |c - r| / max(|c|, |r|), margin (smallest rule bound / |c - r| over differing "
        "scalars; - if none differ), accusations. float32: the same step's estimates "
        "before float16 (identical updates, max abs, max rel).",
        "",
        "| claimer | auditor | identical | differing scalars | max abs | max rel | margin "
        "| accused | float32 identical | float32 max abs | float32 max rel |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["pairs"]:
        margin = "-" if row["margin"] is None else f"{row['margin']:.1f}x"
        lines.append(
            f"| {row['claimer']} | {row['auditor']} | {row['bit_identical_updates']}/"
            f"{row['updates']} | {row['differing_scalars']}/{row['scalars']} | "
            f"{row['max_abs']:.3g} | {row['max_rel']:.3g} | {margin} | {row['accused']} | "
            f"{row['raw_identical_updates']}/{row['updates']} | {row['raw_max_abs']:.3g} | "
            f"{row['raw_max_rel']:.3g} |"
        )
    lines += [
        "",
        "## Wider tolerances (relative kept): honest accusations here, and cheats caught",
        "",
        "| absolute | relative | honest updates accused (all pairs) | one audit catches a "
        "sign flip | catches x3 |",
        "|---|---|---|---|---|",
    ]
    for c in result["tolerances"]:
        lines.append(
            f"| {c['absolute']:.4g} ({c['label']}) | {c['relative']} | {c['accused']}/"
            f"{c['audits']} | {c['catches_flip']:.3f} | {c['catches_x3']:.3f} |"
        )
    t = result["totals"]
    smallest = "-" if t["margin"] is None else f"{t['margin']:.1f}x"
    lines += [
        "",
        f"Over all {t['pairs']} pairs: {t['accused']} accusations in "
        f"{t['audits']} audits; largest |c - r| {t['max_abs']:.3g}, largest relative "
        f"{t['max_rel']:.3g}, smallest margin {smallest}; before float16: largest "
        f"|c - r| {t['raw_max_abs']:.3g}, largest relative {t['raw_max_rel']:.3g}.",
        "",
    ]
    return "\n".join(lines)


def summarize() -> None:
    """bench/results/audit-hardware.json and .md: each model's totals side by side."""
    models = []
    for path in sorted(OUT.glob("audit-hardware-*.json")):
        r = json.loads(path.read_text())
        t = r["totals"]
        identical = sum(p["bit_identical_updates"] for p in r["pairs"])
        needed = next(c for c in r["tolerances"] if c["label"] == "needed")
        models.append(
            {
                "model": r["model"],
                "file": path.name,
                "settings": list(r["settings"]),
                "updates": r["updates"],
                "directions": r["directions"],
                "audits": t["audits"],
                "bit_identical": identical,
                "accused": t["accused"],
                "max_abs": t["max_abs"],
                "max_rel": t["max_rel"],
                "margin": t["margin"],
                "needed_absolute": needed["absolute"],
                "rule": r["rule"],
                "command": r["command"],
            }
        )
    lines = [
        "# Audit mismatch across CPU arithmetic (issue 45): summary",
        "",
        "Each model: the same honest updates computed under every CPU setting of "
        "`bench/bench_audit_hardware.py` (ATen kernels default/avx2/avx512, an AVX2-only "
        "machine's MKL and oneDNN, 1 and 2 torch threads, and the reference rerun as a "
        "control), then the run's default audit rule on every pair. No GPU here: a CUDA "
        "peer is not measured.",
        "",
        "| model | settings | audits (updates x pairs) | bit-identical | accused | "
        "max abs | max rel | smallest margin | absolute that accuses none | per-model table |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in models:
        margin = "-" if m["margin"] is None else f"{m['margin']:.2f}x"
        lines.append(
            f"| {m['model']} ({m['directions']} scalars) | {len(m['settings'])} | {m['audits']} "
            f"| {m['bit_identical']} | **{m['accused']}** | {m['max_abs']:.3g} | "
            f"{m['max_rel']:.3g} | {margin} | {m['needed_absolute']:.4g} | [{m['file'][:-5]}.md]"
            f"({m['file'][:-5]}.md) |"
        )
    lines += [
        "",
        "Rules: "
        + "; ".join(
            f"{m['file'][:-5]}: mismatch iff some |c - r| > {rule_text(m['rule'])}" for m in models
        )
        + ". Commands: "
        + "; ".join(f"`{m['command']}`" for m in models)
        + ".",
        "",
    ]
    (OUT / "audit-hardware.json").write_text(json.dumps({"models": models}, indent=1))
    (OUT / "audit-hardware.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--name", default="", help="results name (default audit-hardware-<model>)")
    p.add_argument("--only", nargs="*", default=[], help="settings to run (default: all)")
    p.add_argument("--cuda", action="store_true", help="add the GPU settings (cuda, cuda-tf32)")
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument(
        "--summarize", action="store_true", help="write audit-hardware.md from the models' runs"
    )
    p.add_argument(
        "--rejudge",
        type=Path,
        default=None,
        help="an earlier run's JSON: judge its saved scalars again under today's rule",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--claims", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        worker(args)
        return
    if args.summarize:
        summarize()
        return
    if args.rejudge:
        rejudge(args.rejudge, args.name)
        return
    if args.cuda:
        import torch

        if not torch.cuda.is_available():
            sys.exit("error: --cuda: torch sees no CUDA device here; run without --cuda")
    plan = settings(args.threads, args.cuda)
    if args.only:
        plan = [s for s in plan if s[0] in args.only or s[0] == plan[0][0]]
    ref_name, ref_env, ref_threads, ref_device = plan[0]
    with tempfile.TemporaryDirectory(prefix="audit-hardware-") as scratch:
        work = Path(scratch)  # each worker's output; every figure goes into the results
        results = {
            ref_name: launch(
                args.model,
                ref_name,
                ref_env,
                ref_threads,
                ref_device,
                args.rounds,
                args.peers,
                None,
                work,
            )
        }
        claims = work / f"{ref_name}.json"
        for name, env, threads, device in plan[1:]:
            results[name] = launch(
                args.model, name, env, threads, device, args.rounds, args.peers, claims, work
            )
    report(results, args.model, args.rounds, args.peers, args.name, " ".join(sys.argv[1:]))


def rejudge(path: Path, name: str) -> None:
    """The saved scalars of an earlier run (its JSON) judged again under today's rule."""
    saved = json.loads(path.read_text())
    results = {
        k: {**v, "scalars": saved["scalars"][k], "raw": saved["raw"][k]}
        for k, v in saved["settings"].items()
    }
    name = name or f"{path.stem}-rejudged"
    report(results, saved["model"], saved["rounds"], saved["peers"], name, f"--rejudge {path}")


def report(results: dict, model: str, rounds: int, peers: int, name: str, argv: str) -> None:
    """Every pair of settings under the run's default rule; writes the JSON and markdown."""
    pairs = []
    for x, y in itertools.combinations(results, 2):  # the rule is symmetric in c and r
        row = compare(results[x]["scalars"], results[y]["scalars"])
        float_row = compare(results[x]["raw"], results[y]["raw"])
        row["raw_max_abs"], row["raw_max_rel"] = float_row["max_abs"], float_row["max_rel"]
        row["raw_identical_updates"] = float_row["bit_identical_updates"]
        pairs.append({"claimer": x, "auditor": y, **row})
    from seedflood_p2p.core.extra_settings import AuditSettings

    rule = AuditSettings().rule
    margins = [r["margin"] for r in pairs if r["margin"] is not None]
    candidates = tolerances(results, rule)
    first = next(iter(results.values()))["scalars"]
    flags = cpu_flags()
    result = {
        "model": model,
        "rounds": rounds,
        "peers": peers,
        "updates": len(first),
        "directions": len(next(iter(first.values()))),
        "rule": {"relative": rule.relative, "absolute": rule.absolute, "spread": rule.spread},
        "cpu": ", ".join(sorted(f for f in flags if f.startswith("avx"))) or "unknown",
        "command": "python bench/bench_audit_hardware.py " + argv,
        "settings": {
            k: {
                "device": v.get("device", "cpu"),  # runs before --cuda: all on the CPU
                **{kk: v[kk] for kk in ("capability", "threads", "env", "cpu_seconds")},
            }
            for k, v in results.items()
        },
        "pairs": pairs,
        "totals": {
            "pairs": len(pairs),
            "audits": sum(r["updates"] for r in pairs),
            "accused": sum(r["accused"] for r in pairs),
            "max_abs": max((r["max_abs"] for r in pairs), default=0.0),
            "max_rel": max((r["max_rel"] for r in pairs), default=0.0),
            "raw_max_abs": max((r["raw_max_abs"] for r in pairs), default=0.0),
            "raw_max_rel": max((r["raw_max_rel"] for r in pairs), default=0.0),
            "margin": min(margins) if margins else None,
        },
        "tolerances": candidates,
        "scalars": {k: v["scalars"] for k, v in results.items()},
        "raw": {k: v["raw"] for k, v in results.items()},
    }
    name = name or f"audit-hardware-{model}"
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1))
    (OUT / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
