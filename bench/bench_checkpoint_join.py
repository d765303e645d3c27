"""A late joiner's two paths to the model: fetch a chain checkpoint from peers, or replay.

    nice -n 19 python bench/bench_checkpoint_join.py [--rounds 10000,100000] [--peers 8]
        [--tail 100] [--model tiny-llama] [--threads 1] [--name join-tiny-llama]

Per ROUNDS: a synthetic ledger of ROUNDS x PEERS rows (N(0,1) scalars, float16) and the
link of the run's checkpoint chain (algorithm/chain.py) that covers every row but the
last TAIL rounds' (P = ROUNDS - TAIL). Two donors with real p2pd daemons on 127.0.0.1 serve
the same link (network/transfer/checkpoints.py:CheckpointServer); a joiner (its own p2pd, the same
process) then takes each path on a fresh model, timed:

- checkpoint: ask both donors for offers, download the chunks from both at once (hashed per
  chunk and whole), then `LiveModel.restore` from it (checks the cut against the ledger and
  the tensors' hash, applies the TAIL x PEERS rows after it);
- replay: `LiveModel.restore` without a checkpoint (replay of every row).

What both paths share is not timed: syncing the ledger from peers, which a joiner does
either way (dominated by one Ed25519 check per row: ~10 s per 80,000 rows,
bench/results/network.md), loading the model. Loopback is not a WAN: the download is also
given at 100 Mbit/s (size / rate), which is what the joiner's rule assumes by default.
Writes bench/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

WAN_MBIT = 100.0


def synthetic_rows(rounds: int, peers: int, seed: int = 7) -> list:
    import numpy as np

    from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars

    rng = np.random.default_rng(seed)
    ids = [bytes.fromhex("002408011220") + bytes([p + 1]) * 32 for p in range(peers)]
    scalars = rng.standard_normal(rounds * peers)
    return [
        UpdateMessage(t, ids[p], quantize_scalars([scalars[t * peers + p]]))
        for t in range(rounds)
        for p in range(peers)
    ]


async def fetch_path(config, link_dir: Path, ledger, work: Path) -> dict:
    """Two donors serve the link; the joiner fetches it from both. Returns timings."""
    from hivemind.p2p import PeerID

    from seedflood_p2p.network.host import HostSettings, NetworkHost
    from seedflood_p2p.network.transfer.checkpoints import CheckpointServer, fetch_checkpoint
    from seedflood_p2p.network.transport.p2pd import connect_peer
    from seedflood_p2p.storage.ledger import Ledger

    async with contextlib.AsyncExitStack() as stack:
        nodes = []
        for name in ("donor-a", "donor-b", "joiner"):
            # a fresh identity, no reconnection or discovery; the nodes are never started
            # (no flood, no repair): only the checkpoint download is measured
            host = await stack.enter_async_context(NetworkHost(HostSettings()))
            own = Ledger(":memory:", config.run_id) if name != "joiner" else ledger
            nodes.append(host.flood_node(own, config))
        for node in nodes[:2]:
            server = CheckpointServer(node)
            await server.start()
            stack.callback(server.close)
            await server.publish(link_dir)
        joiner = nodes[2]
        donors = []
        for node in nodes[:2]:
            addrs = [str(a).split("/p2p/")[0] for a in await node.p2p.get_visible_maddrs()]
            peer = PeerID(node.peer_id)
            await connect_peer(joiner.p2p, peer, addrs, 10.0)
            donors.append(peer)
        started = time.perf_counter()
        result = await fetch_checkpoint(joiner, donors, work / "fetched", 60.0, lambda offer: None)
        seconds = time.perf_counter() - started
        return {
            "fetch_s": round(seconds, 2),
            "bytes": result.offer.size,
            "peers": len(result.peers),
            "refused": result.refused,
            "mbyte_per_s": round(result.offer.size / seconds / 1e6, 1),
        }


def measure(rounds: int, peers: int, tail: int, model_name: str, work: Path) -> dict:
    from seedflood_p2p.algorithm.chain import CheckpointChain
    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.replay import estimate_replay_seconds
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    period = rounds - tail
    config = RunConfig(model=model_name, extra={"checkpoint_every": period})
    out: dict = {"rounds": rounds, "peers": peers, "tail_rounds": tail, "rows": rounds * peers}
    t = time.perf_counter()
    rows = synthetic_rows(rounds, peers)
    ledger = Ledger(work / "ledger.sqlite", config.run_id)
    ledger.add(rows)
    out["ledger_build_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    chain = CheckpointChain(load_model(model_name)[0], config, work / "link")
    meta = chain.build([m for m in rows if m.round < period], period)
    out["link_build_s"] = round(time.perf_counter() - t, 1)  # a donor's cost, once per link
    out["link_rows"] = meta["ledger_messages"]
    out["checkpoint"] = asyncio.run(fetch_path(config, work / "link", ledger, work))
    for path, directory in (("checkpoint", work / "fetched"), ("replay", None)):
        model, _ = load_model(model_name)
        live = LiveModel(make_estimator(model, config), ledger)
        t = time.perf_counter()
        cut = live.cut()
        how = live.restore(cut, directory)
        seconds = time.perf_counter() - t
        if path == "checkpoint":
            out["checkpoint"].update(restore_s=round(seconds, 2), how=how)
            out["params"] = live.engine.num_parameters
        else:
            out["replay"] = {"restore_s": round(seconds, 2), "how": how}
    fetched = out["checkpoint"]
    fetched["total_s"] = round(fetched["fetch_s"] + fetched["restore_s"], 2)
    wan = fetched["bytes"] * 8 / (WAN_MBIT * 1e6)
    fetched["total_at_100mbit_s"] = round(wan + fetched["restore_s"], 2)
    out["rule_estimate_replay_s"] = round(
        estimate_replay_seconds(out["link_rows"], period, config, out["params"]), 2
    )
    out["rule_estimate_download_s"] = round(wan, 2)
    ledger.close()
    return out


def download_probe(mib: int, work: Path) -> dict:
    """Only the transfer of a file of SmolLM2's size (random bytes under a valid offer; not
    a safetensors file, nothing is restored from it): the chunk protocol's throughput
    between real p2pd daemons on loopback, from 2 donors at once."""
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.storage.checkpoint import META_FILE, WEIGHTS_FILE
    from seedflood_p2p.storage.ledger import Ledger

    config = RunConfig(model="smollm2-135m", extra={"checkpoint_every": 1000})
    link = work / "probe"
    link.mkdir(parents=True)
    with open(link / WEIGHTS_FILE, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
    meta = {
        "run_id": config.run_id,
        "round": 1000,
        "ledger_messages": 0,
        "ledger_digest": "0" * 64,
        "weights_sha256": "0" * 64,
        "ledger_cut": {},
    }
    (link / META_FILE).write_text(json.dumps(meta))
    ledger = Ledger(":memory:", config.run_id)
    out = asyncio.run(fetch_path(config, link, ledger, work))
    out["mib"] = mib
    out["at_100mbit_s"] = round(mib * 2**20 * 8 / (WAN_MBIT * 1e6), 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", default="10000,100000")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--tail", type=int, default=100)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="")
    parser.add_argument(
        "--probe-mib", type=int, default=405, help="also time a download this large (0: no)"
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    name = args.name or f"join-{args.model}"
    out = {
        "command": "nice -n 19 python bench/bench_checkpoint_join.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "runs": [],
    }
    for rounds in [int(r) for r in args.rounds.split(",") if r]:
        work = Path(tempfile.mkdtemp(prefix="bench-join-"))
        try:
            out["runs"].append(measure(rounds, args.peers, args.tail, args.model, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(out["runs"][-1]), flush=True)
    if args.probe_mib:
        work = Path(tempfile.mkdtemp(prefix="bench-join-"))
        try:
            out["download_probe"] = download_probe(args.probe_mib, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(out["download_probe"]), flush=True)
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    (RESULTS / f"{name}.md").write_text(markdown(out))
    print(markdown(out))
    return 0


def markdown(out: dict) -> str:
    lines = [
        f"# Late join: checkpoint download vs replay ({out['model']})",
        "",
        f"`{out['command']}`; torch threads {out['torch_threads']}, load average "
        f"{out['loadavg_start']} at start, {out['loadavg_end']} at the end (2 shared cores).",
        "Not timed (both paths do it): syncing and signature-checking the ledger, loading the "
        "model. Download over real p2pd daemons on loopback from 2 donors at once.",
        "",
        "| rounds x peers | rows | link | fetch (loopback) | restore from it | checkpoint path | "
        f"... at {WAN_MBIT:g} Mbit/s | replay path | rule's estimates (download / replay) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["runs"]:
        c = r["checkpoint"]
        lines.append(
            f"| {r['rounds']:,} x {r['peers']} | {r['rows']:,} | {c['bytes'] / 2**20:.2f} MiB, "
            f"{r['link_rows']:,} rows | {c['fetch_s']} s ({c['mbyte_per_s']} MB/s) | "
            f"{c['restore_s']} s | **{c['total_s']} s** | {c['total_at_100mbit_s']} s | "
            f"**{r['replay']['restore_s']} s** | {r['rule_estimate_download_s']} s / "
            f"{r['rule_estimate_replay_s']} s |"
        )
    if "download_probe" in out:
        p = out["download_probe"]
        lines += [
            "",
            f"Download alone of a {p['mib']} MiB file (SmolLM2-135M's trainable weights; "
            f"random bytes under a valid offer, nothing restored): {p['fetch_s']} s from "
            f"{p['peers']} donors on loopback ({p['mbyte_per_s']} MB/s, every chunk and the "
            f"whole file hashed); {p['at_100mbit_s']} s at {WAN_MBIT:g} Mbit/s.",
        ]
    if not out["runs"]:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "Restore from the checkpoint applies the last rounds' rows after it ("
        + "; ".join(f"`{r['checkpoint']['how']}`" for r in out["runs"])
        + "). A donor builds each link once (link build: "
        + ", ".join(f"{r['link_build_s']} s" for r in out["runs"])
        + ", a replay of the link's rows from the base when it has no earlier link).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
