"""One hostile identity among four honest peers, per attack, against real daemons: a
controlled comparison (the same honest peers with and without the attacker).

    nice -n 19 python bench/bench_hostile.py [--rounds 40] [--seeds 3]
        [--attacks none,flood,tarpit,stall]

Each row is its own run on 127.0.0.1: a bootstrap node, three honest tiny-model peers from
round 0, a fourth honest peer joining late (after round 8), and, except for `none`, one
attacker identity (harness/hostile.py, the same one tests/test_hostile.py uses). Within one
seed every row is the same run (one manifest, salt `hostile-bench-<seed>`) with the same
honest identities (one key file per honest node, copied into each row's data dirs), so the
honest peers' directions and batches are the same in every row: what differs between rows
of a seed is the attacker, and the timing of a shared 2-core machine. Attacks:

    flood    400 valid signed updates of +-100 on fresh rounds, a 100-step window walk
             of +50 rounds, then an equivocation
    tarpit   repair replies: 2,000 claimed buckets, 8 s replies, bad-signature pages
    stall    live with a round a few behind the run, heard every 3 s

Recorded per run: the held-out loss of the replayed honest ledger (base weights + peer a's
ledger, canonical replay: the model every honest peer holds once it has applied the
ledger) on every held-out example, with its per-example standard error; the peers' own
end-of-run evaluation; their final rounds; whether their ledgers are identical; the replay
hash; the attacker's rows in the ledger; the round deadlines honest peers waited out and
those that named the attacker; the late joiner's ready round; the attacker's ban. Per
attack: the loss as mean +- SE over seeds, and the paired difference against `none` of the
same seed (same examples). Writes bench/results/hostile.{json,md} (`--name`), with the load
average at start and end (the machine is shared; deadlines are timing-sensitive).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness.cluster import RUN  # noqa: E402
from harness.hostile import Hostile  # noqa: E402
from seedflood_p2p.apps.localnet import start_bootstrap, start_peer  # noqa: E402

PHASES = {"flood": ["flood", "walk", "equivocate"], "tarpit": ["tarpit"], "stall": ["stall"]}
ROUND_DEADLINE = 3.0
HONEST = ("a", "b", "c", "e")  # e joins late
NODES = ("bootstrap", *HONEST)


def peer_flags(rounds: int) -> list[str]:
    return [
        *("--until-round", str(rounds), "--round-interval", "1.5", "--max-staleness", "2"),
        *("--round-deadline", str(ROUND_DEADLINE), "--liveness-timeout", "20"),
        *("--linger", "4", "--repair-interval", "1", "--min-peers", "2"),
        *("--eval-every", str(rounds), "--eval-examples", "200"),
    ]


def make_identities(keys: Path, seed: int) -> dict[str, str]:
    """One Ed25519 key file per honest node under KEYS/NODE/identity.key, derived from
    (seed, node) so that a re-run of one attack meets the same honest peers; {node: id}."""
    import hashlib

    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.proto import crypto_pb2

    from seedflood_p2p.network.transport.identity import load_or_create_identity

    ids = {}
    for node in NODES:
        path = keys / node / "identity.key"
        path.parent.mkdir(parents=True, exist_ok=True)
        secret = hashlib.sha256(f"bench_hostile/{seed}/{node}".encode()).digest()
        public = (
            Ed25519PrivateKey.from_private_bytes(secret)
            .public_key()
            .public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
        )  # the key file format of network/transport/identity.py (libp2p crypto.pb.PrivateKey)
        blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=secret + public)
        path.write_bytes(blob.SerializeToString())
        path.chmod(0o600)
        ids[node] = load_or_create_identity(path).to_base58()  # checks the file as a peer does
    return ids


def use_identity(keys: Path, work: Path, node: str) -> None:
    """Give NODE's data dir in WORK the seed's key file (mode 0600 kept)."""
    (work / node).mkdir(parents=True, exist_ok=True)
    shutil.copy2(keys / node / "identity.key", work / node / "identity.key")


def replay_and_evaluate(ledger_path: Path, examples: int) -> dict:
    """The replay hash of a ledger and the replayed model's loss on each held-out example."""
    import torch
    import torch.nn.functional as F

    from seedflood_p2p.algorithm.objective import batch_loss, label_word_logits
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.batching import make_batch
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.models import load_model, weights_sha256

    with Ledger.open_existing(ledger_path) as ledger:
        config = ledger.config
        model, tokenizer = load_model(config.model)
        replay(model, config, ledger.messages())
    task = load_task(config.dataset)
    losses = []
    with torch.no_grad():
        for example in task.test[:examples]:
            batch = make_batch([example], tokenizer, task, config.max_length)
            if task.kind == "classification":
                logits = label_word_logits(model, batch)
                losses.append(F.cross_entropy(logits, batch["labels"]).item())
            else:
                losses.append(batch_loss(model, batch, task.kind)[0])
    return {"replay_sha256": weights_sha256(model), "example_losses": losses}


