"""Many identities, one attacker, on real daemons: 4 honest founders + N attacker identities,
each identity its own peer process with its own p2pd and its own Ed25519 key (127.0.0.1,
tiny model, synthetic task), under probation (`algorithm/probation.py`).

    PYTHONPATH=. python bench/bench_sybil_daemon.py [--sybils 20] [--rounds 30] [--seeds 0 1]
        [--scenarios honest-only,flip,turn,random,honest] [--fork-server]

--fork-server forks every daemon from one process that imported the stack once
(harness/fork_server.py), so 24 daemons start in seconds on 2 cores, not minutes.

Scenarios (the cheating attacker identities are harness/hooked_peer.py with
`--cheat`; a cheater still audits honestly):

    honest-only  the 4 founders alone: the reference row of the seed
    flip         N identities negating their scalars from the start
    turn         N identities honest through probation, negating from their first update
                 after their own ledger's standing says they are established
    random       N identities sending others' recent scalars
    honest       N new identities that train honestly (they should simply help)

Every scenario of a seed has the same manifest (the founders' keys are made once per seed
and listed in `extra.probation.founders`; the seed is the run's salt), so the same run id
and the same honest peers' minibatches and directions. Per row: from each founder's ledger
(`standing_of_ledger`, as `seedflood replay` judges it) the attacker updates that count at
the end and whether the founders agree on what counts (and on the counted rows' scalars);
from each founder's log the attacker updates it applied and took back at a ban
(`audit_ban`: "N applied update(s) taken back"), the round it saw each key established and
banned; the held-out loss/accuracy (200 examples) of the replay of the first founder's
counted updates against the honest-only row of the seed; the founders' audit CPU over
training CPU (final_status audits.cpu_seconds); the probation backlog; and each process's
peak RSS and CPU seconds (daemon + its p2pd, /proc); each founder's pace (`pace_view`:
rounds per minute, deadlines waited out, and those that named a peer it had banned). Every
daemon runs under `nice -n 10`.

Rows go to bench/results/sybil_daemon.json as each finishes; a rerun skips finished
(scenario, seed, sybils) rows, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness.cluster import HOOKED_PEER, RUN  # noqa: E402
from seedflood_p2p.apps.localnet import NodeProcess, start_bootstrap  # noqa: E402

OUT = ROOT / "bench" / "results"
FOUNDERS = ["a", "b", "c", "d"]
SCENARIOS = {
    "honest-only": None,
    "flip": "flip",
    "turn": "turn",
    "random": "random",
    "equivocate": "equivocate",  # honest scalars, and a second signed copy of one round
    "honest": "",
}
EQUIVOCATE = "1:3"  # hooked_peer.py --equivocate: round 1's twin, flooded 3 rounds late
# sampled audits at cpu_share 0.3 (q = 0.3 / (n-1) per auditor: the test setting of
# tests/test_probation_daemon.py, so a turned key is caught within a short run); lag 2 with
# --max-staleness 1; quorum 3 of the 4 founders. Probation: 2 vouches, share 1 (each
# established peer may spend one audit a round on probationers).
AUDIT = {"lag": 2, "cpu_share": 0.3, "quorum": 3}
VOUCHES, SHARE = 2, 1.0
EVAL_EXAMPLES = 200
NICE = 10  # every daemon's niceness; --attacker-nice for the attackers' own


def peer_flags(rounds: int, min_peers: int, interval: float, deadline: float) -> list[str]:
    return [
        *("--until-round", str(rounds), "--round-interval", str(interval)),
        *("--max-staleness", "1", "--round-deadline", str(deadline), "--linger", "8"),
        *("--repair-interval", "2", "--min-peers", str(min_peers)),
    ]


def start_peer(
    work: Path,
    name: str,
    bootstrap: str,
    flags: list[str],
    cheat: str = "",
    nice: int = 10,
    cpus: str = "",
) -> NodeProcess:
    """localnet.start_peer under `nice -n NICE` (NodeProcess's prefix), on the CPUs `cpus`
    if given (`taskset -c CPUS`); with `cheat`, the tests' cheating peer (hooked_peer.py
    --cheat CHEAT)."""
    prefix = ("taskset", "-c", cpus) * bool(cpus) + ("nice", "-n", str(nice))
    args = [
        "peer",
        *("--bootstrap", bootstrap, "--listen", "/ip4/127.0.0.1/tcp/0"),
        *("--data-dir", str(work / name), "--threads", "1", *flags),
    ]
    if cheat == "equivocate":
        return NodeProcess(name, [*args, "--equivocate", EQUIVOCATE], work, 1, prefix, HOOKED_PEER)
    if cheat:
        return NodeProcess(name, [*args, "--cheat", cheat], work, 1, prefix, HOOKED_PEER)
    return NodeProcess(name, args, work, 1, prefix=prefix)


# -------------------------------------------------------------------- processes' cost


class Meter:
    """Samples /proc every few seconds: per process (daemon + its children, i.e. its p2pd)
    the peak RSS and the last CPU seconds seen; the p2pd pids, to kill any left over."""

    def __init__(self, procs: dict[str, NodeProcess], every: float = 3.0) -> None:
        self.procs, self.every = procs, every
        self.peak_rss: dict[str, float] = {}
        self.cpu_s: dict[str, float] = {}
        self.total_peak_rss = 0.0
        self.children: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _pids(pid: int) -> list[int]:
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return [pid]
        return [pid, *(int(k) for k in kids)]

    @staticmethod
    def _sample(pid: int) -> tuple[float, float]:
        """(RSS MiB, CPU s) of one process (0, 0 if gone)."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return 0.0, 0.0
        tick = os.sysconf("SC_CLK_TCK")
        return rss * os.sysconf("SC_PAGE_SIZE") / 2**20, (int(stat[11]) + int(stat[12])) / tick

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            total = 0.0
            for name, proc in list(self.procs.items()):
                if not proc.alive:
                    continue
                pids = self._pids(proc.proc.pid)
                self.children.update(pids[1:])
                samples = [self._sample(p) for p in pids]
                rss, cpu = sum(s[0] for s in samples), sum(s[1] for s in samples)
                total += rss
                self.peak_rss[name] = max(self.peak_rss.get(name, 0.0), rss)
                if cpu:
                    self.cpu_s[name] = max(self.cpu_s.get(name, 0.0), cpu)
            self.total_peak_rss = max(self.total_peak_rss, total)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def stop_all(procs: list[NodeProcess], children: set[int]) -> None:
    """SIGTERM every process we started (by pid), wait, SIGKILL the rest; then any p2pd
    child (pids the meter saw under our daemons) still alive."""
    for p in procs:
        if p.alive:
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    for p in procs:
        with contextlib.suppress(Exception):
            p.proc.wait(max(1.0, deadline - time.monotonic()))
        if p.alive:
            p.proc.kill()
            p.proc.wait()
        with contextlib.suppress(Exception):
            p._log.close()
    for pid in children:
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"p2pd" in cmdline:
                os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------ one scenario


