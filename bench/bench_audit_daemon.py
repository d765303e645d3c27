"""Audits against real daemons: 4 honest peers + a sign-flipper, a random-scalar
sender and a x3 scaler, each its own process and p2pd on 127.0.0.1 (tiny model).

    nice -n 19 python bench/bench_audit_daemon.py [--rounds 60] [--rates default,high]

Per audit rate (the run's `extra.audit`; lag 2 with --max-staleness 1, quorum 3):

    default   cpu_share 0.10, the production default (q = 0.1 / 6 per auditor here)
    high      cpu_share 1.0 (q = 1 / 6): a test setting, to see bans within a short run
    every     cpu_share 6.0 (q = 1): every peer audits every other peer's update, to count
              false accusations over many audits (`--honest-only`)

two runs with the same manifest, so the same run id and, with the same identity keys (the
honest-only run's key files are copied into the cheaters' run), the same seeds for the
honest peers: an honest-only run (4 peers) and the run with the three cheaters
(harness/hooked_peer.py `--cheat flip|random|x3`; a cheater still audits
honestly). Recorded per run: the round at which each honest peer banned each cheater
(its log's `audit_ban` line, at its current training round) and the rounds until
every honest peer banned it; the verdicts and mismatches against honest peers (target 0);
honest peers' held-out loss (live model, 200 examples) and the loss of a replay of one
honest ledger as `seedflood replay` judges it (banned peers' updates void); the audit CPU
share per honest peer (model-thread CPU seconds in audits / in its own training steps,
peer/audit_duty.py); whether the honest ledgers' audit tables and judgements agree.
Writes bench/results/audit_daemon.{json,md} (`--name` for another file name).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness.cluster import RUN, start_hooked_peer  # noqa: E402
from seedflood_p2p.apps.localnet import start_bootstrap, start_peer  # noqa: E402

HONEST = ["a", "b", "c", "d"]
CHEATERS = {"x": "flip", "y": "random", "z": "x3"}
RATES = {
    "default": {"lag": 2, "quorum": 3},  # cpu_share: AuditSettings' default, 0.10
    "high": {"lag": 2, "quorum": 3, "cpu_share": 1.0},
    "every": {"lag": 2, "quorum": 3, "cpu_share": 6.0},  # q = 1: each peer audits every update
}
EVAL_EXAMPLES = 200


def peer_flags(rounds: int, peers: int) -> list[str]:
    return [
        *("--until-round", str(rounds), "--round-interval", "0.4", "--max-staleness", "1"),
        *("--round-deadline", "20", "--linger", "4", "--repair-interval", "1"),
        *("--min-peers", str(peers - 1), "--eval-every", str(rounds)),
        *("--eval-examples", str(EVAL_EXAMPLES)),
    ]


def ban_rounds(events: list[dict]) -> dict[str, int]:
    """{banned peer: the training round this peer was in when it banned it}, from its log."""
    current, out = -1, {}
    for e in events:
        if e.get("event") == "round":
            current = e["round"]
        elif e.get("event") == "audit_ban":
            out.setdefault(e["peer"], current)
    return out


def judged(ledger_path: Path) -> dict:
    """What `seedflood replay` makes of a ledger: its judgement, and the held-out loss of
    the replayed model without the banned peers' updates."""
    from seedflood_p2p.algorithm.audit_rules import judge_ledger
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.algorithm.trainer import evaluate
    from seedflood_p2p.storage.ledger import Ledger, peer_name
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.models import load_model, weights_sha256

    with Ledger.open_existing(ledger_path) as ledger:
        config = ledger.config
        counted, judgement = judge_ledger(ledger, config.audit)
        audits = ledger.audits()
    model, tokenizer = load_model(config.model)
    replay(model, config, counted)
    task = load_task(
        config.dataset, text_column=config.text_column, label_column=config.label_column
    )
    loss, accuracy = evaluate(model, tokenizer, task, config, EVAL_EXAMPLES)
    return {
        "banned": {peer_name(p): why for p, why in judgement.banned.items()},
        "cases": [
            {
                "accused": peer_name(c.accused),
                "round": c.round,
                "outcome": c.outcome,
                "mismatch_votes": len(c.mismatch),
                "match_votes": len(c.match),
            }
            for c in judgement.cases
        ],
        "audit_records": len(audits),
        "audit_table": sorted(
            (peer_name(r.accused), r.round, peer_name(r.auditor), r.scalars) for r in audits
        ),
        "counted_updates": len(counted),
        "replay_loss": loss,
        "replay_accuracy": accuracy,
        "replay_sha256": weights_sha256(model),
    }