def run(
    attack: str,
    rounds: int,
    work: Path,
    seed: int,
    keys: Path,
    examples: int,
    run_settings: dict | None = None,
) -> dict:
    import base58

    from seedflood_p2p.storage.ledger import Ledger

    procs, attacker = [], None
    started = time.time()
    run_config = dataclasses.replace(RUN, salt=f"hostile-bench-{seed}", **(run_settings or {}))
    try:
        use_identity(keys, work, "bootstrap")
        boot, address = start_bootstrap(work, run_config)
        procs.append(boot)
        flags = peer_flags(rounds)
        for node in HONEST:
            use_identity(keys, work, node)
        peers = {n: start_peer(work, n, address, flags) for n in ("a", "b", "c")}
        procs += peers.values()
        peers["a"].wait_round(3, timeout=600)
        run_id = Ledger.open_existing(work / "bootstrap" / "ledger.sqlite").run_id
        if attack != "none":
            attacker = Hostile(address, run_id, PHASES[attack], seed=seed)
            attacker.start()
            assert attacker.ready.wait(300) and attacker.error is None, attacker.error
        peers["a"].wait_round(8, timeout=600)
        peers["e"] = start_peer(work, "e", address, flags)
        procs.append(peers["e"])
        codes = {n: p.wait_exit(900) for n, p in peers.items()}
    finally:
        if attacker is not None:
            attacker.done.set()
            attacker.join(60)
        for p in procs:
            p.stop()
    finals = {n: json.loads((work / n / "final_status.json").read_text()) for n in peers}
    attacker_id = base58.b58encode(attacker.peer_id).decode() if attacker else None
    with Ledger.open_existing(work / "a" / "ledger.sqlite") as ledger:
        messages = list(ledger.messages())
    attacker_rows = sum(m.peer == attacker.peer_id for m in messages) if attacker else 0
    deadlines = {
        n: [e for e in p.events() if e.get("event") == "deadline"] for n, p in peers.items()
    }
    ready = [e["round"] for e in peers["e"].events() if e.get("event") == "ready"]
    evaluated = replay_and_evaluate(work / "a" / "ledger.sqlite", examples)
    losses = evaluated["example_losses"]
    for_attacker = {
        n: sum(attacker_id in e.get("slow", []) for e in d) for n, d in deadlines.items()
    }
    return {
        "attack": attack,
        "seed": seed,
        "run_id": run_id,
        "peer_ids": {n: f["peer_id"] for n, f in finals.items()},
        "attacker_id": attacker_id,
        "exit_codes": codes,
        "replay_loss": statistics.fmean(losses),
        "replay_loss_se": statistics.stdev(losses) / math.sqrt(len(losses)),
        "example_losses": losses,
        "held_out_loss": {n: f["eval"][0] if f.get("eval") else None for n, f in finals.items()},
        "final_rounds": {n: f["round"] for n, f in finals.items()},
        "ledger_digests": {n: f["ledger_digest"] for n, f in finals.items()},
        "ledgers_identical": len({f["ledger_digest"] for f in finals.values()}) == 1,
        "ledger_rows": len(messages),
        "attacker_rows": attacker_rows,
        "attacker_published": attacker.report["published"] if attacker else 0,
        "attacker_banned_by": sorted(
            n for n, f in finals.items() if attacker_id in {b["peer"] for b in f["banned"]}
        ),
        "deadlines_waited": {n: len(d) for n, d in deadlines.items()},
        "deadlines_for_attacker": for_attacker,
        # seconds each honest peer waited at round deadlines that named the attacker
        "stall_for_attacker_s": {n: c * ROUND_DEADLINE for n, c in for_attacker.items()},
        "late_joiner_ready_round": ready[0] if ready else None,
        "replay_sha256": evaluated["replay_sha256"],
        "wall_seconds": round(time.time() - started, 1),
    }


