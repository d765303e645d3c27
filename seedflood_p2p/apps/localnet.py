"""A bootstrap node and peer daemons as real processes on this machine (demo and tests).

Each process is the `seedflood` command (`python -m seedflood`, the installed package of
seedflood/cli.py: a program run, not an import), or another program given as `program`.
It logs JSON lines to WORKDIR/NAME.log, which `NodeProcess.events()` reads back, so
callers follow progress without any side channel.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.flags import to_toml

# How a NodeProcess starts its command line: launcher(cmd, env, log_path) returns a
# process (pid, poll, wait, send_signal, kill, as subprocess.Popen's) that writes to the
# log, or None to leave it to subprocess.Popen. The product sets none; the tests set one
# for their whole session (harness/fork_server.ForkLauncher: daemons forked from a process
# that has imported the stack once).
Launcher = Callable[[list[str], dict[str, str], Path], Any]
_launcher: Launcher | None = None


def set_launcher(launcher: Launcher | None) -> None:
    """Start every later NodeProcess through `launcher` (None: subprocess.Popen)."""
    global _launcher
    _launcher = launcher


class NodeProcess:
    def __init__(
        self,
        name: str,
        args: list[str],
        workdir: Path,
        threads: int = 1,
        prefix: tuple[str, ...] = (),
        program: Sequence[str] = (),
    ) -> None:
        """Run `seedflood ARGS`, or `PROGRAM ARGS` (a command line taking the same
        arguments); `prefix` wraps the command (e.g. `ip netns exec HOST`)."""
        self.name = name
        self.args = args
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._offset = 0
        self._events: list[dict] = []
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        program = program or (sys.executable, "-m", "seedflood")
        cmd = [*prefix, *program, "--log-format", "json", *args]
        launched = _launcher(cmd, env, self.log_path) if _launcher is not None else None
        self.proc = launched or subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def events(self) -> list[dict]:
        """All JSON log records so far (read incrementally)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    self._events.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return self._events

    def last_round(self) -> int:
        rounds = [e["round"] for e in self.events() if e.get("event") == "round"]
        return max(rounds, default=-1)

    def wait_round(self, round_: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while self.last_round() < round_:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited early:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not reach round {round_}:\n{self.tail()}")
            time.sleep(0.2)

    def wait_exit(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.name} did not exit:\n{self.tail()}") from None

    def freeze(self, seconds: float) -> None:
        """Stop the process and its children (its p2pd) for `seconds`, SIGSTOP then
        SIGCONT: a volunteer's laptop that sleeps. Blocks for `seconds`."""
        pid = self.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids = [pid, *(int(c) for c in children)]
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGCONT)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM (the daemon finishes its round and checkpoints), SIGKILL if it hangs."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_bootstrap(
    workdir: Path, run: RunConfig, extra: list[str] = (), timeout: float = 600
) -> tuple[NodeProcess, str]:
    """Start a bootstrap node of run `run` (handed over as WORKDIR/run.toml); returns it and
    its full multiaddr once it listens."""
    data = workdir / "bootstrap"
    run_file = workdir / "run.toml"
    run_file.write_text(to_toml(run))
    proc = NodeProcess(
        "bootstrap",
        [
            "bootstrap",
            "--config",
            str(run_file),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--data-dir",
            str(data),
            *extra,
        ],
        workdir,
    )
    deadline = time.monotonic() + timeout
    address = data / "address.txt"
    # The file can exist before its text is written (seen on a loaded machine): wait for it.
    while not (address.exists() and address.read_text().split()):
        if not proc.alive or time.monotonic() > deadline:
            tail = proc.tail()
            proc.stop()  # the caller never gets it to stop
            raise RuntimeError(f"the bootstrap node did not start:\n{tail}")
        time.sleep(0.2)
    return proc, address.read_text().split()[0]


def start_peer(
    workdir: Path,
    name: str,
    bootstrap: str,
    extra: list[str] = (),
    log_name: str = "",
    threads: int = 1,
    program: Sequence[str] = (),
) -> NodeProcess:
    """A peer with data dir WORKDIR/NAME, logging to WORKDIR/(LOG_NAME or NAME).log;
    `program`: instead of the `seedflood` command (NodeProcess)."""
    args = [
        "peer",
        "--bootstrap",
        bootstrap,
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--data-dir",
        str(workdir / name),
        "--threads",
        str(threads),
        *extra,
    ]
    return NodeProcess(log_name or name, args, workdir, threads, program=program)
