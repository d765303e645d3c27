"""The run the multi-process tests share; processes come from seedflood_p2p.apps.localnet.

The run's settings are a `RunConfig`; a process is handed them as a TOML file
(`run_toml`, read by `--config`), the same way the demo hands them to its bootstrap node.
A peer that misbehaves on purpose runs harness/hooked_peer.py (`start_hooked_peer`).
"""

import dataclasses
import sys
from pathlib import Path

from seedflood_p2p.apps.localnet import start_bootstrap as _start_bootstrap
from seedflood_p2p.apps.localnet import start_peer
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.flags import to_toml

RUN = RunConfig(
    model="tiny-llama",
    dataset="synthetic-sentiment",
    rank=4,
    refresh_period=5,
    lr=8e-3,  # normalize "unit": about the step of lr 2e-3 with scalars as sent
    n_ref=4,
    batch_size=8,
)


# The audited run of the audit and equivocation daemon tests. lag 2: round t trains on base
# + counted updates of rounds < t - 2, which a peer holds when peers may be at most one
# round apart (--max-staleness 1). cpu_share 1.5 among 4 peers: each update audited by each
# other peer with probability 0.5 (a test, not a cost target), so a cheater is caught
# within its first rounds. quorum 2 of the 3 honest voters.
AUDIT = {"lag": 2, "cpu_share": 1.5, "quorum": 2}
AUDITED_RUN = dataclasses.replace(RUN, extra={"audit": AUDIT})


def peer_flags(*extra: str, linger: float = 4, repair_interval: float = 1, **flags) -> list[str]:
    """`seedflood peer` flags from keywords (until_round=20 -> "--until-round", "20"), in
    the order given, then `extra` as it is. Every multi-peer test lingers 4 s after its
    last round and repairs every second unless it says otherwise."""
    flags.update(linger=linger, repair_interval=repair_interval)
    out: list[str] = []
    for name, value in flags.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return [*out, *extra]


def audited_peer_flags(rounds: int, *extra: str) -> list[str]:
    """A peer's flags in AUDITED_RUN: at most one round apart (lag 2 holds), 0.6 s rounds,
    a 20 s round deadline, 3 peers to start."""
    return peer_flags(
        *extra,
        until_round=rounds,
        round_interval=0.6,
        max_staleness=1,
        round_deadline=20,
        min_peers=3,
    )


def run_toml(directory: Path) -> Path:
    """RUN as DIRECTORY/run.toml, for `--config`."""
    path = Path(directory) / "run.toml"
    path.write_text(to_toml(RUN))
    return path


def start_bootstrap(workdir, extra=()):
    return _start_bootstrap(workdir, RUN, extra)


HOOKED_PEER = (sys.executable, str(Path(__file__).with_name("hooked_peer.py")))


def start_hooked_peer(workdir, name, bootstrap, extra=(), **kwargs):
    """`start_peer` of a peer that misbehaves as `extra`'s hooked_peer.py flags say
    (--cheat, --checkpoint, --drop-incoming; the rest are `seedflood peer` flags)."""
    return start_peer(workdir, name, bootstrap, extra, program=HOOKED_PEER, **kwargs)


__all__ = [
    "AUDIT",
    "AUDITED_RUN",
    "HOOKED_PEER",
    "RUN",
    "audited_peer_flags",
    "peer_flags",
    "run_toml",
    "start_bootstrap",
    "start_hooked_peer",
    "start_peer",
]
