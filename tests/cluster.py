"""Settings shared by the multi-process tests; processes come from seedflood_p2p.apps.localnet."""

from seedflood_p2p.apps.localnet import start_bootstrap as _start_bootstrap
from seedflood_p2p.apps.localnet import start_peer

RUN_FLAGS = [
    "--model",
    "tiny-llama",
    "--dataset",
    "synthetic-sentiment",
    "--rank",
    "4",
    "--refresh-period",
    "5",
    "--lr",
    "2e-3",
    "--n-ref",
    "4",
    "--batch-size",
    "8",
]


def start_bootstrap(workdir, extra=()):
    return _start_bootstrap(workdir, RUN_FLAGS, extra)


__all__ = ["RUN_FLAGS", "start_bootstrap", "start_peer"]
