"""Real processes on 127.0.0.1 for integration tests: a bootstrap node and peer daemons."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class Proc:
    def __init__(self, name: str, args: list[str], workdir: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = workdir / f"{name}.log"
        self.log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "seedflood_p2p.cli", "--log-format", "json", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=ENV)

    def events(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    def last_round(self) -> int:
        rounds = [e["round"] for e in self.events() if e.get("event") == "round"]
        return max(rounds, default=-1)

    def wait_round(self, round_: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while self.last_round() < round_:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited early:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not reach round {round_}:\n{self.tail()}")
            time.sleep(0.2)

    def wait_exit(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit:\n{self.tail()}") from None

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def start_bootstrap(workdir: Path, extra: list[str] = ()) -> tuple[Proc, str]:
    data = workdir / "bootstrap"
    proc = Proc(
        "bootstrap",
        [
            "bootstrap",
            *RUN_FLAGS,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--data-dir",
            str(data),
            *extra,
        ],
        workdir,
    )
    deadline = time.monotonic() + 120
    while not (data / "address.txt").exists():
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"bootstrap did not start:\n{proc.tail()}")
        time.sleep(0.2)
    return proc, (data / "address.txt").read_text().split()[0]


def start_peer(
    workdir: Path, name: str, bootstrap: str, extra: list[str] = (), log_name: str = ""
) -> Proc:
    """A peer with data dir workdir/name, logging to workdir/(log_name or name).log."""
    return Proc(
        log_name or name,
        [
            "peer",
            "--bootstrap",
            bootstrap,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--data-dir",
            str(workdir / name),
            "--threads",
            "1",
            *extra,
        ],
        workdir,
    )