def founder_keys(work: Path, seed: int) -> list[str]:
    """The founders' identity files in WORK/NAME/identity.key, derived from (seed, name), so
    every scenario of a seed (and a resumed run) has the same manifest: same run id."""
    import hashlib

    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from seedflood_p2p.network.transport.identity import crypto_pb2, load_or_create_identity

    ids = []
    for name in FOUNDERS:
        raw = hashlib.sha256(f"bench_sybil_daemon/{seed}/{name}".encode()).digest()
        key = Ed25519PrivateKey.from_private_bytes(raw)
        public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
        blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=raw + public)
        path = work / name / "identity.key"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob.SerializeToString())
        path.chmod(0o600)
        ids.append(load_or_create_identity(path).to_base58())
    return ids


def run_config(seed: int, founders: list[str], share: float = SHARE):
    salt = "seedflood" if seed == 0 else f"seedflood-{seed}"
    return dataclasses.replace(
        RUN,
        salt=salt,
        extra={
            "audit": AUDIT,
            "probation": {"founders": founders, "vouches": VOUCHES, "share": share},
        },
    )


def pinning() -> tuple[str, str]:
    """(honest CPUs, attackers' CPUs) for --pin: the attackers' processes on CPUs of their
    own, as if on their own machines, so the honest side's pace measures what their
    identities cost it, not what their processes take from a shared core."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs 2 CPUs or more: the honest side's and the attacker's")
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


def log_view(events: list[dict]) -> dict[str, dict]:
    """{peer: {"established": round, "banned": round, "taken_back": n}} as one peer's log
    saw them (the round is the peer's training round when it logged it)."""
    current, out = -1, {}
    for e in events:
        if e.get("event") == "round":
            current = e["round"]
        elif e.get("event") in ("established", "audit_ban"):
            row = out.setdefault(e["peer"], {})
            if e["event"] == "established":
                row.setdefault("established", current)
            else:
                row.setdefault("banned", current)
                words = e.get("message", "").rsplit(";", 1)[-1].split()
                if words and words[0].isdigit():
                    row["taken_back"] = int(words[0])
    return out


def pace_view(events: list[dict]) -> dict:
    """One founder's pace by its log: rounds trained per minute (first to last round line),
    the round deadlines it waited out, and how many of those named a peer its log had
    banned before (issue 45's goal: none; a ban acts at the next check)."""
    times = [e["time"] for e in events if e.get("event") == "round"]
    banned: set[str] = set()
    waits = for_banned = 0
    for e in events:
        if e.get("event") == "audit_ban":
            banned.add(e.get("peer"))
        elif e.get("event") == "deadline":
            waits += 1
            for_banned += bool(banned & set(e.get("slow", [])))
    minutes = (times[-1] - times[0]) / 60 if len(times) > 1 else 0.0
    return {
        "rounds_per_min": (len(times) - 1) / minutes if minutes else None,
        "deadline_waits": waits,
        "deadline_waits_for_banned": for_banned,
    }


def ledger_view(path: Path, attackers: set[str]) -> dict:
    from seedflood_p2p.algorithm.probation import standing_of_ledger
    from seedflood_p2p.storage.ledger import Ledger, peer_name

    with Ledger.open_existing(path) as ledger:
        config = ledger.config
        st = standing_of_ledger(ledger, config.audit, config.probation)
        messages = list(ledger.messages())
    counted = st.counted(messages)
    per_key: dict[str, dict] = {}
    for m in messages:
        name = peer_name(m.peer)
        if name not in attackers:
            continue
        row = per_key.setdefault(name, {"sent": 0, "counted": 0, "first_round": m.round})
        row["sent"] += 1
        row["first_round"] = min(row["first_round"], m.round)
    lag = config.audit.lag
    for m in counted:
        name = peer_name(m.peer)
        if name in per_key:
            row = per_key[name]
            row["counted"] += 1
            row["first_counted"] = min(row.get("first_counted", m.round), m.round)
            # the first state S_t that holds it: t - lag > its round and its vouch's round
            t = max(m.round, st.count_from(m.peer, m.round)) + lag + 1
            row["first_in_model"] = min(row.get("first_in_model", t), t)
    for peer, since in st.since.items():
        if peer_name(peer) in per_key:
            per_key[peer_name(peer)]["established_since"] = since
    return {
        "config": config,
        "counted": counted,
        "counted_rows": sorted((m.round, peer_name(m.peer), m.scalars) for m in counted),
        "banned": sorted(peer_name(p) for p in st.banned),
        "established": sorted(peer_name(p) for p in st.established),
        "per_key": per_key,
        "messages": len(messages),
    }


def held_out(config, counted) -> dict:
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.algorithm.trainer import evaluate
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.models import load_model, weights_sha256

    model, tokenizer = load_model(config.model)
    replay(model, config, counted)
    task = load_task(
        config.dataset, text_column=config.text_column, label_column=config.label_column
    )
    loss, accuracy = evaluate(model, tokenizer, task, config, EVAL_EXAMPLES)
    return {"loss": loss, "accuracy": accuracy, "sha256": weights_sha256(model)}


CUTOFF_EVERY = 5


def losses_by_round(config, counted, cache: Path | None = None) -> dict[str, float]:
    """{R: held-out loss of the replay of the counted updates of rounds < R}, for the two
    largest multiples of CUTOFF_EVERY the run reached: rows stopped at different rounds
    compare at a common R. Cached in `cache` (a JSON file) when given."""
    if cache is not None and cache.exists():
        return json.loads(cache.read_text())
    last = max((m.round for m in counted), default=0) + 1
    cutoffs = list(range(CUTOFF_EVERY, last + 1, CUTOFF_EVERY))[-2:]
    out = {str(r): held_out(config, [m for m in counted if m.round < r])["loss"] for r in cutoffs}
    if cache is not None:
        cache.write_text(json.dumps(out))
    return out


def compare(row: dict, reference: dict | None) -> tuple[int, float] | None:
    """(R, row's loss - reference's) at the largest cutoff R both have."""
    if reference is None:
        return None
    a, b = row.get("replay_loss_by_round", {}), reference.get("replay_loss_by_round", {})
    common = sorted((int(r) for r in set(a) & set(b)), reverse=True)
    return (common[0], a[str(common[0])] - b[str(common[0])]) if common else None


def run_scenario(scenario: str, seed: int, sybils: int, args, work: Path) -> dict:
    cheat = SCENARIOS[scenario]
    n_attack = 0 if cheat is None else sybils
    attackers = [f"s{i:02d}" for i in range(n_attack)]
    newcomers = [f"h{i:02d}" for i in range(args.newcomers)]  # honest, after the attackers
    names = FOUNDERS + attackers + newcomers
    config = run_config(seed, founder_keys(work, seed), args.share)
    honest_cpus, attacker_cpus = pinning() if args.pin else ("", "")
    flags = peer_flags(args.rounds, len(names) - 1, args.interval, args.deadline)
    started = time.time()
    procs: list[NodeProcess] = []
    peers: dict[str, NodeProcess] = {}
    meter = None
    try:
        boot, address = start_bootstrap(work, config)
        procs.append(boot)
        meter = Meter(peers)
        for name in names:
            (work / name).mkdir(parents=True, exist_ok=True)
            attacker = name in attackers
            nice = args.attacker_nice if attacker else NICE
            cpus = attacker_cpus if attacker else honest_cpus
            peers[name] = start_peer(
                work, name, address, flags, cheat if attacker else "", nice, cpus
            )
            procs.append(peers[name])
        deadline = time.monotonic() + args.timeout
        while any(p.alive for p in peers.values()) and time.monotonic() < deadline:
            time.sleep(2)
        stopped_early = any(p.alive for p in peers.values())
        if stopped_early:  # SIGTERM: each daemon ends its round, checkpoints, final_status
            print(time.strftime("%H:%M:%S"), f"--timeout {args.timeout:.0f} s: stopping")
            for p in peers.values():
                if p.alive:
                    p.proc.send_signal(signal.SIGTERM)
            for p in peers.values():
                with contextlib.suppress(Exception):
                    p.proc.wait(120)
        codes = {name: p.proc.poll() for name, p in peers.items()}
        logs = {n: log_view(peers[n].events()) for n in FOUNDERS}
        paces = {n: pace_view(peers[n].events()) for n in FOUNDERS}
        ids = {}
        for n, p in peers.items():
            joined = [e["peer_id"] for e in p.events() if e.get("event") == "join"]
            final = work / n / "final_status.json"
            if final.exists():
                ids[n] = json.loads(final.read_text())["peer_id"]
            elif joined:
                ids[n] = joined[0]
    finally:
        if meter is not None:
            meter.stop()
        stop_all(procs, meter.children if meter else set())
    finals = {
        n: json.loads((work / n / "final_status.json").read_text())
        for n in names
        if (work / n / "final_status.json").exists()
    }
    attacker_ids = {ids[n] for n in attackers if n in ids}
    newcomer_ids = {ids[n] for n in newcomers if n in ids}
    keys = attacker_ids | newcomer_ids
    views = {n: ledger_view(work / n / "ledger.sqlite", keys) for n in FOUNDERS}
    first = views[FOUNDERS[0]]
    evaluation = held_out(first["config"], first["counted"])
    by_round = losses_by_round(first["config"], first["counted"], work / "losses_by_round.json")
    per_key = {}
    for n in attackers:
        pid = ids.get(n)
        ledger_rows = [views[f]["per_key"].get(pid, {}) for f in FOUNDERS]
        seen = [logs[f].get(pid, {}) for f in FOUNDERS]
        applied = [r.get("counted", 0) + s.get("taken_back", 0) for r, s in zip(ledger_rows, seen)]
        per_key[n] = {
            "peer_id": pid,
            "exit": codes.get(n),
            "sent": ledger_rows[0].get("sent", 0),
            "first_round": ledger_rows[0].get("first_round"),
            "counted_at_end": [r.get("counted", 0) for r in ledger_rows],
            "first_counted": ledger_rows[0].get("first_counted"),
            "established_since": ledger_rows[0].get("established_since"),
            "established_seen": [s.get("established") for s in seen],
            "banned_seen": [s.get("banned") for s in seen],
            "taken_back": [s.get("taken_back", 0) for s in seen],
            "applied_ever": applied,
        }
    per_founder = {}
    for n in FOUNDERS:
        audits = finals.get(n, {}).get("audits") or {}
        cpu = audits.get("cpu_seconds", {})
        probation = audits.get("probation") or {}
        per_founder[n] = {
            "exit": codes.get(n),
            "final_round": finals.get(n, {}).get("round"),
            "audits_done": audits.get("done"),
            "probation_audits": probation.get("probation_audits"),
            "backlog": probation.get("backlog"),
            "backlog_peers": probation.get("backlog_peers"),
            "waiting_updates": probation.get("waiting_updates"),
            "established": probation.get("established"),
            "on_probation": probation.get("on_probation"),
            "audit_cpu_s": cpu.get("audit", 0.0),
            "train_cpu_s": cpu.get("train", 0.0),
            "audit_cpu_share": cpu.get("audit", 0.0) / max(cpu.get("train", 0.0), 1e-9),
            "banned": len(audits.get("banned") or []),
            "counted_attacker_updates": sum(
                r["counted"] for k, r in views[n]["per_key"].items() if k in attacker_ids
            ),
        }
    founder_ids = {ids.get(n) for n in FOUNDERS}
    per_newcomer = {}
    for n in newcomers:
        rows = [views[f]["per_key"].get(ids.get(n), {}) for f in FOUNDERS]
        per_newcomer[n] = {
            "peer_id": ids.get(n),
            "exit": codes.get(n),
            "sent": rows[0].get("sent", 0),
            "first_round": rows[0].get("first_round"),
            "counted_at_end": [r.get("counted", 0) for r in rows],
            "first_in_model": rows[0].get("first_in_model"),
            "established_since": rows[0].get("established_since"),
        }
    counted_sets = [{(r[0], r[1]) for r in v["counted_rows"]} for v in views.values()]
    common = set.intersection(*counted_sets)
    rows_of = [{(r[0], r[1]): r[2] for r in v["counted_rows"]} for v in views.values()]
    daemon_rss = [v for k, v in meter.peak_rss.items()] if meter else []
    daemon_cpu = [v for k, v in meter.cpu_s.items()] if meter else []
    return {
        "scenario": scenario,
        "seed": seed,
        "sybils": n_attack,
        "cheat": cheat,
        "rounds": args.rounds,
        "run_id": config.run_id,
        "exit_codes": codes,
        "stopped_early": stopped_early,
        "final_rounds": {n: finals.get(n, {}).get("round") for n in names},
        "seconds": round(time.time() - started, 1),
        "attacker_updates_sent": sum(k["sent"] for k in per_key.values()),
        "attacker_updates_counted_at_end": [
            sum(k["counted_at_end"][i] for k in per_key.values()) for i in range(len(FOUNDERS))
        ],
        "attacker_updates_applied_ever": [
            sum(k["applied_ever"][i] for k in per_key.values()) for i in range(len(FOUNDERS))
        ],
        "attacker_keys_ever_counted": sum(
            1 for k in per_key.values() if max(k["applied_ever"], default=0)
        ),
        "attacker_keys_banned": [
            sum(1 for k in per_key.values() if k["banned_seen"][i] is not None)
            for i in range(len(FOUNDERS))
        ],
        "attacker_keys_established": sum(
            1 for k in per_key.values() if k["established_since"] is not None
        ),
        "honest_banned": sorted(set(first["banned"]) & (founder_ids | newcomer_ids)),
        "newcomers": per_newcomer,
        "pinned": {"honest": honest_cpus, "attackers": attacker_cpus} if args.pin else None,
        "share": args.share,
        "ledgers_agree_on_what_counts": all(s == counted_sets[0] for s in counted_sets),
        "counted_rows_identical": all(r[key] == rows_of[0][key] for r in rows_of for key in common),
        "counted_differ": len(set.union(*counted_sets) - common),
        "replay_loss": evaluation["loss"],
        "replay_accuracy": evaluation["accuracy"],
        "replay_sha256": evaluation["sha256"],
        "replay_loss_by_round": by_round,
        "founder_pace": paces,
        "attacker_nice": args.attacker_nice,
        "launch": "fork-server" if args.fork_server else "subprocess",
        "work": str(work),
        **founder_work(work),
        "audit_cpu_share": _mean([f["audit_cpu_share"] for f in per_founder.values()]),
        "per_founder": per_founder,
        "per_key": per_key,
        "cost": {
            "peak_rss_mib_per_peer": _mean(daemon_rss),
            "max_rss_mib_per_peer": max(daemon_rss, default=None),
            "cpu_s_per_peer": _mean(daemon_cpu),
            "cpu_s_founders": _mean([meter.cpu_s.get(n) for n in FOUNDERS]) if meter else None,
            "peak_rss_mib_all": meter.total_peak_rss if meter else None,
            "note": "per process: the daemon + its p2pd (/proc, sampled every 3 s)",
        },
    }


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


# ------------------------------------------------------------------------------ report


def _span(values: list) -> str:
    values = sorted(v for v in values if v is not None)
    if not values:
        return "-"
    return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def summarize(row: dict, reference: dict | None) -> dict:
    keys = row["per_key"].values()
    counted_keys = [k for k in keys if max(k["applied_ever"], default=0)]
    stop = [max(b for b in k["banned_seen"] if b is not None) for k in counted_keys
            if all(b is not None for b in k["banned_seen"])]  # fmt: skip
    start = [  # the first founder's round at which a founder logged it established
        min(e for e in k["established_seen"] if e is not None)
        for k in counted_keys
        if any(e is not None for e in k["established_seen"])
    ]
    newcomer_count = [
        k["first_counted"] - k["first_round"] for k in keys if k["first_counted"] is not None
    ]
    newcomer_est = [
        k["established_since"] - k["first_round"]
        for k in keys
        if k["established_since"] is not None
    ]
    delta = compare(row, reference)
    return {
        "counted_ever": max(row["attacker_updates_applied_ever"], default=0),
        "counted_end": max(row["attacker_updates_counted_at_end"], default=0),
        "sent": row["attacker_updates_sent"],
        "keys_counted": len(counted_keys),
        "stop_rounds": _span(stop),
        "start_rounds": _span(start),
        "delta": delta,
        "newcomer_count": _span(newcomer_count),
        "newcomer_est": _span(newcomer_est),
        "backlog": _span([f["backlog"] for f in row["per_founder"].values()]),
        "banned": _span(row["attacker_keys_banned"]),
        "honest_banned": len(row["honest_banned"]),
    }


def _mean_se(values: list[float]) -> str:
    """`mean +- standard error` over seeds (the mean alone for one value)."""
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:+.4f}"
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return f"{mean:+.4f} +- {(var / len(values)) ** 0.5:.4f}"


