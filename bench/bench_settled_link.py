"""An audited late joiner that holds the ledger: its settled state by replay, or from an
older settled link of the checkpoint chain, side by side in one process.

    nice -n 5 python bench/bench_settled_link.py [--models tiny-llama,smollm2-135m]
        [--rows 10000,100000,1000000] [--smol-rows 10000,100000] [--peers 100]
        [--period 50] [--directions 1] [--name settled-link]

Per (model, rows): a synthetic ledger of PEERS peers x ROUNDS = ROWS / PEERS rounds (N(0,1)
scalars, float16, unsigned: no path here reads signatures), in an in-memory ledger. Audits
on (lag 3, quorum 2), probation with the first 3 peers as founders (2 vouches): every other
peer is vouched by founders for its rounds 1 and 2 (records published at round + delay), so
it is established from then on and nearly every row counts; one established peer is
convicted by two founders' mismatch records published 5 rounds after the link round
R = the largest multiple of P below ROUNDS - 40. The joiner's first round is ROUNDS and
it keeps the rows that count in S_ROUNDS (`Standing.counts_in`). Timed, each on a fresh
model where it restores:

- replay: `LiveModel.restore(cut, None, keep=keep)` (replays every counted row);
- from link: `LiveModel.restore(cut, link_dir, None, keep)` (loads link R, adds the rows
  counted since, takes back the convicted peer's rows the link holds);
- link build: `CheckpointChain.build(rows below R, R, count=SettledCount(standing, R))`,
  what every peer of the run pays once per link;
- rebuild check: `chain.reset()` then `chain.add(...)` per period of the link's rows (as
  peer/latejoin.py `check_weights` does for a fetched link), and the tensors' hash compared.

Not timed, the same for both paths: building and syncing the ledger, the standing,
loading the model, reading the cut. The two restores must agree within atol 1e-4.
Each finished row is written to bench/results/NAME.json at once (and NAME.md); a rerun
skips the rows already there.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ED25519_ID = bytes.fromhex("002408011220")
FOUNDERS = 3
LAG = 3
QUORUM = 2
TAIL = 40  # the link is at least this many rounds older than the joiner's first round
BAN_AFTER = 5  # the conviction is published this many rounds after the link round


def _say(text: str) -> None:
    print(text, flush=True)


def link_round_for(rounds: int, period: int) -> int:
    """The largest multiple of `period` below rounds - TAIL."""
    return (rounds - TAIL - 1) // period * period


def make_config(model: str, period: int, directions: int):
    from seedflood_p2p.core.config import RunConfig

    return RunConfig(
        model=model,
        rank=4,
        refresh_period=5,
        lr=1e-3,
        n_ref=3,
        directions=directions,
        extra={"checkpoint_every": period},
    )


def synthetic_ledger(rounds: int, peers: int, directions: int, period: int) -> tuple:
    """(rows in canonical order, audit records, peer ids, the convicted peer, link round)."""
    import numpy as np

    from seedflood_p2p.core.extra_settings import AuditSettings
    from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage, quantize_scalars

    delay = AuditSettings(enabled=True, lag=LAG, quorum=QUORUM).delay
    ids = [ED25519_ID + i.to_bytes(32, "big") for i in range(1, peers + 1)]
    rng = np.random.default_rng(0)
    rows: list = []
    per_round = peers * directions
    for first in range(0, rounds, 1000):
        last = min(first + 1000, rounds)
        flat = quantize_scalars(rng.standard_normal((last - first) * per_round))
        at = 0
        for t in range(first, last):
            for p in ids:
                rows.append(UpdateMessage(t, p, flat[at : at + directions]))
                at += directions
    founders = ids[:FOUNDERS]
    convicted = ids[peers // 2]
    link = link_round_for(rounds, period)
    if link <= 0:
        raise SystemExit(f"{rounds} rounds: no link round below {rounds - TAIL} (period {period})")
    claims = {(m.round, m.peer): m.scalars for m in rows if m.round <= 2 or m.peer == convicted}
    # each non-founder's rounds 1 and 2 matched by founders 0 and 1, published as early
    # as an honest auditor can (round + delay): established from round 2 + delay on
    records = [
        AuditRecord(p, t, founders[i], claims[(t, p)], t + delay)
        for p in ids[FOUNDERS:]
        for i, t in enumerate((1, 2))
    ]
    # the convicted peer's update of a round the link holds, recomputed differently by two
    # founders who publish after the link round: the link holds its rows, S_first does not
    bad_round = link // 2
    wrong = (claims[(bad_round, convicted)][0] + 1.0, *claims[(bad_round, convicted)][1:])
    records += [
        AuditRecord(convicted, bad_round, founders[i], wrong, link + BAN_AFTER) for i in (0, 1)
    ]
    return rows, records, ids, convicted, link, claims


def _max_abs_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def measure(model_name: str, rows_wanted: int, peers: int, period: int, directions: int) -> dict:
    """One row of the table (see the module docstring)."""
    import torch

    from seedflood_p2p.algorithm.chain import CheckpointChain, SettledCount
    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.probation import standing
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
    from seedflood_p2p.storage.checkpoint import tensors_sha256
    from seedflood_p2p.storage.cut import cut_contains
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    config = make_config(model_name, period, directions)
    rounds = rows_wanted // peers
    out: dict = {"model": model_name, "rows": rounds * peers, "rounds": rounds, "peers": peers}
    t0 = time.perf_counter()
    rows, records, ids, convicted, link, claims = synthetic_ledger(
        rounds, peers, directions, period
    )
    ledger = Ledger(":memory:", config.run_id)
    ledger.add(rows)
    out["ledger_build_s"] = round(time.perf_counter() - t0, 1)
    out["link_round"] = link
    first = rounds  # the joiner's first round
    audit = AuditSettings(enabled=True, lag=LAG, quorum=QUORUM)
    probation = ProbationSettings(founders=frozenset(ids[:FOUNDERS]), vouches=2)
    t0 = time.perf_counter()
    # a peer judges from the rows the records audit and every peer it has seen
    st = standing(claims, records, audit, probation, seen=ids)
    out["standing_s"] = round(time.perf_counter() - t0, 2)
    assert convicted in st.banned, "the convicted peer is not banned"
    assert st.counts_at(convicted, link - 1, link), "the link should hold its rows"
    assert not st.counts_in(convicted, link - 1, first)
    _say(
        f"  ledger of {out['rows']:,} rows in {out['ledger_build_s']} s, "
        f"standing {out['standing_s']} s; link round {link}"
    )

    def keep(m) -> bool:
        return st.counts_in(m.peer, m.round, first)

    work = Path(tempfile.mkdtemp(prefix="bench-settled-link-"))
    try:
        link_dir = work / "link"
        # (c) the link
        below = [m for m in rows if m.round < link]
        del rows
        chain = CheckpointChain(load_model(model_name)[0], config, link_dir)
        gc.collect()
        t0 = time.perf_counter()
        meta = chain.build(below, link, count=SettledCount(st, link))
        out["link_build_s"] = round(time.perf_counter() - t0, 2)
        out["link_rows"] = meta["ledger_messages"]
        out["link_mib"] = round((link_dir / "checkpoint.safetensors").stat().st_size / 2**20, 2)
        _say(f"  link build: {out['link_build_s']} s ({out['link_rows']:,} rows)")
        del below
        # (d) the joiner's rebuild check of the link (peer/latejoin.py check_weights)
        covered = cut_contains(meta["ledger_cut"])
        gc.collect()
        t0 = time.perf_counter()
        snapshot = ledger.snapshot()
        chain.reset()
        for number, group in itertools.groupby(snapshot, key=lambda m: m.round // period):
            if number * period >= meta["round"]:
                break
            chain.add([m for m in group if (m.peer, m.round) in covered])
        rebuilt = tensors_sha256(chain.weights())
        out["rebuild_check_s"] = round(time.perf_counter() - t0, 2)
        out["rebuild_matches"] = rebuilt == meta["weights_sha256"]
        del snapshot, chain
        _say(f"  rebuild check: {out['rebuild_check_s']} s, match {out['rebuild_matches']}")
        gc.collect()
        weights = {}
        for path, directory in (("replay", None), ("from_link", link_dir)):
            model, _ = load_model(model_name)
            live = LiveModel(make_estimator(model, config), ledger)
            t0 = time.perf_counter()
            cut = live.cut()
            out[f"{path}_cut_s"] = round(time.perf_counter() - t0, 2)
            if path == "from_link":
                inside = [(m.peer, m.round) in covered for m in cut.messages]
                kept = [keep(m) for m in cut.messages]
                out["counted_since"] = sum(k and not i for k, i in zip(kept, inside))
                out["taken_back"] = sum(i and not k for k, i in zip(kept, inside))
                out["counted"] = sum(kept)
                del inside, kept
            gc.collect()
            t0 = time.perf_counter()
            how = live.restore(cut, directory, None, keep)
            out[f"{path}_s"] = round(time.perf_counter() - t0, 2)
            out[f"{path}_how"] = how
            weights[path] = {k: v.clone() for k, v in live.weights().items()}
            _say(f"  {path}: {out[f'{path}_s']} s ({how})")
            del live, model, cut
            gc.collect()
        out["max_abs_diff"] = _max_abs_diff(weights["replay"], weights["from_link"])
        for name, tensor in weights["from_link"].items():
            torch.testing.assert_close(tensor, weights["replay"][name], atol=1e-4, rtol=0)
        out["speedup"] = round(out["replay_s"] / max(out["from_link_s"], 1e-9), 1)
        assert out["rebuild_matches"], "the rebuilt link's tensors differ from the built one's"
        assert out["from_link_how"].startswith(f"checkpoint of round {link}")
    finally:
        ledger.close()
        shutil.rmtree(work, ignore_errors=True)
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny-llama,smollm2-135m")
    parser.add_argument("--rows", default="10000,100000,1000000", help="for tiny-llama")
    parser.add_argument("--smol-rows", default="10000,100000", help="for smollm2-135m")
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--period", type=int, default=50, help="extra.checkpoint_every")
    parser.add_argument("--directions", type=int, default=1)
    parser.add_argument("--name", default="settled-link")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    out_path = RESULTS / f"{args.name}.json"
    out = json.loads(out_path.read_text()) if out_path.exists() else {}
    out.setdefault(
        "command", " ".join(["nice -n 5 python bench/bench_settled_link.py", *sys.argv[1:]])
    )
    settings = {"peers": args.peers, "period": args.period, "directions": args.directions}
    if out.setdefault("settings", settings) != settings:
        raise SystemExit(f"{out_path} holds rows of other settings {out['settings']}: use --name")
    out.setdefault("runs", {})
    out.setdefault("skipped", {})
    for model_name in [m for m in args.models.split(",") if m]:
        sizes = args.smol_rows if model_name.startswith("smollm2") else args.rows
        try:
            from seedflood_p2p.workload.models import load_model

            load_model(model_name)  # once, so a model that cannot load is skipped
        except Exception as exc:
            out["skipped"][model_name] = f"cannot load: {exc!r}"
            _say(f"{model_name}: skipped, {exc!r}")
            continue
        for rows in [int(x) for x in sizes.split(",") if x]:
            key = f"{model_name}/{rows}"
            if key in out["runs"]:
                _say(f"{key}: done before, kept")
                continue
            _say(f"{key}: building ...")
            out["runs"][key] = measure(model_name, rows, args.peers, args.period, args.directions)
            RESULTS.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(out, indent=1))
            (RESULTS / f"{args.name}.md").write_text(markdown(out))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    (RESULTS / f"{args.name}.md").write_text(markdown(out))
    _say(markdown(out))
    return 0


def markdown(out: dict) -> str:
    """The results as a markdown table."""
    s = out["settings"]
    lines = [
        "# An audited late joiner's settled state: replay vs an older settled link",
        "",
        f"`{out['command']}`; one process, 1 torch thread, 2 shared cores (CPU only). "
        f"Ledger: {s['peers']} peers x ROWS / {s['peers']} rounds, {s['directions']} "
        f"direction(s) a row, checkpoint_every P = {s['period']}, audits on (lag {LAG}, "
        f"quorum {QUORUM}), probation with {FOUNDERS} founders; every other peer "
        "established by founder vouches of its rounds 1 and 2, one established peer "
        f"convicted by two founders' mismatch records published {BAN_AFTER} rounds after "
        "the link round. The joiner's first round is ROUNDS (S_ROUNDS kept).",
        "",
        "Columns: *link round* R = the largest multiple of P below ROUNDS - 40; *counted "
        "since* = rows of rounds >= R that count in S_ROUNDS (added onto the link); *taken "
        "back* = rows the link holds that no longer count (the convicted peer's); *replay* = "
        "`LiveModel.restore(cut, None, keep=...)` on a fresh model; *from link* = "
        "`LiveModel.restore(cut, link, None, keep)` on a fresh model; *link build* = "
        "`CheckpointChain.build(rows < R, R, count=SettledCount(standing, R))` from the base; "
        "*rebuild check* = `chain.reset()` + `chain.add` of the link's rows a period at a "
        "time and the tensors' hash (a joiner's check of a fetched link, peer/latejoin.py "
        "`check_weights`); *max abs diff* = between the two restored models' trainable "
        "weights (asserted <= 1e-4). Not timed: building the ledger, the standing, loading "
        "models, reading the cut.",
        "",
        "| model | rows | link round | counted since | taken back | replay s | from link s | "
        "speedup | link build s | rebuild check s | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = sorted(out["runs"].values(), key=lambda r: (r["model"], r["rows"]))
    for r in runs:
        lines.append(
            f"| {r['model']} | {r['rows']:,} | {r['link_round']:,} | {r['counted_since']:,} | "
            f"{r['taken_back']:,} | {r['replay_s']} | {r['from_link_s']} | "
            f"{r['speedup']}x | {r['link_build_s']} | {r['rebuild_check_s']} | "
            f"{r['max_abs_diff']:.2e} |"
        )
    for model_name, why in out.get("skipped", {}).items():
        lines += ["", f"{model_name}: skipped ({why})."]
    for note in out.get("notes", []):
        lines += ["", note]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
