"""Restart-to-ready from the peer's own checkpoint + the ledger tail, against a full replay.

    nice -n 19 python bench/bench_restart.py [--rounds 10000] [--peers 8] [--behind 100]
        [--threads 1] [--name restart]

A synthetic ledger of ROUNDS x PEERS signed rows (8 generated Ed25519 identities, N(0,1)
scalars, real GossipSub envelopes: bench_network.py's `_build-ledger` worker) stands for a
run: no training is needed, since the model is a pure function of base + ledger. The
restarting peer's checkpoint covers every row of rounds < ROUNDS - BEHIND (written with
`LiveModel.checkpoint`, as the daemon writes it at stop). Then the library path the peer
daemon runs at restart (peer/daemon.py: `Ledger.verify` of every row, `load_model` and the
base-hash check, `LiveModel.cut`, `LiveModel.restore`) is timed twice on a fresh model:
with the checkpoint (checkpoint + the BEHIND x PEERS rows after it) and without (replay of
every row). The network sync that precedes it in a real restart is not included (a
restarted peer's ledger is already nearly complete). Writes bench/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build_ledger(path: Path, rounds: int, peers: int) -> dict:
    """Signed synthetic ledger, written by bench_network.py's worker (its own process)."""
    out = path.with_suffix(".json")
    args = {"peers": peers, "rounds": rounds, "path": str(path), "out": str(out)}
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_network.py"),
            "_build-ledger",
            json.dumps(args),
        ],
        check=True,
        cwd=str(ROOT),
    )
    return json.loads(out.read_text())


def restart(ledger_path: Path, ckpt_dir: Path | None, own_peer: bytes) -> tuple[dict, dict]:
    """The daemon's restart path, timed per stage; returns (timings, weights)."""
    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.network.transport.identity import verify_pubsub_signature
    from seedflood_p2p.storage.checkpoint import unchanged_rows
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model, weights_sha256

    stages: dict[str, float] = {}
    t0 = t = time.perf_counter()
    ledger = Ledger.open_existing(ledger_path)
    config = ledger.config
    # As peer/daemon.py:check_ledger: rows the checkpoint covers, unchanged since it was
    # written, are not re-checked (storage/checkpoint.py:unchanged_rows).
    trusted = unchanged_rows(ledger, ckpt_dir) if ckpt_dir is not None else None
    check = ledger.verify(verify_pubsub_signature, "bench", config.directions, own_peer, trusted)
    stages["ledger_verify_s"] = time.perf_counter() - t
    t = time.perf_counter()
    model, _ = load_model(config.model)
    assert weights_sha256(model) == config.base_sha256
    stages["model_load_and_hash_s"] = time.perf_counter() - t
    t = time.perf_counter()
    live = LiveModel(make_estimator(model, config), ledger)
    cut = live.streamed_cut()  # the daemon's (peer/latejoin.py): a snapshot, read in one pass
    stages["cut_s"] = time.perf_counter() - t
    t = time.perf_counter()
    how = live.restore(cut, ckpt_dir)
    cut.close()
    stages["restore_s"] = time.perf_counter() - t
    stages["total_s"] = time.perf_counter() - t0
    stages = {k: round(v, 2) for k, v in stages.items()}
    stages["how"] = how
    stages["signed_rows_checked"] = check.signed - check.trusted
    stages["signed_rows_trusted"] = check.trusted
    weights = {k: v.clone() for k, v in live.weights().items()}
    ledger.close()
    return stages, weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10_000)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--behind", type=int, default=100, help="rounds the checkpoint lacks")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="restart")
    parser.add_argument(
        "--full-from",
        default="",
        help="take the full-replay column from this earlier result (JSON) instead of re-running it",
    )
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from seedflood_p2p.algorithm.live import LedgerCut, LiveModel
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.storage.digests import digest_of
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    out: dict = {
        "command": "nice -n 19 python bench/bench_restart.py " + " ".join(sys.argv[1:]),
        "rounds": args.rounds,
        "peers": args.peers,
        "behind": args.behind,
        "model": "smollm2-135m",  # the ledger builder's (bench_network.py)
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        tmp = Path(tmp)
        ledger_path = tmp / "ledger.sqlite"
        t = time.perf_counter()
        out["ledger"] = build_ledger(ledger_path, args.rounds, args.peers)
        out["ledger_build_s"] = round(time.perf_counter() - t, 1)
        ledger = Ledger.open_existing(ledger_path)
        config = ledger.config
        own_peer = min(ledger.peers())
        # The checkpoint a peer wrote BEHIND rounds ago: base + every row of earlier rounds.
        t = time.perf_counter()
        model, _ = load_model(config.model)
        live = LiveModel(make_estimator(model, config), ledger)
        older = list(ledger.messages(0, args.rounds - args.behind - 1))
        from seedflood_p2p.algorithm.replay import replay

        replay(model, config, older)
        ckpt_dir = tmp / "peer"
        ckpt_dir.mkdir()
        meta = live.checkpoint(
            ckpt_dir,
            LedgerCut(older, digest_of(older), []),
            {
                "round": args.rounds - args.behind,
                "run_id": config.run_id,
                # as the peer daemon records it (peer/rounds.py: Rounds.checkpoint)
                "ledger_rows_sha256": ledger.rows_sha256({(m.peer, m.round) for m in older}),
            },
        )
        out["checkpoint_setup_s"] = round(time.perf_counter() - t, 1)
        out["checkpoint_rows"] = meta["ledger_messages"]
        out["checkpoint_mib"] = round(
            (ckpt_dir / "checkpoint.safetensors").stat().st_size / 2**20, 1
        )
        ledger.close()
        del model, live
        out["from_checkpoint"], w_ckpt = restart(ledger_path, ckpt_dir, own_peer)
        if args.full_from:  # the replay path is unchanged: its figure from an earlier run
            earlier = json.loads(Path(args.full_from).read_text())
            out["full_replay"] = {**earlier["full_replay"], "from": args.full_from}
            for key in ("max_abs_weight_difference", "max_abs_weight"):
                out[key] = earlier[key]
        else:
            out["full_replay"], w_full = restart(ledger_path, None, own_peer)
            diff = max(float((w_ckpt[k] - w_full[k]).abs().max()) for k in w_full)
            out["max_abs_weight_difference"] = diff
            out["max_abs_weight"] = max(float(w_full[k].abs().max()) for k in w_full)
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1))
    (RESULTS / f"{args.name}.md").write_text(markdown(out))
    print(markdown(out))
    return 0


