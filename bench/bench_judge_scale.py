"""What one judgement of an audited run's ledger costs as the run grows, before and after.

An audited daemon judges its ledger (`probation.standing_of_ledger`: every audit record,
the claims of the rows they audit, who has rows) whenever new records arrive, one pass at
a time (peer/audit_duty.py `DaemonAudits`). At the production audit rate a run of 1,000
peers logs ~100 records a round, so a ledger of a million rows holds ~100,000 records and
one of ten million ~1,000,000. This times one judgement on a SQLite ledger of PEERS peers
x ROUNDS rounds holding the rows the records audit and the records (synthetic, unsigned:
the judgement reads neither signatures nor other rows), split into reading the ledger and
`standing`, with the standing code of REV (default: before the twentieth session's
changes) and of the working tree side by side, on the same ledger, in one process, and
checks that both give the same standing.

    python bench/bench_judge_scale.py [--peers 1000] [--rounds 100 1000]
        [--accused 0 0.001] [--rev cc264b2] [--name judge-scale]

`--accused`: the share of audits that are accusations (each re-checked by three others).
Writes bench/results/NAME.{json,md} after each row.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def old_probation(rev: str):
    """seedflood_p2p/algorithm/probation.py as of `rev`, as a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:seedflood_p2p/algorithm/probation.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    spec = importlib.util.spec_from_loader("probation_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules["probation_before"] = module  # (its dataclasses look their module up)
    exec(compile(source, f"probation.py@{rev}", "exec"), module.__dict__)
    return module


def build_ledger(path: Path, peers: int, rounds: int, accused: float):
    """A ledger of the rows the records audit, and the records (bench_standing_summary's
    synthetic run with `accused` of the audits accusations)."""
    from bench_standing_summary import synthetic

    from seedflood_p2p.protocol.message import UpdateMessage
    from seedflood_p2p.storage.ledger import Ledger

    ids, claims, records = synthetic(peers, rounds, accused=accused)
    audited = {(r.round, r.accused) for r in records} | {(0, p) for p in ids}
    rows = [UpdateMessage(t, p, claims[(t, p)]) for (t, p) in sorted(audited)]
    ledger = Ledger(path, "judge-scale")
    ledger.add(rows)
    ledger.add_audits(records)
    return ledger, ids, len(records)


def time_judgement(ledger, module, settings, probation) -> tuple[dict, object]:
    """Seconds to read what a judgement reads, and for `module.standing`."""
    started = time.perf_counter()
    records = ledger.audits()
    claims = ledger.claims((r.round, r.accused) for r in records)
    revoked = module.revoked_rounds(ledger.revocations())
    seen = ledger.peers()
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    st = module.standing(claims, records, settings, probation, revoked, seen)
    return {"read_s": round(read_s, 2), "standing_s": round(time.perf_counter() - started, 2)}, st


def measure(peers: int, rounds: int, accused: float, rev: str) -> dict:
    import seedflood_p2p.algorithm.probation as after_module
    from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings

    before_module = old_probation(rev)
    settings = AuditSettings(enabled=True, lag=1)
    with tempfile.TemporaryDirectory() as tmp:
        ledger, ids, n_records = build_ledger(Path(tmp) / "ledger.sqlite", peers, rounds, accused)
        row = {"peers": peers, "rounds": rounds, "accused": accused, "records": n_records}
        for label, probation in (
            ("probation", ProbationSettings(founders=frozenset(ids[:4]), vouches=3)),
            ("open", ProbationSettings()),
        ):
            before, st_before = time_judgement(ledger, before_module, settings, probation)
            after, st_after = time_judgement(ledger, after_module, settings, probation)
            # the same standing: compared field by field (two modules' classes)
            same = dataclasses.asdict(st_before) == dataclasses.asdict(st_after)
            assert same, f"{label}: the standings differ"
            row[label] = {
                "before": before,
                "after": after,
                "established": len(st_after.established),
                "banned": len(st_after.banned),
                "same_standing": True,
            }
        ledger.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--rounds", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--accused", type=float, nargs="+", default=[0.0, 0.001])
    parser.add_argument("--rev", default="cc264b2")
    parser.add_argument("--name", default="judge-scale")
    args = parser.parse_args()
    rows = []
    for rounds in args.rounds:
        for accused in args.accused:
            print(f"{args.peers} peers x {rounds} rounds, accused {accused} ...", flush=True)
            rows.append(measure(args.peers, rounds, accused, args.rev))
            print(json.dumps(rows[-1]), flush=True)
            (RESULTS / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        f"# One judgement of an audited ledger (`python bench/bench_judge_scale.py --peers "
        f"{args.peers} --rounds {' '.join(map(str, args.rounds))} --accused "
        f"{' '.join(map(str, args.accused))} --rev {args.rev}`)",
        "",
        f"Synthetic runs of {args.peers} peers at the production audit rate (~0.1 records a "
        "row); *accused*: the share of audits that are accusations, each re-checked by 3 "
        "others. *read*: the records, the claims they audit and who has rows, from the "
        f"SQLite ledger; *standing*: `probation.standing`, of {args.rev} (before) and of this "
        "tree (after), side by side on the same ledger in one process; both gave the same "
        "standing in every row. *probation*: 4 founders, 3 vouches; *open*: no founders. "
        "One run each, this 2-core machine (noisy: +-20%).",
        "",
        "| rows audited of | records | accused | probation: read | standing before | after "
        "| open: standing before | after | established | banned |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, o = r["probation"], r["open"]
        lines.append(
            f"| {r['peers'] * r['rounds']:,} | {r['records']:,} | {r['accused']} | "
            f"{p['after']['read_s']} s | {p['before']['standing_s']} s | "
            f"**{p['after']['standing_s']} s** | {o['before']['standing_s']} s | "
            f"**{o['after']['standing_s']} s** | {p['established']} | {p['banned']} |"
        )
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
