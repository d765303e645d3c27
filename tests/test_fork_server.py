"""The tests' daemons are forks of one zygote (tests/conftest.py, harness/fork_server.py):
the same program with the same argv, environment and log as a new interpreter would run,
its exit status as a new interpreter's, and anything the zygote cannot stand in for
(another program or prefix, another OMP_NUM_THREADS) left to subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cluster import HOOKED_PEER
from harness.fork_server import DEFAULT_MAIN, ForkedProc, ForkLauncher
from seedflood_p2p.apps.localnet import NodeProcess

pytestmark = pytest.mark.skipif(
    os.environ.get("SEEDFLOOD_TEST_SUBPROCESS") == "1", reason="daemons run as subprocesses"
)


def test_a_forked_daemon_runs_the_same_command_as_a_new_interpreter(tmp_path):
    data = tmp_path / "peer"
    forked = NodeProcess("forked", ["id", "--data-dir", str(data)], tmp_path)
    assert isinstance(forked.proc, ForkedProc)
    assert forked.wait_exit(120) == 0
    forked.stop()
    # The identity the forked `seedflood id` made is the one a fresh interpreter reads back.
    fresh = subprocess.run(
        [sys.executable, "-m", "seedflood", "id", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fresh.returncode == 0, fresh.stderr
    peer_id = fresh.stdout.split()[-1]
    assert peer_id.startswith("12D3KooW")
    assert peer_id in forked.log_path.read_text()


def test_a_forked_daemon_exits_as_a_new_interpreter_would(tmp_path):
    bad = NodeProcess("bad", ["peer", "--no-such-flag"], tmp_path)
    assert isinstance(bad.proc, ForkedProc)
    assert bad.wait_exit(120) == 2  # argparse's usage error, as from a new interpreter
    assert "--no-such-flag" in bad.tail()
    bad.stop()
    hooked = NodeProcess("hooked", ["peer", "--help"], tmp_path, program=HOOKED_PEER)
    assert isinstance(hooked.proc, ForkedProc)
    assert hooked.wait_exit(120) == 0
    assert "--cheat" in hooked.log_path.read_text()  # harness/hooked_peer.py's own flags
    hooked.stop()


def test_the_launcher_leaves_what_it_cannot_fork_to_subprocess(tmp_path):
    launcher = ForkLauncher(tmp_path / "zygote.log")
    seedflood = [sys.executable, "-m", "seedflood", "--log-format", "json", "id"]
    assert launcher.main_of(seedflood) == (DEFAULT_MAIN, ["id"], "", 0, [])
    hooked = [*HOOKED_PEER, "--log-format", "json", "peer"]
    assert launcher.main_of(hooked) == ("harness.hooked_peer:main", ["peer"], "", 0, [])
    # In a host of a namespaced testnet: forked into its network namespace; under nice;
    # on some CPUs.
    assert launcher.main_of(["ip", "netns", "exec", "t-h1", *seedflood])[2:] == ("t-h1", 0, [])
    assert launcher.main_of(["nice", "-n", "10", *hooked])[2:] == ("", 10, [])
    pinned = ["taskset", "-c", "0,2-3", "nice", "-n", "19", *hooked]
    assert launcher.main_of(pinned)[2:] == ("", 19, [0, 2, 3])
    assert launcher.main_of(["taskset", "-c", "x", *hooked]) is None  # taskset's own error
    assert launcher.main_of(["sudo", *seedflood]) is None
    assert launcher.main_of([sys.executable, "-m", "seedflood", "id"]) is None  # text logs
    assert launcher.main_of(["/bin/true", "--log-format", "json"]) is None
    # Another thread count than the zygote's: not forked (libgomp read it once).
    launcher.server, launcher.threads = object(), "1"
    assert launcher(seedflood, {"OMP_NUM_THREADS": "2"}, tmp_path / "x.log") is None


def test_a_daemon_forked_under_taskset_runs_with_its_p2pd_on_those_cpus(tmp_path):
    # A peer whose bootstrap does not answer keeps retrying for ~15 s: time to look.
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
    args = ["peer", "--data-dir", str(tmp_path / "p"), "--bootstrap", dead]
    cpu = max(os.sched_getaffinity(0))
    node = NodeProcess("pinned", args, tmp_path, prefix=("taskset", "-c", str(cpu)))
    try:
        assert isinstance(node.proc, ForkedProc)
        pid = node.proc.pid
        deadline = time.monotonic() + 60
        kids: list[int] = []
        while not kids and time.monotonic() < deadline and node.alive:
            kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            time.sleep(0.2)
        assert kids, node.tail()  # its p2pd
        for p in [pid, *kids]:
            for tid in os.listdir(f"/proc/{p}/task"):  # every thread, started after the fork
                assert os.sched_getaffinity(int(tid)) == {cpu}
    finally:
        node.stop()
