"""What an audited link's standing summary costs and saves (algorithm/standing_summary.py).

A joiner trusting an audited link (not built yet: docs/ROADMAP.md) needs the run's
standing; today it syncs every audit record and every row first. The summary is what the
standing reads of the records about the rows below the link. This measures, on synthetic
runs of PEERS peers x ROUNDS rounds at the production audit rate (every peer audits
`cpu_share` = 10% of a round's updates, so ~0.1 records a row; a few accusations, each
re-checked by 3 others):

- the summary's bytes (a record each: what repair would send instead, a signed audit row),
- `summarize` (a builder, once a link), `encode` / `decode` (a joiner),
- the standing of the whole ledger against a joiner's standing of the summary plus the
  rows and records from the link's round on (asserted equal: the same `Standing`).

    python bench/bench_standing_summary.py [--peers 1000] [--rounds 100 1000] [--name N]

Writes bench/results/NAME.{json,md}. No processes, no model: the claims are random
float16-exact scalars (what the standing reads of a row).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIGNED_AUDIT_ROW = 200  # bytes of one audit record in a repair page (envelope, signature)


def synthetic(peers: int, rounds: int, seed: int = 0, accused: float = 0.001):
    """Claims {(round, peer): scalars} and audit records of a run at the production rate:
    each update audited by one other peer with probability 0.1; `accused` of the audits
    an accusation re-checked by 3 others (a conviction); founders = the first 4 peers."""
    from seedflood_p2p.protocol.message import AuditRecord

    rng = random.Random(seed)
    ids = [b"\x00\x24\x08\x01\x12\x20" + rng.randbytes(32) for _ in range(peers)]
    claims, records = {}, []
    for t in range(rounds):
        for p in ids:
            claims[(t, p)] = (rng.choice((-1.0, 1.0)) * rng.randrange(1, 1024) / 256,)
    for (t, p), claim in claims.items():
        if rng.random() >= 0.1:
            continue
        auditor = rng.choice(ids)
        if auditor == p:
            continue
        at = t + 4 + rng.randrange(8)
        if rng.random() < accused:  # a cheat: accused, then re-checked by three others
            for q in [auditor, *rng.sample(ids, 3)]:
                if q != p:
                    records.append(AuditRecord(p, t, q, (claim[0] + 1.0,), at))
        else:
            records.append(AuditRecord(p, t, auditor, claim, at))
    return ids, claims, records


def measure(peers: int, rounds: int, accused: float) -> dict:
    from seedflood_p2p.algorithm.chain import SETTLED_MARGIN, settled_alike
    from seedflood_p2p.algorithm.probation import standing
    from seedflood_p2p.algorithm.standing_summary import StandingSummary, summarize
    from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings

    audit = AuditSettings(enabled=True, lag=1)
    ids, claims, records = synthetic(peers, rounds, accused=accused)
    probation = ProbationSettings(founders=frozenset(ids[:4]), vouches=3)
    link = rounds * 3 // 4 // 10 * 10  # the link's round; the joiner holds the rest
    held = link + SETTLED_MARGIN
    audited = {(r.round, r.accused) for r in records}
    started = time.perf_counter()
    full = standing(
        {k: c for k, c in claims.items() if k in audited}, records, audit, probation, None, ids
    )
    full_s = time.perf_counter() - started
    below = {p for (t, p) in claims if t < link}
    started = time.perf_counter()
    summary = summarize(
        {k: c for k, c in claims.items() if k in audited}, records, audit, link, held, below
    )
    summarize_s = time.perf_counter() - started
    started = time.perf_counter()
    data = summary.encode()
    encode_s = time.perf_counter() - started
    started = time.perf_counter()
    decoded = StandingSummary.decode(data)
    decode_s = time.perf_counter() - started
    own_claims = {k: c for k, c in claims.items() if k[0] >= link and k in audited}
    own_records = [r for r in records if r.round >= link]
    own_seen = {p for (t, p) in claims if t >= link}
    started = time.perf_counter()
    inputs = decoded.inputs(own_claims, own_records, own_seen)
    joiner = standing(inputs[0], inputs[1], audit, probation, None, inputs[2])
    joiner_s = time.perf_counter() - started
    assert joiner == full, "the summary's standing differs from the whole ledger's"
    started = time.perf_counter()  # the joiner's trust check (peer/latejoin.py)
    alike = settled_alike(joiner, link, held, rounds + 10)
    alike_s = time.perf_counter() - started
    records_below = sum(1 for r in records if r.round < link)
    return {
        "peers": peers,
        "rounds": rounds,
        "rows": len(claims),
        "records": len(records),
        "link_round": link,
        "records_below_link": records_below,
        "summary_bytes": len(data),
        "bytes_per_record": round(len(data) / max(1, records_below), 1),
        "signed_records_bytes_estimate": records_below * SIGNED_AUDIT_ROW,
        "summarize_s": round(summarize_s, 3),
        "encode_s": round(encode_s, 3),
        "decode_s": round(decode_s, 3),
        "standing_full_s": round(full_s, 3),
        "standing_from_summary_s": round(joiner_s, 3),
        "settled_alike_s": round(alike_s, 3),
        "settled_alike": alike,
        "accused": accused,
        "same_standing": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--rounds", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--accused", type=float, default=0.001)
    parser.add_argument("--name", default="standing-summary")
    args = parser.parse_args()
    rows = []
    for rounds in args.rounds:
        print(f"{args.peers} peers x {rounds} rounds ...", flush=True)
        rows.append(measure(args.peers, rounds, args.accused))
        print(json.dumps(rows[-1]), flush=True)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        f"# Standing summary (`python bench/bench_standing_summary.py --peers {args.peers} "
        f"--rounds {' '.join(map(str, args.rounds))} --accused {args.accused} --name "
        f"{args.name}`)",
        "",
        "Synthetic runs at the production audit rate (~0.1 records a row; a share "
        f"{args.accused} of the audits accusations, each re-checked by 3 others). The link "
        "at 3/4 of the run; the joiner holds "
        "the rows and records from its round on. *signed records* = the records below the "
        f"link at ~{SIGNED_AUDIT_ROW} B each in repair pages (what a joiner syncs today, "
        "besides every row). The joiner's standing was asserted equal to the whole "
        "ledger's in every row. One run each, this 2-core machine.",
        "",
        "| rows | records below link | summary | B/record | signed records | summarize | "
        "encode | decode | standing, whole ledger | standing, summary + tail | trust check |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rows']:,} | {r['records_below_link']:,} | {r['summary_bytes'] / 2**20:.2f} "
            f"MiB | {r['bytes_per_record']} | {r['signed_records_bytes_estimate'] / 2**20:.1f} "
            f"MiB | {r['summarize_s']} s | {r['encode_s']} s | {r['decode_s']} s | "
            f"{r['standing_full_s']} s | {r['standing_from_summary_s']} s | "
            f"{r['settled_alike_s']} s |"
        )
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
