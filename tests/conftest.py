import os
import sys
from pathlib import Path

import pytest

from seedflood_p2p.network.transport.p2pd import create_p2p

sys.path.insert(0, str(Path(__file__).parent))  # the harness/ package

LOCAL = "/ip4/127.0.0.1/tcp/0"

# Two workers on two cores (pyproject's addopts): torch's default of a thread per core in
# each would run four threads on two cores, and a test of a thousand forward passes took
# 116 s instead of 9. Each worker, and what it starts, gets its share of the cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    import torch

    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def forked_daemons(tmp_path_factory):
    """The tests' `seedflood` daemons (apps/localnet.NodeProcess) are forked from one
    process that imported torch, transformers and hivemind once (harness/fork_server.py),
    not each started as a new interpreter: the same program, argv, environment and log,
    ~7 s of CPU less each. SEEDFLOOD_TEST_SUBPROCESS=1 starts each as its own interpreter,
    as a volunteer's machine does."""
    if os.environ.get("SEEDFLOOD_TEST_SUBPROCESS") == "1":
        yield None
        return
    from harness.fork_server import ForkLauncher
    from seedflood_p2p.apps import localnet

    launcher = ForkLauncher(tmp_path_factory.mktemp("fork-server") / "zygote.log")
    localnet.set_launcher(launcher)
    try:
        yield launcher
    finally:
        localnet.set_launcher(None)
        launcher.close()


@pytest.fixture
def one_thread():
    """torch on one thread for the test: the tiny model runs fastest so on these machines."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
async def spawn():
    """Start daemons with `await spawn(...)`; all of them are shut down after the test."""
    started = []

    async def _spawn(**kwargs):
        kwargs.setdefault("identity_path", None)
        kwargs.setdefault("host_maddrs", [LOCAL])
        kwargs.setdefault("heartbeat_interval", 0.2)
        p2p = await create_p2p(**kwargs)
        started.append(p2p)
        return p2p

    try:
        yield _spawn
    finally:
        for p2p in started:
            await p2p.shutdown()
        for p2p in started:
            assert p2p._child.returncode is not None  # the daemon process is gone


def pytest_collection_modifyitems(config, items):
    """The files marked slow run first, each file's tests kept in order: the suite runs on
    two workers (pyproject's addopts, `--dist loadfile`: a file's module-scoped clusters
    stay on one worker), and a long file handed out last would leave one worker running
    it alone. The order is deterministic, as xdist needs on every worker."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file order kept
