"""Two p2pd daemons, each behind its own NAT: time to a relayed link and to a direct one.

    sudo nice -n 5 python bench/bench_nat.py [--runs 5] [--observers 3] [--out PATH]

Builds deploy/netns-nat-testnet.sh (pub1: the relay, pub2..: plain public daemons, priv1
and priv2 behind nftables-masquerade routers) and starts bare daemons with the settings
seedflood uses (`create_p2p`): the relay with `RelayLimits` (so reachability public), the
NATed ones with auto-relay and the relay as static relay. Each NATed daemon dials the relay
and the public daemons (identify needs 4 distinct observers before a node trusts its
observed public address, and DCUtR starts only then). When B announces a /p2p-circuit
address, A dials it (`connect_peer`): "relayed" is when A holds that connection; "direct"
is when A holds a connection to B without /p2p-circuit (DCUtR's hole punch). Times are
from the NATed daemons' start. Then the relay is stopped: does the direct link survive?
Writes PATH.json and PATH.md (default bench/results/nat).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "netns-nat-testnet.sh"
PUBLIC = "11.78.0"


async def _node(role: str, listen: str, dial: list[str], out: Path) -> None:
    """One daemon inside a namespace: print JSON lines (own addresses, connections)."""
    from hivemind.p2p import PeerID

    from seedflood_p2p.network.transport.p2pd import (
        RelayLimits,
        connect_peer,
        create_p2p,
        peer_connections,
    )

    p2p = await create_p2p(
        identity_path=None,
        host_maddrs=[listen],
        use_auto_relay=role.startswith("nat"),
        relays=[d for d in dial if d.startswith(f"/ip4/{PUBLIC}.1/")] if role != "relay" else (),
        relay_service=RelayLimits() if role == "relay" else None,
        reachability={"public": "public", "natpriv": "private"}.get(role, "auto"),
    )

    def say(**event) -> None:
        print(json.dumps({"t": time.time(), **event}), flush=True)

    say(event="started", peer_id=p2p.peer_id.to_base58())
    for addr in dial:
        maddr, _, pid = addr.rpartition("/p2p/")
        try:
            await connect_peer(p2p, PeerID.from_base58(pid), [maddr], 10)
        except Exception as e:  # reported, not fatal: the bench records what happened
            say(event="dial_failed", addr=addr, error=str(e))
    own: list[str] = []
    conns: dict[str, list[str]] = {}
    cmd_file = out / f"{p2p.peer_id.to_base58()}.dial"
    while True:
        addrs = sorted(str(a) for a in await p2p.get_visible_maddrs(latest=True))
        if addrs != own:
            own = addrs
            say(event="own_addrs", addrs=own)
        now = await peer_connections(p2p)
        if now != conns:
            conns = now
            say(event="connections", conns=conns)
        if cmd_file.exists():  # the orchestrator asks us to dial a circuit address
            target = cmd_file.read_text().strip()
            cmd_file.unlink()
            maddr, _, pid = target.rpartition("/p2p/")
            try:
                # a fresh relayed connection: DCUtR starts on a new inbound relayed connection,
                # and one opened by the DHT before the hole-punch service was up is not retried
                await p2p._client.disconnect(PeerID.from_base58(pid))
                await connect_peer(p2p, PeerID.from_base58(pid), [maddr], 15)
                say(event="dialled", addr=target)
            except Exception as e:
                say(event="dial_failed", addr=target, error=str(e))
        await asyncio.sleep(0.1)


class Proc:
    def __init__(self, prefix: str, host: str, args: list[str], log: Path) -> None:
        self.log = log
        self.file = log.open("w")
        self.p = subprocess.Popen(
            [
                str(SCRIPT),
                "--prefix",
                prefix,
                "exec",
                host,
                sys.executable,
                __file__,
                "node",
                *args,
            ],
            stdout=self.file,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def events(self) -> list[dict]:
        out = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def wait_for(self, name: str, timeout: float, pred=lambda e: True) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events():
                if e.get("event") == name and pred(e):
                    return e
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.log.name} exited:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.log.name}: no {name} in {timeout} s")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.file.close()


def one_run(
    prefix: str, work: Path, observers: int, wait_direct: float, nat_role: str, wait_circuit: float
) -> dict:
    procs: list[Proc] = []
    result: dict = {}
    try:
        subprocess.run(
            [
                str(SCRIPT),
                "--prefix",
                prefix,
                "--public",
                str(1 + observers),
                "--private",
                "2",
                "up",
            ],
            check=True,
            capture_output=True,
        )
        pubs = []
        for i in range(1, 2 + observers):
            role = "relay" if i == 1 else "public"
            p = Proc(
                prefix,
                f"pub{i}",
                [role, f"/ip4/{PUBLIC}.{i}/tcp/4001", str(work)],
                work / f"pub{i}.log",
            )
            procs.append(p)
            pubs.append(f"/ip4/{PUBLIC}.{i}/tcp/4001/p2p/" + p.wait_for("started", 60)["peer_id"])
        nats = {}
        for i in (1, 2):
            nats[i] = Proc(
                prefix,
                f"priv{i}",
                [nat_role, f"/ip4/192.168.{i}.2/tcp/4001", str(work), *pubs],
                work / f"priv{i}.log",
            )
            procs.append(nats[i])
        a, b = nats[1], nats[2]
        a_id = a.wait_for("started", 60)
        b_id = b.wait_for("started", 60)
        start = max(a_id["t"], b_id["t"])
        circuit = b.wait_for(
            "own_addrs", wait_circuit, lambda e: any("/p2p-circuit" in x for x in e["addrs"])
        )
        b_circuit = next(x for x in circuit["addrs"] if "/p2p-circuit" in x)
        result["circuit_addr_s"] = round(circuit["t"] - b_id["t"], 2)  # from B's start
        time.sleep(2)  # until both know their public (observed) address
        bid = b_id["peer_id"]
        conns = [e for e in a.events() if e.get("event") == "connections"]
        already = conns and any("/p2p-circuit" not in x for x in conns[-1]["conns"].get(bid, []))
        redial = time.time()
        if not already:  # a fresh relayed dial, as Links.retry_hole_punches makes it
            (work / f"{a_id['peer_id']}.dial").write_text(f"{b_circuit}/p2p/{bid}")

        def has(kind):
            def pred(e):
                addrs = e["conns"].get(bid, [])
                return any(("/p2p-circuit" in x) == (kind == "relayed") for x in addrs)

            return pred

        # the first link to B: relayed, or already direct when DCUtR on a relayed connection
        # the daemons opened themselves finished between two polls (100 ms)
        first = a.wait_for("connections", 30, lambda e: has("relayed")(e) or has("direct")(e))
        if has("relayed")(first):
            result["relayed_s"] = round(first["t"] - start, 2)
        else:
            result["relayed_s"] = "direct first"
        try:
            direct = a.wait_for("connections", wait_direct, has("direct"))
            result["direct_s"] = round(direct["t"] - start, 2)
            if not already:
                result["direct_after_redial_s"] = round(direct["t"] - redial, 2)
            result["direct_addr"] = [x for x in direct["conns"][bid] if "/p2p-circuit" not in x]
        except TimeoutError:
            result["direct_s"] = None
        own_a = [e["addrs"] for e in a.events() if e.get("event") == "own_addrs"]
        result["a_own_addrs_last"] = own_a[-1] if own_a else []
        # the relay dies: a direct link stays, a relayed one goes
        procs[0].stop()
        time.sleep(5)
        last = [e for e in a.events() if e.get("event") == "connections"][-1]["conns"]
        result["after_relay_stopped"] = last.get(bid, [])
    finally:
        for p in procs:
            p.stop()
        subprocess.run([str(SCRIPT), "--prefix", prefix, "--kill", "down"], capture_output=True)
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        role, listen, out, *dial = sys.argv[2:]
        asyncio.run(_node(role, listen, dial, Path(out)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--observers", type=int, default=3, help="public daemons besides the relay")
    parser.add_argument("--wait-direct", type=float, default=60.0, help="seconds")
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--private",
        action="store_true",
        help="NATed daemons start with reachability private (no AutoNAT wait)",
    )
    parser.add_argument("--wait-circuit", type=float, default=60.0, help="seconds")
    parser.add_argument("--keep", action="store_true", help="keep the daemons' logs")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    out = Path(args.out or ROOT / "bench" / "results" / "nat")
    import tempfile

    runs = []
    load_start = os.getloadavg()
    for i in range(args.runs):
        work = tempfile.mkdtemp(prefix="sf-natbench-")
        if True:
            try:
                r = one_run(
                    f"sfnb{os.getpid() % 10000}",
                    Path(work),
                    args.observers,
                    args.wait_direct,
                    "natpriv" if args.private else "nat",
                    args.wait_circuit,
                )
            except (RuntimeError, TimeoutError) as e:
                r = {"error": str(e)[:300]}
        if not args.keep and "error" not in r:
            shutil.rmtree(work, ignore_errors=True)
        r["logs"] = work if args.keep or "error" in r else None
        print(f"run {i + 1}: {r}", file=sys.stderr)
        runs.append(r)
    summary = {
        "command": "sudo nice -n 5 python bench/bench_nat.py " + " ".join(sys.argv[1:]),
        "observers": args.observers,
        "runs": runs,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"# NATed p2pd daemons: relayed and direct links (`{summary['command'].strip()}`)",
        "",
        f"Relay + {args.observers} public daemons, two daemons behind masquerade NATs; seconds "
        "from the NATed daemons' start. Load average "
        f"{'/'.join(f'{x:.2f}' for x in load_start)} at start, {os.cpu_count()} cores.",
        "",
        "| run | B's circuit address (from B's start) | relayed link | direct link (hole punch)"
        " | of which after the fresh relayed dial | B's links at A 5 s after the relay stopped |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs, 1):
        lines.append(
            f"| {i} | {r.get('circuit_addr_s')} | {r.get('relayed_s')} | "
            f"{r.get('direct_s') if r.get('direct_s') is not None else 'none'} | "
            f"{r.get('direct_after_redial_s', '')} | "
            f"{', '.join(r.get('after_relay_stopped', [])) or r.get('error', 'none')} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