def by_scenario(rows: dict, refs: dict) -> list[str]:
    """One line per (scenario, N, rounds) over its seeds: the issue's report."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows.values():
        groups.setdefault((r["scenario"], r["sybils"], r["rounds"]), []).append(r)
    order = list(SCENARIOS)
    lines = [
        "| scenario | N | rounds | seeds | attacker updates counted at end, per seed | "
        "counted ever, per seed | keys banned, per seed | founders banned (all seeds) | "
        "held-out loss delta vs honest-only (mean +- SE over seeds) | founders' audit CPU "
        "/ training | newcomer rounds to first count / established | founders' ledgers "
        "agree |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (scenario, n, rounds), group in sorted(
        groups.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1], kv[0][2])
    ):
        group.sort(key=lambda r: r["seed"])
        sums = [summarize(r, refs.get(r["seed"]) if scenario != "honest-only" else None)
                for r in group]  # fmt: skip
        deltas = [s["delta"][1] for s in sums if s["delta"]]
        cpu = [r["audit_cpu_share"] for r in group if r["audit_cpu_share"] is not None]
        lines.append(
            f"| {scenario} | {n} | {rounds} | {len(group)} | "
            f"{' / '.join(str(s['counted_end']) for s in sums)} | "
            f"{' / '.join(str(s['counted_ever']) for s in sums)} | "
            f"{' / '.join(s['banned'] for s in sums)} | "
            f"{sum(s['honest_banned'] for s in sums)} | "
            f"{_mean_se(deltas) if scenario != 'honest-only' else 'reference'} | "
            f"{sum(cpu) / len(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}) | "
            f"{' / '.join(s['newcomer_count'] for s in sums)} ; "
            f"{' / '.join(s['newcomer_est'] for s in sums)} | "
            f"{'yes' if all(r['ledgers_agree_on_what_counts'] for r in group) else 'no'} |"
        )
    return lines


def pace_table(rows: dict) -> list[str]:
    """The founders' pace per row (rows written since `pace_view`): training rounds per
    minute (mean, and against the honest-only row of the seed), round deadlines waited out,
    and those that named a peer the founder had banned before."""
    paced = {k: r for k, r in rows.items() if r.get("founder_pace")}
    if not paced:
        return []

    def rpm(r: dict) -> float | None:
        return _mean([f["rounds_per_min"] for f in r["founder_pace"].values()])

    refs = {r["seed"]: rpm(r) for r in paced.values() if r["scenario"] == "honest-only"}
    late = {r["seed"]: newcomer_delay(r) for r in paced.values() if r["scenario"] == "honest-only"}
    lines = [
        "Founders' pace (by their logs; mean over the 4 founders): rounds per minute from "
        "the first to the last round line, against the honest-only row of the same seed; "
        "round deadlines waited out, and of those, deadlines that named a peer the founder "
        "had banned before (goal: 0). Newcomer: for each honest newcomer (--newcomers, "
        "started after the attackers), the rounds from its first update to the first "
        "settled state S_t that holds one of its updates (by the first founder's final "
        "ledger: t = max(round, the round its vouch takes effect) + lag + 1), against the "
        "honest-only row's (issue 45's goal: within 2x).",
        "",
        "| scenario | seed | N | launch (founders at nice 10) | rounds/min | vs honest-only "
        "| deadlines waited | for a banned peer | newcomer rounds to its first update in "
        "the model | vs honest-only |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(paced, key=lambda k: (paced[k]["seed"], paced[k]["sybils"])):
        r = paced[key]
        mine, ref = rpm(r), refs.get(r["seed"])
        ratio = f"{mine / ref:.2f}x" if mine and ref else "-"
        waits = [f["deadline_waits"] for f in r["founder_pace"].values()]
        banned = [f["deadline_waits_for_banned"] for f in r["founder_pace"].values()]
        launch = r.get("launch", "-")
        if r.get("attacker_nice") is not None and r["sybils"]:
            launch += f", attackers at nice {r['attacker_nice']}"
        if r.get("pinned"):
            pins = r["pinned"]
            launch += f"; honest on CPU {pins['honest']}"
            launch += f", attackers on CPU {pins['attackers']}" if r["sybils"] else ""
        delay, ref_delay = newcomer_delay(r), late.get(r["seed"])
        newcomer = "-" if delay is None else f"{delay:.0f}"
        vs = f"{delay / ref_delay:.2f}x" if delay is not None and ref_delay else "-"
        lines.append(
            f"| {r['scenario']} | {r['seed']} | {r['sybils']} | {launch} | "
            f"{mine:.1f} | {ratio} | {_span(waits)} | {_span(banned)} | {newcomer} | {vs} |"
            if mine
            else f"| {r['scenario']} | {r['seed']} | {r['sybils']} | - | - | - | - | - | - | - |"
        )
    return lines


def newcomer_delay(row: dict) -> float | None:
    """Mean over the row's honest newcomers of the rounds from its first update to the first
    state that holds one of its updates; None without newcomers (or none counted)."""
    waits = [
        k["first_in_model"] - k["first_round"]
        for k in (row.get("newcomers") or {}).values()
        if k.get("first_in_model") is not None and k.get("first_round") is not None
    ]
    return sum(waits) / len(waits) if waits else None


def write_markdown(result: dict, path: Path) -> None:
    rows = result["rows"]
    lines = [
        "# Many identities, one attacker: real daemons (bench/bench_sybil_daemon.py)",
        "",
        f"{result['machine']}; `{result['command']}`. tiny-llama on synthetic-sentiment "
        f"(harness/cluster.py RUN: lr 8e-3, n_ref 4, batch 8), 4 founders "
        f"(`extra.probation.founders`) + N attacker identities, each its own peer daemon and "
        f"p2pd with its own key, all under `nice -n 10` on 127.0.0.1; audits {AUDIT} "
        f"(--max-staleness 1), probation vouches {VOUCHES}, share "
        f"{', '.join(sorted({str(r.get('share', SHARE)) for r in rows.values()}))}. Held-out loss: "
        f"replay of the first founder's counted updates, {EVAL_EXAMPLES} examples; delta: "
        "the same replay limited to rounds < R against the honest-only row's (same seed, "
        "same manifest), R the largest multiple of 5 both rows reached.",
        "",
        "| scenario | seed | N | attacker updates counted ever / at end / sent | keys that "
        "counted | established (round) -> banned (round) of keys that counted | keys banned "
        "| founders banned "
        "| held-out loss (end; delta vs honest-only at round R) | accuracy "
        "| audit CPU / training (founders) | founders' retries (matched) "
        "| founders' updates counted | newcomer rounds to first count / established "
        "| backlog at end | founders' ledgers agree, "
        "counted rows identical | peer RSS MiB / CPU s | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    refs = {  # per seed: the honest-only row with losses by round (the longest)
        r["seed"]: r
        for r in sorted(rows.values(), key=lambda r: len(r.get("replay_loss_by_round", {})))
        if r["scenario"] == "honest-only"
    }
    order = list(SCENARIOS)
    for key in sorted(
        rows, key=lambda k: (rows[k]["seed"], order.index(rows[k]["scenario"]), rows[k]["sybils"])
    ):
        r = rows[key]
        ref = refs.get(r["seed"])
        s = summarize(r, ref if r["scenario"] != "honest-only" else None)
        delta = f"; at R {s['delta'][0]}: {s['delta'][1]:+.4f}" if s["delta"] else ""
        cost = r["cost"]
        tried = r.get("founder_retries")
        retried = f"{tried['late_state_retries']} ({tried['late_state_matches']})" if tried else "?"
        lines.append(
            f"| {r['scenario']} | {r['seed']} | {r['sybils']} | {s['counted_ever']} / "
            f"{s['counted_end']} / {s['sent']} | {s['keys_counted']} | {s['start_rounds']} -> "
            f"{s['stop_rounds']} | {s['banned']} | {s['honest_banned']} | "
            f"{r['replay_loss']:.4f}{delta} | "
            f"{r['replay_accuracy']:.3f} | {r['audit_cpu_share']:.3f} | {retried} | "
            f"{r.get('founder_updates_counted', '?')} | "
            f"{s['newcomer_count']} / {s['newcomer_est']} | {s['backlog']} | "
            f"{r['ledgers_agree_on_what_counts']}, {r['counted_rows_identical']} | "
            f"{cost['peak_rss_mib_per_peer']:.0f} / {cost['cpu_s_per_peer']:.0f} | "
            f"{r['seconds']:.0f} |"
        )
    lines += ["", "By scenario, over seeds:", "", *by_scenario(rows, refs)]
    lines += ["", *pace_table(rows)]
    lines += [
        "",
        "Counted ever: the most, over the founders, of the attacker updates a founder applied"
        " to its live model (those counted in its final ledger + those its log says it took "
        "back at a ban); at end: counted by the final ledger's standing. Established -> "
        "banned: the earliest founder's training round when it logged the key established "
        "(-1: before its first round) and the last founder's when it logged the ban (`-`: "
        "none). Founders banned: by the first founder's final ledger (target 0). Keys banned:"
        " by each founder's log (span over founders). Retries: the founders' recomputations "
        "of a mismatch on the states its sender may honestly have trained on instead "
        "(summed), and how many matched. Founders' updates counted: in the first founder's "
        "ledger (a founder that starts late or misses a deadline skips rounds, so two runs "
        "of one seed differ there too). Newcomer rounds: from a key's first "
        "update to its first counted one / to its establishing vouched one. Backlog: "
        "probation audits due that the founders' budget had not paid for, at the end. Agree: "
        "the 4 founders' final ledgers count the same (round, peer) set, with equal scalars. "
        "RSS / CPU: mean over the run's peer processes (daemon + its p2pd), peak RSS and CPU "
        "seconds.",
    ]
    path.write_text("\n".join(lines) + "\n")


def founder_work(work: Path) -> dict:
    """From a finished row's folder: the founders' updates that count in the first founder's
    ledger (real daemons skip rounds when late, so the honest rows of two runs differ), and
    the founders' late-state retries (peer/audit_duty.py `_late_states`) from final_status."""
    view = ledger_view(work / FOUNDERS[0] / "ledger.sqlite", set())
    founders = view["config"].probation.founders  # raw peer ids
    retries = {"late_state_retries": 0, "late_state_matches": 0, "probation_retries": 0}
    for name in FOUNDERS:
        status = work / name / "final_status.json"
        if status.exists():
            audits = json.loads(status.read_text()).get("audits", {})
            for k in ("late_state_retries", "late_state_matches"):
                retries[k] += audits.get("retries", {}).get(k, 0)
            retries["probation_retries"] += audits.get("probation", {}).get("probation_retries", 0)
    return {
        "founder_updates_counted": sum(1 for m in view["counted"] if m.peer in founders),
        "founder_retries": retries,
    }