def summarize(runs: list[dict], attacks: list[str]) -> list[dict]:
    """Per attack: replayed held-out loss over seeds, the paired difference against `none`
    of the same seed, stalls, late joiner, ledgers."""
    baseline = {r["seed"]: r for r in runs if r["attack"] == "none"}
    out = []
    for attack in attacks:
        rows = [r for r in runs if r["attack"] == attack]
        losses = [r["replay_loss"] for r in rows]
        diffs, diff_example_se = [], []
        for r in rows:
            base = baseline.get(r["seed"])
            if base is None or attack == "none":
                continue
            per_example = [x - y for x, y in zip(r["example_losses"], base["example_losses"])]
            diffs.append(statistics.fmean(per_example))
            diff_example_se.append(statistics.stdev(per_example) / math.sqrt(len(per_example)))
        out.append(
            {
                "attack": attack,
                "seeds": len(rows),
                "loss_mean": statistics.fmean(losses) if losses else None,
                "loss_se": _se(losses),
                "paired_diff_mean": statistics.fmean(diffs) if diffs else None,
                "paired_diff_se": _se(diffs),
                "paired_diffs": diffs,
                "paired_diff_example_se": diff_example_se,
                "eval_example_se": [r["replay_loss_se"] for r in rows],
                "stall_for_attacker_s_max_peer": max(
                    (max(r["stall_for_attacker_s"].values()) for r in rows), default=0.0
                ),
                "stall_for_attacker_s_all_peers": [
                    sum(r["stall_for_attacker_s"].values()) for r in rows
                ],
                "deadlines_waited": [sum(r["deadlines_waited"].values()) for r in rows],
                "late_joiner_ready_rounds": [r["late_joiner_ready_round"] for r in rows],
                "final_rounds": sorted({x for r in rows for x in r["final_rounds"].values()}),
                "ledgers_identical": all(r["ledgers_identical"] for r in rows),
                "attacker_rows": [r["attacker_rows"] for r in rows],
                "attacker_banned_by": [r["attacker_banned_by"] for r in rows],
            }
        )
    return out


def _se(values: list[float]) -> float | None:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def _pm(mean: float | None, se: float | None, signed: bool = False) -> str:
    if mean is None:
        return "-"
    text = f"{mean:+.4f}" if signed else f"{mean:.4f}"
    return text + ("" if se is None else f" +- {se:.4f}")


