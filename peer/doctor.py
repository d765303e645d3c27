"""`seedflood doctor`: check that this machine can join a run, and say what to fix.

Each check prints one line, `ok`, `warn` or `FAIL`, what it found, and for anything
not ok the fix. The checks, in the order a peer's start would trip over them:

    p2pd        the libp2p daemon bundled with hivemind exists and runs, and our build of
                it (network/transport/p2pd_build.py) can be made
    listen      each listen address can be bound (port free, address of this machine)
    data dir    exists or can be created, is writable, has free disk space
    identity    the key file, if present, is one `seedflood peer` accepts
    ledger      the ledger file, if present, opens and its rows verify
    bootstrap   each address answers: TCP connect, then a libp2p dial and the run
                manifest (run id, model, version), through a throwaway daemon
    clock       the skew against each bootstrap node's clock (from the manifest reply)
    reachable   the addresses the daemon would announce: public or only private

Not checked: AutoNAT's verdict (p2pd's control protocol does not expose it), so
`reachable` only says whether this machine has a public address at all.
Exit status 0 when nothing failed, 1 otherwise; `--json` prints the checks as data.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack

from seedflood_p2p import __version__
from seedflood_p2p.core.errors import UserError

if TYPE_CHECKING:
    from seedflood_p2p.network.transport.p2pd import PubSubP2P

MIN_FREE_BYTES = 2 << 30  # a SmolLM2 peer: the model cache, checkpoints and the ledger
CLOCK_WARN = 5.0  # seconds: rounds are seconds long; more skew misleads round timing


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    fix: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        help="a bootstrap (or any peer's) address /ip4/HOST/tcp/PORT/p2p/ID; repeatable",
    )
    parser.add_argument("--data-dir", type=Path, default=Path("seedflood-peer"))
    parser.add_argument(
        "--listen",
        action="append",
        default=[],
        help="listen multiaddr to check (repeatable; default /ip4/0.0.0.0/tcp/0)",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per network check")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise UserError(f"--timeout must be > 0 seconds (got {args.timeout})")
    checks = diagnose(
        args.bootstrap, args.data_dir, args.listen or ["/ip4/0.0.0.0/tcp/0"], args.timeout
    )
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        for c in checks:
            print(f"{'FAIL' if c.status == 'fail' else c.status:<4}  {c.name:<9}  {c.detail}")
            if c.fix:
                print(f"{'':<4}  {'':<9}  fix: {c.fix}")
        failed = sum(c.status == "fail" for c in checks)
        warned = sum(c.status == "warn" for c in checks)
        print(f"{len(checks)} checks: {failed} failed, {warned} warnings")
    return 1 if any(c.status == "fail" for c in checks) else 0


def diagnose(
    bootstrap: list[str], data_dir: Path, listen: list[str], timeout: float
) -> list[Check]:
    checks = [check_p2pd(timeout)]
    checks += [check_listen(addr) for addr in listen]
    checks.append(check_data_dir(data_dir))
    checks.append(check_identity(data_dir / "identity.key"))
    checks.append(check_ledger(data_dir / "ledger.sqlite"))
    if not bootstrap:
        checks.append(
            Check(
                "bootstrap",
                "warn",
                "no address given: nothing to dial",
                "pass --bootstrap ADDRESS (the address a bootstrap node prints at start)",
            )
        )
    else:
        checks += asyncio.run(check_network(bootstrap, timeout))
    return checks


def check_p2pd(timeout: float) -> Check:
    try:
        from importlib.resources import files

        path = Path(str(files("hivemind.hivemind_cli") / "p2pd"))
    except Exception as exc:  # hivemind missing or broken
        return Check(
            "p2pd",
            "fail",
            f"hivemind is not importable ({exc})",
            "pip install -e . (hivemind ships the p2pd binary)",
        )
    if not os.access(path, os.X_OK):
        return Check(
            "p2pd",
            "fail",
            f"{path} is missing or not executable",
            "reinstall hivemind: pip install --force-reinstall hivemind",
        )
    try:
        out = subprocess.run([str(path), "-h"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(
            "p2pd",
            "fail",
            f"{path} does not run ({exc})",
            "the binary is built for another CPU or OS: reinstall hivemind from source",
        )
    if "listen" not in out.stdout + out.stderr:
        return Check(
            "p2pd", "fail", f"{path} ran but does not look like p2pd", "reinstall hivemind"
        )
    from seedflood_p2p.network.transport.p2pd_build import BuildError, MeshSettings, build

    try:
        ours = build(path, MeshSettings())
    except (BuildError, OSError) as exc:
        return Check(
            "p2pd",
            "warn",
            f"{path} runs, but our build of it could not be made ({exc}); the bundled "
            "binary runs as it is: every peer serves a relay with go-libp2p's defaults and "
            "GossipSub's settings stay at theirs",
            "use the hivemind release this seedflood pins (pip install -e .) on x86_64 "
            "Linux, where a process may ptrace its own child",
        )
    return Check("p2pd", "ok", f"{path}; our build: {ours}")


def check_listen(maddr: str) -> Check:
    from seedflood_p2p.network.transport.p2pd import probe_listen_addrs

    try:
        probe_listen_addrs([maddr])
    except UserError as exc:  # the message says what to do
        return Check("listen", "fail", str(exc))
    return Check("listen", "ok", f"{maddr} can be bound")


def check_data_dir(data_dir: Path) -> Check:
    target = data_dir if data_dir.exists() else data_dir.parent
    if data_dir.exists() and not data_dir.is_dir():
        return Check(
            "data dir",
            "fail",
            f"{data_dir} exists and is not a directory",
            "pass another --data-dir, or move the file aside",
        )
    if not target.is_dir():
        return Check(
            "data dir", "fail", f"neither {data_dir} nor its parent exists", f"mkdir -p {data_dir}"
        )
    try:
        with tempfile.NamedTemporaryFile(dir=target, prefix=".doctor-") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return Check(
            "data dir",
            "fail",
            f"cannot write in {target}: {exc.strerror}",
            "fix its permissions or pass another --data-dir",
        )
    free = shutil.disk_usage(target).free
    if free < MIN_FREE_BYTES:
        return Check(
            "data dir",
            "warn",
            f"{target}: only {free / 2**30:.1f} GiB free",
            f"free at least {MIN_FREE_BYTES >> 30} GiB (model cache, checkpoints)",
        )
    state = "exists" if data_dir.exists() else "will be created"
    return Check("data dir", "ok", f"{data_dir} {state}, {free / 2**30:.0f} GiB free")


def check_identity(path: Path) -> Check:
    from seedflood_p2p.network.transport.identity import load_or_create_identity

    if not path.exists():
        return Check("identity", "ok", f"no {path} yet: a new Ed25519 key is made at first start")
    try:
        peer_id = load_or_create_identity(path)
    except UserError as exc:  # the message says what to do
        return Check("identity", "fail", str(exc))
    return Check("identity", "ok", f"{path}: peer id {peer_id}")


def check_ledger(path: Path) -> Check:
    from seedflood_p2p.network.transport.identity import verify_pubsub_signature
    from seedflood_p2p.storage.ledger import Ledger

    if not path.exists():
        return Check("ledger", "ok", "no ledger yet: a new peer replays the run's history")
    fix = "move the data dir aside to rejoin from the other peers"
    try:
        ledger = Ledger.open_existing(path)
        try:
            config = ledger.config
            # A peer's own rows may be unsigned (not yet echoed): the verifier allows one
            # writer's unsigned rows, which is what a peer's own ledger holds.
            check = ledger.verify(verify_pubsub_signature, fix, directions=config.directions)
        finally:
            ledger.close()
    except UserError as exc:
        return Check("ledger", "fail", str(exc).removesuffix(fix).rstrip(": "), fix)
    return Check(
        "ledger",
        "ok",
        f"{path}: {check.signed} signed rows verified, {check.unsigned} own "
        f"rows unsigned, run {config.run_id[:12]} ({config.model} on {config.dataset})",
    )


def _host_port(maddr: str) -> tuple[str, int] | None:
    m = re.match(r"/(?:ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d+)", maddr)
    return (m.group(1), int(m.group(2))) if m else None


async def check_network(bootstrap: list[str], timeout: float) -> list[Check]:
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from seedflood_p2p.network.transport.p2pd import create_p2p
    from seedflood_p2p.network.transport.rpc import RemoteCallError, call_bytes

    checks: list[Check] = []
    dialable = []
    for addr in bootstrap:
        where = _host_port(addr)
        if where is None or "/p2p/" not in addr:
            checks.append(
                Check(
                    "bootstrap",
                    "fail",
                    f"{addr!r} is not /ip4/HOST/tcp/PORT/p2p/ID",
                    "copy the address the bootstrap node prints at start",
                )
            )
            continue
        try:
            with socket.create_connection(where, timeout=timeout):
                pass
        except OSError as exc:
            checks.append(
                Check(
                    "bootstrap",
                    "fail",
                    f"{addr}: TCP connect to {where[0]}:{where[1]} failed ({exc.strerror or exc})",
                    "check that the node runs and that its port is open "
                    f"(`nc -vz {where[0]} {where[1]}`)",
                )
            )
            continue
        dialable.append(addr)
    if not dialable:
        return checks
    try:
        p2p = await create_p2p(
            identity_path=None,
            host_maddrs=["/ip4/0.0.0.0/tcp/0"],
            initial_peers=dialable,
            startup_timeout=timeout,
            # test a relay reservation on the bootstrap nodes as a NATed peer would make it
            use_auto_relay=True,
            reachability="private",
        )
    except UserError as exc:
        return checks + [
            Check(
                "bootstrap",
                "fail",
                f"libp2p dial failed: {exc}",
                "the port answers TCP but not libp2p: check the address's peer id",
            )
        ]
    try:
        for addr in dialable:
            peer_id = PeerID.from_base58(Multiaddr(addr).value_for_protocol("p2p"))
            started = time.monotonic()
            try:
                reply = msgpack.unpackb(
                    await call_bytes(p2p, peer_id, "seedflood.manifest", b"", timeout)
                )
                manifest = json.loads(reply["manifest"])
                skew = float(reply["time"]) - time.time()
                version = str(reply["version"])
            except (RemoteCallError, ValueError, KeyError, TypeError) as exc:
                checks.append(
                    Check(
                        "bootstrap",
                        "fail",
                        f"{addr}: no run manifest ({exc})",
                        "the address is not a seedflood node, or it is overloaded",
                    )
                )
                continue
            took = time.monotonic() - started
            checks.append(
                Check(
                    "bootstrap",
                    "ok",
                    f"{addr}: run {manifest.get('model', '?')} on "
                    f"{manifest.get('dataset', '?')}, seedflood {version}, "
                    f"answered in {took:.2f} s",
                )
            )
            if version.split(".")[:2] != __version__.split(".")[:2]:
                checks.append(
                    Check(
                        "version",
                        "fail",
                        f"the run uses {version}, this is {__version__}",
                        f"pip install seedflood-p2p=={version}",
                    )
                )
            checks.append(clock_check(addr, skew))
        # the addresses seen at start, before any reservation replaced the public ones
        checks.append(reachability(await p2p.get_visible_maddrs()))
        checks.append(await relay_check(p2p, min(timeout, 5.0)))
    finally:
        await p2p.shutdown()
    return checks


def clock_check(addr: str, skew: float) -> Check:
    from peer.daemon import MAX_CLOCK_SKEW

    detail = f"{skew:+.1f} s against {addr.rsplit('/', 1)[-1][:16]}..."
    fix = "enable time sync (e.g. `timedatectl set-ntp true`)"
    if not abs(skew) <= MAX_CLOCK_SKEW:
        return Check(
            "clock", "fail", detail + f" (a peer refuses over {MAX_CLOCK_SKEW:.0f} s)", fix
        )
    if abs(skew) > CLOCK_WARN:
        return Check("clock", "warn", detail, fix)
    return Check("clock", "ok", detail)


async def relay_check(p2p: PubSubP2P, wait: float) -> Check:
    """Does a bootstrap node accept a relay reservation? (What a peer behind NAT relies on:
    its announced /p2p-circuit address.) Polls the daemon's addresses for up to `wait` s."""
    started = time.monotonic()
    while True:
        addrs = [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
        circuits = [a for a in addrs if "/p2p-circuit" in a]
        if circuits or time.monotonic() - started > wait:
            break
        await asyncio.sleep(0.2)
    if circuits:
        relay = circuits[0].split("/p2p-circuit")[0].rsplit("/p2p/", 1)[-1]
        return Check(
            "relay",
            "ok",
            f"reservation on relay {relay[:16]}... in {time.monotonic() - started:.1f} s: "
            f"behind NAT, others reach you at {circuits[0].split('/p2p-circuit')[0]}/p2p-circuit;"
            " a hole punch (DCUtR) then tries a direct link (`seedflood status` counts them)",
        )
    return Check(
        "relay",
        "warn",
        f"no relay address in {wait:.0f} s: no bootstrap node accepted a reservation, or it "
        "has no public address (libp2p builds circuit addresses from a relay's public ones); "
        "behind NAT, only your own outbound connections then carry traffic (training works)",
        "ask the run's operator to serve a relay (relay_service, on a public address)",
    )


def reachability(maddrs: list) -> Check:
    hosts = []
    for maddr in maddrs:
        m = re.match(r"/ip[46]/([^/]+)/", str(maddr))
        if m:
            hosts.append(m.group(1))
    public = [h for h in hosts if ipaddress.ip_address(h).is_global]
    if public:
        return Check("reachable", "ok", f"public address(es) {', '.join(sorted(set(public)))}")
    return Check(
        "reachable",
        "warn",
        f"only private addresses ({', '.join(sorted(set(hosts))) or 'none'}): peers outside "
        "this network reach you only through a relay or port forwarding",
        "nothing needed: behind NAT the peer reserves a slot on a relay (see the relay "
        "check); or forward a port and pass --announce /ip4/PUBLIC_IP/tcp/PORT",
    )
