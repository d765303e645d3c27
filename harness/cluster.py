"""The run the multi-process tests share; processes come from seedflood_p2p.apps.localnet.

The run's settings are a `RunConfig`; a process is handed them as a TOML file
(`run_toml`, read by `--config`), the same way the demo hands them to its bootstrap node.
A peer that misbehaves on purpose runs harness/hooked_peer.py (`start_hooked_peer`).
"""

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


__all__ = ["HOOKED_PEER", "RUN", "run_toml", "start_bootstrap", "start_hooked_peer", "start_peer"]