def write_markdown(result: dict, path: Path) -> None:
    examples = result["eval_examples"]
    lines = [
        "# One hostile identity among four honest peers: a controlled comparison",
        "",
        f"`{result['command']}`, {result['date']}, {result['machine']}; load average "
        f"(1/5/15 min) {_load(result['loadavg_start'])} at start, "
        f"{_load(result['loadavg_end'])} at end; {result['wall_s']} s in all.",
        "",
        f"Three honest tiny-model peers from round 0 and a late joiner (after round 8), "
        f"{result['rounds']} rounds, 1.5 s per round, round deadline {ROUND_DEADLINE:g} s; "
        "one attacker identity per row (harness/hostile.py). Within a seed every row is the "
        "same run (manifest) with the same four honest identities (key files reused), so "
        "the honest directions and batches are the same; only the attacker and the "
        "machine's timing differ. Held-out loss: base weights + peer a's ledger replayed, "
        f"on all {examples} held-out examples.",
        "",
        *_run_line(result),
        "## Per attack",
        "",
        f"| attack | held-out loss (mean +- SE over {result['seeds']} seeds) | paired "
        "difference vs none (mean +- SE over seeds) | stall for the attacker, worst peer "
        "(s) | late joiner ready at round | ledgers identical |",
        "|---|---|---|---|---|---|",
    ]
    for a in result["summary"]:
        lines.append(
            f"| {a['attack']} | {_pm(a['loss_mean'], a['loss_se'])} | "
            f"{_pm(a['paired_diff_mean'], a['paired_diff_se'], True)} | "
            f"{a['stall_for_attacker_s_max_peer']:g} | {a['late_joiner_ready_rounds']} | "
            f"{'yes' if a['ledgers_identical'] else 'NO'} |"
        )
    example_se = [se for a in result["summary"] for se in a["eval_example_se"]]
    diff_se = [se for a in result["summary"] for se in a["paired_diff_example_se"]]
    lines += [
        "",
        f"Noise: one run's loss on {examples} examples has a per-example standard error of "
        f"{min(example_se):.4f}-{max(example_se):.4f}; a paired difference (same examples, "
        f"same seed) {min(diff_se, default=0):.4f}-{max(diff_se, default=0):.4f}. "
        "The SE over seeds (n = 3) also holds the run-to-run noise of timing: which "
        "updates a peer had applied when it estimated its own.",
        "",
        "Stall for the attacker: round deadlines (3 s each) an honest peer waited out whose "
        "slow list named the attacker (the target: at most one deadline in all).",
        "",
        "## Every run",
        "",
        "| seed | attack | replayed loss +- example SE | peers' own eval (200 ex.) | final "
        "rounds | ledgers identical | replay sha256 | attacker rows / sent | banned by | "
        "deadlines waited (for the attacker) | late joiner ready at | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        own = [x for x in r["held_out_loss"].values() if x is not None]
        own_text = f"{min(own):.4f}-{max(own):.4f}" if own else "n/a"
        rounds = sorted(set(r["final_rounds"].values()))
        waited = sum(r["deadlines_waited"].values())
        for_attacker = sum(r["deadlines_for_attacker"].values())
        lines.append(
            f"| {r['seed']} | {r['attack']} | {r['replay_loss']:.4f} +- "
            f"{r['replay_loss_se']:.4f} | {own_text} | {rounds} | "
            f"{'yes' if r['ledgers_identical'] else 'NO'} | {r['replay_sha256'][:12]} | "
            f"{r['attacker_rows']} / {r['attacker_published']} | "
            f"{', '.join(r['attacker_banned_by']) or '-'} | {waited} ({for_attacker}) | "
            f"{r['late_joiner_ready_round']} | {r['wall_seconds']} |"
        )
    lines += [
        "",
        "Replay hashes differ between rows of a seed: the attacker's accepted rows, and the "
        "timing of what each peer had applied when it estimated, change the honest scalars. "
        "Within a row every honest ledger is the same.",
    ]
    path.write_text("\n".join(lines) + "\n")


def _run_line(result: dict) -> list[str]:
    """How the run applied scalars (`normalize`) and its lr, when the results record it."""
    run = result.get("run")
    if not run:
        return []
    return [f"Run settings: normalize = {run['normalize']!r}, lr = {run['lr']:g}.", ""]


def _load(load: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--attacks", default="none,flood,tarpit,stall")
    parser.add_argument("--eval-examples", type=int, default=400, help="held-out examples")
    parser.add_argument("--name", default="hostile", help="results file name (no suffix)")
    parser.add_argument(
        "--normalize", default=None, help="the run's normalize setting (default: RUN's)"
    )
    parser.add_argument("--lr", type=float, default=None, help="the run's lr (default: RUN's)")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite NAME.md from NAME.json (no runs)"
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep NAME.json's runs, replacing those of the same seed and attack",
    )
    args = parser.parse_args()
    out = ROOT / "bench" / "results"
    if args.render:
        result = json.loads((out / f"{args.name}.json").read_text())
        result["summary"] = summarize(result["runs"], result["attacks"])
        write_markdown(result, out / f"{args.name}.md")
        print((out / f"{args.name}.md").read_text())
        return
    attacks = args.attacks.split(",")
    settings = {k: v for k in ("normalize", "lr") if (v := getattr(args, k)) is not None}
    started, load_start = time.time(), os.getloadavg()
    kept = []
    if args.append:
        before = json.loads((out / f"{args.name}.json").read_text())
        kept = [r for r in before["runs"] if r["attack"] not in attacks]
        attacks = [a for a in before["attacks"] if a not in attacks] + attacks
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "command": "nice -n 19 python bench/bench_hostile.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} shared cores",
        "loadavg_start": load_start,
        "rounds": args.rounds,
        "seeds": args.seeds,
        "run": dataclasses.asdict(dataclasses.replace(RUN, **settings)),
        "attacks": attacks,
        "runs": kept,
    }
    runs = result["runs"]
    with tempfile.TemporaryDirectory(prefix="hostile-keys-") as keys_dir:
        for seed in range(args.seeds):
            keys = Path(keys_dir) / f"seed{seed}"
            print(f"seed {seed}: honest identities {make_identities(keys, seed)}", flush=True)
            for attack in args.attacks.split(","):
                with tempfile.TemporaryDirectory(prefix=f"hostile-{attack}-") as tmp:
                    print(f"running: seed {seed}, {attack}", flush=True)
                    work, examples = Path(tmp), args.eval_examples
                    runs.append(run(attack, args.rounds, work, seed, keys, examples, settings))
                    runs[-1]["commit"] = commit
                    shown = {k: v for k, v in runs[-1].items() if k != "example_losses"}
                    print(json.dumps(shown, indent=1), flush=True)
                # every run is kept at once: a session that ends early keeps what it measured
                result["loadavg_end"] = os.getloadavg()
                result["wall_s"] = round(time.time() - started)
                result["eval_examples"] = len(runs[-1]["example_losses"])
                (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    result["summary"] = summarize(runs, attacks)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, out / f"{args.name}.md")
    print((out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