def markdown(out: dict) -> str:
    a, b = out["from_checkpoint"], out["full_replay"]
    rows = [
        "| stage | checkpoint + tail | full replay |",
        "|---|---|---|",
    ]
    for key, label in (
        ("ledger_verify_s", "ledger check (Ed25519 signatures of rows not covered, unchanged)"),
        ("model_load_and_hash_s", "load base model + base-hash check"),
        ("cut_s", "ledger snapshot (its rows read in the restore's pass)"),
        ("restore_s", "restore (one pass over the rows: checkpoint + tail, or replay)"),
        ("total_s", "**restart to ready (no network sync)**"),
    ):
        rows.append(f"| {label} | {a[key]} s | {b[key]} s |")
    return "\n".join(
        [
            f"# Restart to ready: {out['model']}, {out['rounds']:,} rounds x {out['peers']} peers",
            "",
            f"`{out['command']}`; torch threads {out['torch_threads']}, load average "
            f"{out['loadavg_start']} at start, {out['loadavg_end']} at the end (2 shared cores).",
            "",
            f"Ledger: {out['ledger']['messages']:,} signed rows; the checkpoint covers "
            f"{out['checkpoint_rows']:,} of them (rounds < {out['rounds'] - out['behind']:,}), "
            f"{out['checkpoint_mib']} MiB of trainable weights.",
            "",
            *rows,
            "",
            f"Signatures checked: {a['signed_rows_checked']:,} with the checkpoint (its "
            f"{a['signed_rows_trusted']:,} rows unchanged since it was written are not "
            f"re-checked), {b['signed_rows_checked']:,} without.",
            "",
            (
                f"The full-replay column is from `{b['from']}` (same code path, same ledger "
                "size, another run).\n\n"
                if "from" in b
                else ""
            )
            + f"How: `{a['how']}` vs `{b['how']}`. Largest weight difference between the two "
            f"results: {out['max_abs_weight_difference']:.3g} (weights up to "
            f"{out['max_abs_weight']:.3g}; the checkpoint's merges are grouped differently from "
            "one replay of every row, so they agree to float32 rounding).",
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