def pause_when(proc, round_: int, seconds: float, log: list) -> None:
    """Freeze `proc` (the daemon and its p2pd, SIGSTOP) once it has logged `round_`, for
    `seconds`: a volunteer's laptop that sleeps. The others go on without it after
    --round-deadline; when it wakes it publishes the rounds it owes late."""
    while proc.alive and proc.last_round() < round_:
        time.sleep(0.2)
    if not proc.alive:
        return
    log.append({"peer": proc.name, "after_round": round_, "seconds": seconds})
    proc.freeze(seconds)


def run(
    rate: str,
    cheaters: dict[str, str],
    rounds: int,
    work: Path,
    keys: Path | None,
    pause: tuple[str, int, float] | None = None,
) -> dict:
    names = HONEST + sorted(cheaters)
    config = dataclasses.replace(RUN, extra={"audit": RATES[rate]})
    started = time.time()
    procs = []
    try:
        boot, address = start_bootstrap(work, config)
        procs.append(boot)
        peers = {}
        for name in names:
            if keys is not None and (keys / name / "identity.key").exists():
                (work / name).mkdir(parents=True, exist_ok=True)
                shutil.copy(keys / name / "identity.key", work / name / "identity.key")
            flags = peer_flags(rounds, len(names))
            if name in cheaters:
                flags += ["--cheat", cheaters[name]]
            start = start_hooked_peer if name in cheaters else start_peer
            peers[name] = start(work, name, address, flags)
        procs += peers.values()
        paused: list = []
        if pause is not None:
            name, after, seconds = pause
            threading.Thread(
                target=pause_when, args=(peers[name], after, seconds, paused), daemon=True
            ).start()
        codes = {n: p.wait_exit(1800) for n, p in peers.items()}
        finals = {
            n: json.loads((work / n / "final_status.json").read_text())
            for n, code in codes.items()
            if code == 0
        }
        bans = {n: ban_rounds(peers[n].events()) for n in HONEST}
    finally:
        for p in procs:
            p.stop()
    ids = {n: f["peer_id"] for n, f in finals.items()}
    for name, proc in peers.items():  # a peer that failed: its id from its `join` line
        joined = [e["peer_id"] for e in proc.events() if e.get("event") == "join"]
        if name not in ids and joined:
            ids[name] = joined[0]
    honest_ids = {ids[n] for n in HONEST if n in ids}
    first = judged(work / HONEST[0] / "ledger.sqlite")
    others = [judged(work / n / "ledger.sqlite") for n in HONEST[1:]]
    banned_by_all = {}
    for name, kind in cheaters.items():
        rounds_seen = [bans[h].get(ids.get(name)) for h in HONEST]
        banned_by_all[kind] = None if None in rounds_seen else max(rounds_seen)
    per_peer = {}
    for name in HONEST:
        final = finals.get(name, {})
        audits = final.get("audits") or {}
        cpu = audits.get("cpu_seconds", {})
        per_peer[name] = {
            "exit": codes[name],
            "final_round": final.get("round"),
            "eval_loss": (final.get("eval") or [None])[0],
            "audits_done": audits.get("done"),
            "mismatches": audits.get("mismatches"),
            "published": audits.get("published"),
            "q": audits.get("rate"),
            "retries": audits.get("retries"),
            "held_state": audits.get("held_state"),
            "records": audits.get("records"),
            "banned": audits.get("banned"),
            "ban_rounds": {k: bans[name].get(ids.get(c)) for c, k in cheaters.items()},
            "audit_cpu_s": cpu.get("audit", 0.0),
            "train_cpu_s": cpu.get("train", 0.0),
            "audit_cpu_share": cpu.get("audit", 0.0) / max(cpu.get("train", 0.0), 1e-9),
        }
    verdicts_against_honest = sorted(set(first["banned"]) & honest_ids)
    return {
        "rate": rate,
        "audit": RATES[rate],
        "run_id": config.run_id,
        "peers": {n: ids.get(n) for n in names},
        "cheaters": {ids.get(n): k for n, k in cheaters.items()},
        "rounds": rounds,
        "paused": paused,
        "exit_codes": codes,
        "rounds_until_banned_by_every_honest_peer": banned_by_all,
        "verdicts_against_honest": verdicts_against_honest,
        "honest_cases_decided": [
            c for c in first["cases"] if c["accused"] in honest_ids and c["outcome"] != "open"
        ],
        "honest_mismatch_votes": sum(
            c["mismatch_votes"] for c in first["cases"] if c["accused"] in honest_ids
        ),
        "honest_ledgers_agree": {
            "audit_tables": all(o["audit_table"] == first["audit_table"] for o in others),
            "banned": all(o["banned"] == first["banned"] for o in others),
            "replay": all(o["replay_sha256"] == first["replay_sha256"] for o in others),
        },
        "judged": {k: v for k, v in first.items() if k != "audit_table"},
        "per_peer": per_peer,
        "mean_eval_loss": _mean([p["eval_loss"] for p in per_peer.values()]),
        "mean_audit_cpu_share": _mean([p["audit_cpu_share"] for p in per_peer.values()]),
        "q": _mean([p["q"] for p in per_peer.values()]),  # as the peers set it at the end
        "audits_done": sum(p["audits_done"] or 0 for p in per_peer.values()),
        "seconds": round(time.time() - started, 1),
    }


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# Audits against real daemons (bench/bench_audit_daemon.py)",
        "",
        f"{result['machine']}; tiny model, {result['rounds']} rounds, 4 honest peers + "
        "flip + random + x3 (test hook), lag 2, --max-staleness 1, quorum 3; per rate an "
        "honest-only run with the same manifest and identity keys. "
        f"Total {result['seconds']:.0f} s."
        + (
            f" Paused (SIGSTOP, a sleeping laptop): {result['pause']}; the peers' audit "
            f"retries on late-update states (tried / matched): {result['late_retries']}; "
            "audits by the sender's held-state digest (on the settled state / on a state "
            f"rebuilt without the rows it lacked / not explained): {result.get('held', {})}."
            if result.get("pause")
            else ""
        ),
        "",
        "| rate | q per auditor | run | rounds to ban flip / random / x3 (every honest peer) "
        "| verdicts vs honest | mismatch votes vs honest | honest eval loss (live) "
        "| replay loss (voided) | audit CPU / training CPU | audits done per peer "
        "| ledgers agree (audits, bans, replay) | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, pair in result["runs"].items():
        for label, r in pair.items():
            bans = r["rounds_until_banned_by_every_honest_peer"]
            agree = r["honest_ledgers_agree"]
            share = r["mean_audit_cpu_share"]
            done = [p["audits_done"] for p in r["per_peer"].values()]
            loss = r["mean_eval_loss"]
            lines.append(
                f"| {rate} | {r.get('q') or result['q'][rate]:.4f} | {label} | "
                + " / ".join(str(bans.get(k, "-")) for k in ("flip", "random", "x3"))
                + f" | {len(r['verdicts_against_honest'])} | {r['honest_mismatch_votes']} | "
                + (f"{loss:.4f}" if loss is not None else "-")
                + f" | {r['judged']['replay_loss']:.4f} | "
                + (f"{share:.3f}" if share is not None else "-")
                + f" | {done} | {agree['audit_tables']}, {agree['banned']}, {agree['replay']}"
                + f" | {r['seconds']:.0f} |"
            )
    lines += [
        "",
        "Rounds to ban: the highest training round at which an honest peer logged the ban "
        "(`-`: not banned by every honest peer within the run). Verdicts vs honest: honest "
        "peers the first honest ledger's judgement bans (target 0). Mismatch votes vs "
        "honest: audit records that contradict an honest peer's claim. Replay loss: "
        "`seedflood replay`'s model (banned peers' updates void) of the first honest ledger, "
        f"{EVAL_EXAMPLES} held-out examples. Audit CPU share: model-thread CPU seconds in "
        "recomputations over those in the peer's own training steps, mean over honest "
        "peers (re-checks after an accusation included).",
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--rates", default="default,high")
    parser.add_argument("--name", default="audit_daemon", help="results file name (no suffix)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    parser.add_argument(
        "--pause",
        default="",
        metavar="PEER:ROUND:SECONDS",
        help="freeze honest peer PEER (a-d) after its round ROUND for SECONDS (a sleeping "
        "laptop: it then publishes its rounds late)",
    )
    parser.add_argument(
        "--honest-only", action="store_true", help="skip the run with the three cheaters"
    )
    args = parser.parse_args()
    pause = None
    if args.pause:
        name, after, seconds = args.pause.split(":")
        if name not in HONEST:
            parser.error(f"--pause: PEER must be one of {HONEST}")
        pause = (name, int(after), float(seconds))
    from seedflood_p2p.algorithm.audit_rules import audit_rate
    from seedflood_p2p.core.extra_settings import AuditSettings

    started = time.time()
    n = len(HONEST) + len(CHEATERS)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "rounds": args.rounds,
        "q": {r: audit_rate(n, AuditSettings.of({"audit": RATES[r]}).cpu_share) for r in RATES},
        "runs": {},
        "pause": args.pause,
    }
    out = ROOT / "bench" / "results"
    for rate in args.rates.split(","):
        with contextlib.ExitStack() as stack:
            if args.keep:
                tmp = tempfile.mkdtemp(prefix=f"audit-{rate}-")
                print("work dir", tmp)
            else:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"audit-{rate}-"))
            honest_dir, cheat_dir = Path(tmp) / "honest", Path(tmp) / "cheat"
            honest_dir.mkdir()
            cheat_dir.mkdir()
            honest = run(rate, {}, args.rounds, honest_dir, None, pause)
            print(json.dumps({k: honest[k] for k in ("rate", "seconds", "mean_eval_loss")}))
            result["runs"][rate] = {"honest-only": honest}
            if not args.honest_only:
                cheat = run(rate, CHEATERS, args.rounds, cheat_dir, honest_dir, pause)
                print(json.dumps({k: cheat[k] for k in ("rate", "seconds", "mean_eval_loss")}))
                print(json.dumps(cheat["rounds_until_banned_by_every_honest_peer"]))
                result["runs"][rate]["with cheaters"] = cheat
        result["late_retries"] = {
            f"{rate}/{label}/{name}": [
                (p["retries"] or {}).get(k) for k in ("late_state_retries", "late_state_matches")
            ]
            for rate, pair in result["runs"].items()
            for label, r in pair.items()
            for name, p in r["per_peer"].items()
        }
        result["held"] = {
            f"{rate}/{label}/{name}": [
                (p.get("held_state") or {}).get(k) for k in ("exact", "found", "unknown")
            ]
            for rate, pair in result["runs"].items()
            for label, r in pair.items()
            for name, p in r["per_peer"].items()
        }
        result["seconds"] = time.time() - started
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
        write_markdown(result, out / f"{args.name}.md")


if __name__ == "__main__":
    main()