def backfill(result: dict, base: Path) -> None:
    """Rows written without `replay_loss_by_round` or `founder_updates_counted` (earlier
    versions): from their kept folders (--keep), where they still exist."""
    for key, row in result["rows"].items():
        work = Path(row.get("work", ""))
        if "founder_updates_counted" not in row and (work / FOUNDERS[0]).is_dir():
            row.update(founder_work(work))
            print("backfilled founders' updates and retries of", key, "from", work)
        if row.get("replay_loss_by_round"):
            continue
        n, seed, scenario = row["sybils"], row["seed"], row["scenario"]
        for name in (f"seed{seed}-{scenario}-n{n}-r{row['rounds']}", f"seed{seed}-{scenario}-n{n}"):
            ledger = base / name / FOUNDERS[0] / "ledger.sqlite"
            if ledger.exists():
                view = ledger_view(ledger, set())
                last = max((m.round for m in view["counted"]), default=-1)
                if last + 2 < (row["per_founder"][FOUNDERS[0]].get("final_round") or 0):
                    continue  # another run's directory (the same name, fewer rounds)
                row["replay_loss_by_round"] = losses_by_round(
                    view["config"], view["counted"], base / name / "losses_by_round.json"
                )
                row["work"] = str(base / name)
                print("backfilled", key, "from", ledger)
                break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sybils", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--interval", type=float, default=1.0, help="--round-interval")
    parser.add_argument("--deadline", type=float, default=60, help="--round-deadline")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds per scenario; then the daemons are stopped (SIGTERM) and the row says "
        "so (stopped_early, final_rounds)",
    )
    parser.add_argument(
        "--fork-server",
        action="store_true",
        help="fork the daemons from one process that imported the stack once "
        "(harness/fork_server.py): 24 daemons start in seconds on 2 cores",
    )
    parser.add_argument(
        "--attacker-nice",
        type=int,
        default=NICE,
        help="the attacker identities' niceness (the founders': 10); 19 gives them the CPU "
        "the founders leave, as if they ran on machines of their own",
    )
    parser.add_argument(
        "--newcomers",
        type=int,
        default=0,
        help="honest newcomers started after the attackers (in every scenario, honest-only "
        "too): how long their first update takes to count, with and without the attackers",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the honest peers on the first half of the CPUs, the attackers on the rest "
        "(taskset): what the attackers' identities cost the honest side, not their processes",
    )
    parser.add_argument(
        "--share",
        type=float,
        default=SHARE,
        help=f"extra.probation.share: probation audits per established peer and round "
        f"(default {SHARE}; the product's 0.25)",
    )
    parser.add_argument("--name", default="sybil_daemon", help="results file name")
    parser.add_argument("--keep", default="", help="keep the runs' files under this folder")
    parser.add_argument(
        "--backfill",
        action="store_true",
        help="only add losses by round to finished rows from their kept ledgers (--keep)",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    out_json, out_md = OUT / f"{args.name}.json", OUT / f"{args.name}.md"
    result = json.loads(out_json.read_text()) if out_json.exists() else {"rows": {}}
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores"
    if not args.backfill:
        result["command"] = "python bench/bench_sybil_daemon.py " + " ".join(sys.argv[1:])
    if args.backfill:
        backfill(result, Path(args.keep))
        out_json.write_text(json.dumps(result, indent=1, default=str))
        write_markdown(result, out_md)
        return
    scenarios = args.scenarios.split(",")
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}: one of {list(SCENARIOS)}")
    with contextlib.ExitStack() as stack:
        if args.fork_server:
            from harness.fork_server import ForkLauncher
            from seedflood_p2p.apps import localnet

            launcher = ForkLauncher(Path(tempfile.mkdtemp(prefix="sybil-zygote-")) / "z.log")
            localnet.set_launcher(launcher)
            stack.callback(launcher.close)
        base = (
            Path(args.keep)
            if args.keep
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sybil-daemon-")))
        )
        for seed in args.seeds:
            for scenario in scenarios:
                n = 0 if scenario == "honest-only" else args.sybils
                key = f"{scenario}/seed{seed}/n{n}/r{args.rounds}"
                if key in result["rows"]:
                    print("done already:", key)
                    continue
                work = base / f"seed{seed}-{scenario}-n{n}-r{args.rounds}"
                if work.exists():  # an interrupted row: start it again from nothing
                    shutil.rmtree(work)
                work.mkdir(parents=True)
                print(time.strftime("%H:%M:%S"), "running", key, "in", work, flush=True)
                row = run_scenario(scenario, seed, args.sybils, args, work)
                result["rows"][key] = row
                out_json.write_text(json.dumps(result, indent=1, default=str))
                write_markdown(result, out_md)
                print(
                    time.strftime("%H:%M:%S"),
                    json.dumps(
                        {
                            k: row[k]
                            for k in (
                                "seconds",
                                "attacker_updates_applied_ever",
                                "attacker_updates_counted_at_end",
                                "replay_loss",
                                "audit_cpu_share",
                                "ledgers_agree_on_what_counts",
                                "exit_codes",
                            )
                        }
                    ),  # fmt: skip
                    flush=True,
                )


if __name__ == "__main__":
    main()
