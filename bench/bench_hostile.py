"""One hostile identity among four honest peers, per attack, against real daemons.

    nice -n 19 python bench/bench_hostile.py [--rounds 40] [--attacks none,flood,tarpit,stall]

Each row is its own run on 127.0.0.1: a bootstrap node, three honest tiny-model peers from
round 0, a fourth honest peer joining late (after round 8), and, except for `none`, one
attacker identity (tests/hostile.py, the same one tests/test_hostile.py uses):

    flood    400 valid signed updates of +-100 on fresh rounds, a 100-step window walk
             of +50 rounds, then an equivocation
    tarpit   repair replies: 2,000 claimed buckets, 8 s replies, bad-signature pages
    stall    live with a round a few behind the run, heard every 3 s

Recorded per run: the honest peers' held-out loss after the last round (200 examples),
their final rounds, whether their ledgers are identical, the replay hash of one honest
ledger (base weights + ledger, canonical replay), the attacker's rows in it, the round
deadlines honest peers waited out, the late joiner's ready round, and the attacker's
ban. Writes bench/results/hostile.{json,md} (`--name` for another file name).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from hostile import Hostile  # noqa: E402

from cluster import start_bootstrap, start_peer  # noqa: E402

PHASES = {"flood": ["flood", "walk", "equivocate"], "tarpit": ["tarpit"], "stall": ["stall"]}
ROUND_DEADLINE = 3.0


def peer_flags(rounds: int) -> list[str]:
    return [
        *("--until-round", str(rounds), "--round-interval", "1.5", "--max-staleness", "2"),
        *("--round-deadline", str(ROUND_DEADLINE), "--liveness-timeout", "20"),
        *("--linger", "4", "--repair-interval", "1", "--min-peers", "2"),
        *("--eval-every", str(rounds), "--eval-examples", "200"),
    ]


def replay_hash(ledger_path: Path) -> str:
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model, weights_sha256

    with Ledger.open_existing(ledger_path) as ledger:
        config = RunConfig.from_json(ledger.get_meta("manifest"))
        model, _ = load_model(config.model)
        replay(model, config, ledger.messages())
    return weights_sha256(model)


def run(attack: str, rounds: int, work: Path) -> dict:
    import base58

    from seedflood_p2p.storage.ledger import Ledger

    procs, attacker = [], None
    started = time.time()
    try:
        boot, address = start_bootstrap(work)
        procs.append(boot)
        flags = peer_flags(rounds)
        peers = {n: start_peer(work, n, address, flags) for n in ("a", "b", "c")}
        procs += peers.values()
        peers["a"].wait_round(3, timeout=600)
        run_id = Ledger.open_existing(work / "bootstrap" / "ledger.sqlite").run_id
        if attack != "none":
            attacker = Hostile(address, run_id, PHASES[attack], seed=1)
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
    return {
        "attack": attack,
        "exit_codes": codes,
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
        "deadlines_for_attacker": {
            n: sum(attacker_id in e.get("slow", []) for e in d) for n, d in deadlines.items()
        },
        "late_joiner_ready_round": ready[0] if ready else None,
        "replay_sha256": replay_hash(work / "a" / "ledger.sqlite"),
        "wall_seconds": round(time.time() - started, 1),
    }


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# One hostile identity among four honest peers",
        "",
        f"`{result['command']}`, {result['date']}, {result['machine']}.",
        "",
        f"Three honest tiny-model peers from round 0 and a late joiner (after round 8), "
        f"{result['rounds']} rounds, 1.5 s per round, round deadline {ROUND_DEADLINE:g} s; "
        "one attacker identity per row (tests/hostile.py). Held-out loss: each honest "
        "peer's live model after the last round, 200 examples (min-max over the four).",
        "",
        "| attack | held-out loss | final rounds | ledgers identical | replay sha256 | "
        "attacker rows / sent | banned by | deadlines waited (for the attacker) | "
        "late joiner ready at | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        losses = [x for x in r["held_out_loss"].values() if x is not None]
        loss = f"{min(losses):.4f}-{max(losses):.4f}" if losses else "n/a"
        rounds = sorted(set(r["final_rounds"].values()))
        waited = sum(r["deadlines_waited"].values())
        for_attacker = sum(r["deadlines_for_attacker"].values())
        lines.append(
            f"| {r['attack']} | {loss} | {rounds} | {'yes' if r['ledgers_identical'] else 'NO'} "
            f"| {r['replay_sha256'][:12]} | {r['attacker_rows']} / {r['attacker_published']} "
            f"| {', '.join(r['attacker_banned_by']) or '-'} | {waited} ({for_attacker}) | "
            f"{r['late_joiner_ready_round']} | {r['wall_seconds']} |"
        )
    lines += [
        "",
        "Replay hashes differ between rows because the rows are different runs (peer ids, "
        "and so seeds, are new each run); within a row every honest ledger is the same.",
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--attacks", default="none,flood,tarpit,stall")
    parser.add_argument("--name", default="hostile", help="results file name (no suffix)")
    args = parser.parse_args()
    runs = []
    for attack in args.attacks.split(","):
        with tempfile.TemporaryDirectory(prefix=f"hostile-{attack}-") as tmp:
            print(f"running: {attack}", flush=True)
            runs.append(run(attack, args.rounds, Path(tmp)))
            print(json.dumps(runs[-1], indent=1), flush=True)
    result = {
        "command": "python bench/bench_hostile.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, 2 shared cores",
        "rounds": args.rounds,
        "runs": runs,
    }
    out = ROOT / "bench" / "results"
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, out / f"{args.name}.md")
    print((out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
