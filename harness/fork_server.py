#!/usr/bin/env python
"""A fork server ("zygote") for daemons: bench_swarm.py --fork-server, and the tests'
daemons (tests/conftest.py, through `ForkLauncher` and apps/localnet.set_launcher).

    python harness/fork_server.py REQUEST_FD REPLY_FD [MODULE ...]   # by ForkServer, not by hand

Each `seedflood peer` process imports torch, transformers and hivemind (~7 s of CPU,
~290 MiB) before it does anything of its own, and ~1,350 more modules (the model, tokenizer
and data code, accelerate, sympy, ...) when it joins. Here one process imports what the
peer command imports at module level (seedflood.cli, then `peer.command`, which pulls in
the daemon, torch, transformers, hivemind, ...) and the modules of PRELOAD (what a tiny-llama
peer imports later), runs no torch op and starts no thread, then forks one child per daemon
on request. A child shares the imported pages with the zygote and its siblings
(copy-on-write) until it writes them.

The child then becomes what `python -m seedflood --log-format json peer ...` started by
apps/localnet.NodeProcess would be: the environment replaced by the request's (the
bench's: OMP_NUM_THREADS, TOKENIZERS_PARALLELISM), the request's working directory,
stdout and stderr appended to the daemon's log file, stdin inherited (the bench's, as
subprocess.Popen leaves it), sys.argv as `python -m seedflood` sets it, signal handlers and
mask as a fresh interpreter has them, Python's and numpy's global random generators
reseeded from os.urandom, garbage collection on, and seedflood.cli.main called; its return
value (or SystemExit) is the exit status. The child ends as an interpreter exit begins
(non-daemon threads joined, atexit handlers run, stdio flushed), then os._exit: the
teardown of every module, which would copy every shared page, is skipped. Each child
starts its own p2pd and opens its own ledger, as any daemon; its PID is a real daemon's:
SIGTERM/SIGINT stop it, /proc reads it.

Fork safety: the zygote refuses to fork (and exits with an error line) if it has more than
one thread (threading.active_count() and /proc/self/task). OMP_NUM_THREADS is in the
zygote's environment before torch loads (libgomp reads it when it loads), so every daemon
of one bench row must ask for the same value (--threads). Garbage collection is off in the
zygote and everything it imported is frozen (gc.freeze) before each fork, so a child's
collections do not write to the shared pages. What stays shared and differs from separate
processes: the hash seed of str (PYTHONHASHSEED: one per zygote, not per daemon) and
torch's default generator (its fixed default seed, as in every fresh process).

A request may name another entry point than `seedflood.cli:main` ("main": "MODULE:FUNC",
one of MAINS: harness/hooked_peer.py's misbehaving peer), called with sys.argv[1:] as
the program would be.

Protocol (JSON lines): requests `{"op": "spawn", "id", "argv", "env", "cwd", "log", "main"}` on
REQUEST_FD; replies on REPLY_FD: `{"op": "ready", "pid", "import_s", "threads",
"modules"}` once, `{"op": "spawned", "id", "pid"}` or `{"op": "error", "id", "error"}` per
request, and `{"op": "exit", "pid", "code"}` when a child is reaped (code as
subprocess.Popen.returncode: -N for signal N). EOF on REQUEST_FD: the zygote reaps its
remaining children as they end, then exits.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
# What `python -m seedflood` puts in sys.argv[0].
SEEDFLOOD_MAIN = str(ROOT / "seedflood" / "__main__.py")
HOOKED_PEER = str(ROOT / "harness" / "hooked_peer.py")
# The entry points a child may run, by "MODULE:FUNC", with what its program puts in
# sys.argv[0]: the `seedflood` command, and the tests' misbehaving peer.
MAINS = {"seedflood.cli:main": SEEDFLOOD_MAIN, "harness.hooked_peer:main": HOOKED_PEER}
DEFAULT_MAIN = "seedflood.cli:main"
# Modules a tiny-llama peer imports only once it joins (the model, tokenizer, data and
# trainer code, and what transformers pulls in to build a Llama: accelerate, sympy through
# torch's dynamo, ...): 1,347 modules after `peer.command` in a measured daemon. Imported
# in the zygote too (import only: no torch op), so the forked daemons share them instead
# of each importing them into its own memory. Any that fails to import is skipped (named
# in the ready reply).
PRELOAD = (
    "seedflood_p2p.workload.models",
    "seedflood_p2p.workload.data",
    "seedflood_p2p.workload.tasks",
    "seedflood_p2p.workload.batching",
    "seedflood_p2p.algorithm.trainer",
    "tokenizers",
    "transformers.tokenization_utils_fast",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "accelerate",
    "hivemind.utils.multiaddr.codecs.cid",
    "hivemind.utils.multiaddr.codecs.ip4",
    "hivemind.utils.multiaddr.codecs.uint16be",
    "numpy.ma",
    "numpy.ctypeslib",
    "_strptime",
    "bootstrap.command",  # the bootstrap node's command (the tests fork those too)
    "harness.hooked_peer",  # the tests' misbehaving peer (MAINS)
)


# --------------------------------------------------------------------------------------
# Pure parts (tests/test_bench_swarm.py)
# --------------------------------------------------------------------------------------
def encode(msg: dict) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def decode_lines(buffer: bytes) -> tuple[list[dict], bytes]:
    """Complete JSON lines of `buffer` and the incomplete rest."""
    *lines, rest = buffer.split(b"\n")
    return [json.loads(line) for line in lines if line.strip()], rest


def exit_code(status: int) -> int:
    """A waitpid status as subprocess.Popen.returncode: the exit status, or -N for signal N."""
    return os.waitstatus_to_exitcode(status)


def daemon_argv(args: list[str], main: str = DEFAULT_MAIN) -> list[str]:
    """sys.argv of `python -m seedflood --log-format json ARGS` (apps/localnet.NodeProcess),
    or of the program behind another entry point of MAINS."""
    return [MAINS[main], "--log-format", "json", *args]


def smaps_rollup(text: str) -> dict[str, int]:
    """kB figures of /proc/PID/smaps_rollup: Rss, Pss, and USS (Private_Clean +
    Private_Dirty, the pages no other process maps)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0])
    return {
        "rss_kb": out.get("Rss", 0),
        "pss_kb": out.get("Pss", 0),
        "uss_kb": out.get("Private_Clean", 0) + out.get("Private_Dirty", 0),
    }


def threads_here() -> int:
    """Threads of this process, as the kernel sees them (a library's native threads too)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


# --------------------------------------------------------------------------------------
# The zygote
# --------------------------------------------------------------------------------------
def _write(fd: int, msg: dict) -> None:
    data = encode(msg)
    while data:
        data = data[os.write(fd, data) :]


def _import_daemon(preload: list[str]) -> dict:
    """Import what `seedflood peer` imports before its first line of work: the cli module
    (it sets OMP_WAIT_POLICY before torch loads) and the peer command's module; then the
    `preload` modules (PRELOAD: what the daemon imports later, when it joins)."""
    import importlib

    t0, cpu0 = time.monotonic(), time.process_time()
    import seedflood.cli as cli

    cli.COMMANDS["peer"].load()  # `from peer import command`: torch, transformers, hivemind
    command_modules = len(sys.modules)
    failed = {}
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = repr(exc)[:200]
    return {
        "import_s": round(time.monotonic() - t0, 2),
        "import_cpu_s": round(time.process_time() - cpu0, 2),
        "modules_command": command_modules,
        "modules": len(sys.modules),
        "preload": list(preload),
        "preload_failed": failed,
    }


def _child(req: dict, close_fds: tuple[int, ...]) -> int:
    """In the forked child: become the daemon, run it, return its exit status."""
    for fd in close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    # Signals as a fresh interpreter has them (the zygote ignores SIGINT).
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    gc.enable()
    if req.get("netns"):
        _enter_netns(req["netns"])
    if req.get("nice"):
        os.nice(req["nice"])
    if req.get("cpus"):  # as `taskset -c`: every thread it starts later (p2pd too) inherits
        os.sched_setaffinity(0, req["cpus"])
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # Random state: Python's `random` reseeds itself after a fork (os.register_at_fork);
    # numpy's global generator does not.
    import random

    random.seed(os.urandom(32))
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(int.from_bytes(os.urandom(4), "little"))
    sys.argv = list(req["argv"])
    module, _, func = req.get("main", DEFAULT_MAIN).partition(":")
    main = getattr(__import__(module, fromlist=[func]), func)

    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    return _exit(code)


def _enter_netns(name: str) -> None:
    """Join network namespace NAME (/run/netns/NAME, as `ip netns add` made it): what
    `ip netns exec` does for a daemon, which reads no /sys or /etc/netns files. The child
    has one thread here, and its p2pd, started later, inherits the namespace."""
    import ctypes

    clone_newnet = 0x40000000
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _exit(code: int) -> int:
    """End the child as Py_FinalizeEx begins (non-daemon threads joined, atexit handlers
    run, stdio flushed), then os._exit: the interpreter's teardown (every module's objects
    released) would write to all the pages the child shares with the zygote and its
    siblings, copying them all at once when the swarm stops."""
    with contextlib.suppress(Exception):
        threading._shutdown()  # what the interpreter does first at exit
    import atexit

    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def serve(req_fd: int, rep_fd: int, preload: list[str] = ()) -> int:
    """The zygote's life; in a forked child, that child's exit status."""
    sys.path[0] = os.getcwd()  # as `python -m seedflood` has it (not this file's folder)
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))  # harness.hooked_peer (MAINS), after what cwd provides
    gc.disable()  # no collection moves or writes the imported objects before the forks
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C to the group: the daemons stop, not this
    info = _import_daemon(list(preload))
    threads = threads_here()
    ready = {"op": "ready", "pid": os.getpid(), "threads": threads, **info}
    if threads != 1 or threading.active_count() != 1:
        _write(rep_fd, {**ready, "op": "fatal", "error": f"{threads} threads before fork"})
        return 3
    _write(rep_fd, ready)
    children: set[int] = set()
    buffer, open_ = b"", True
    while open_ or children:
        if open_:
            readable, _, _ = select.select([req_fd], [], [], 0.2)
        else:
            readable = []
            time.sleep(0.2)
        while children:  # reap
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            _write(rep_fd, {"op": "exit", "pid": pid, "code": exit_code(status)})
        if not readable:
            continue
        chunk = os.read(req_fd, 65536)
        if not chunk:
            open_ = False
            continue
        requests, buffer = decode_lines(buffer + chunk)
        for req in requests:
            if req.get("op") != "spawn":
                continue
            if req.get("main", DEFAULT_MAIN) not in MAINS:
                _write(rep_fd, {"op": "error", "id": req.get("id"), "error": "unknown main"})
                continue
            try:
                if threads_here() != 1:
                    raise RuntimeError(f"{threads_here()} threads in the zygote: no fork")
                sys.stdout.flush()
                sys.stderr.flush()
                gc.freeze()
                pid = os.fork()
            except Exception as exc:
                _write(rep_fd, {"op": "error", "id": req.get("id"), "error": repr(exc)})
                continue
            if pid == 0:
                return _child(req, (req_fd, rep_fd))
            children.add(pid)
            _write(rep_fd, {"op": "spawned", "id": req.get("id"), "pid": pid})
    return 0


# --------------------------------------------------------------------------------------
# The bench's side: start the zygote, ask it for daemons
# --------------------------------------------------------------------------------------
class ForkedProc:
    """A forked daemon, as much of subprocess.Popen as the benches use: pid, poll, wait,
    send_signal, terminate, kill, returncode. Its exit status comes from the zygote (its
    parent); if the zygote is gone, a PID no longer in /proc counts as exited (code -1)."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self.server.exits.get(self.pid)
            if code is not None:
                self.returncode = code
            elif not self.server.alive and not _running(self.pid):
                self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether PID runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class ForkServer:
    """Start the zygote (python harness/fork_server.py) with `env` (the daemons' environment:
    OMP_NUM_THREADS must be in it before torch loads), its own output to `log`; spawn()
    forks a daemon. A reader thread takes the zygote's replies."""

    def __init__(
        self,
        log: Path,
        env: dict[str, str],
        preload: tuple[str, ...] = PRELOAD,
        ready_timeout: float = 600,
    ) -> None:
        self.t0 = time.monotonic()
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.log = open(log, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), str(req_r), str(rep_w), *preload],
            pass_fds=(req_r, rep_w),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        os.close(req_r)
        os.close(rep_w)
        self.exits: dict[int, int] = {}
        self.replies: dict[Any, dict] = {}
        self.info: dict = {}
        self.cond = threading.Condition()
        self.next_id = 0
        self.reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
        self.reader.start()
        with self.cond:
            self.cond.wait_for(lambda: self.info or not self.alive, ready_timeout)
        if self.info.get("op") != "ready":
            self.close()
            raise RuntimeError(f"fork server did not start: {self.info or 'no reply'}")
        self.info["ready_s"] = round(time.monotonic() - self.t0, 2)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self.rep_r, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                with self.cond:
                    self.cond.notify_all()
                return
            msgs, buffer = decode_lines(buffer + chunk)
            with self.cond:
                for m in msgs:
                    if m.get("op") == "exit":
                        self.exits[m["pid"]] = m["code"]
                    elif m.get("op") in ("ready", "fatal"):
                        self.info = m
                    else:
                        self.replies[m.get("id")] = m
                self.cond.notify_all()

    def spawn(
        self,
        args: list[str],
        env: dict[str, str],
        log: Path,
        cwd: str | None = None,
        main: str = DEFAULT_MAIN,
        netns: str = "",
        nice: int = 0,
        cpus: list[int] | None = None,
    ) -> ForkedProc:
        """Fork `seedflood --log-format json ARGS`, or the program of `main` (MAINS), with
        stdout and stderr appended to `log`; in network namespace `netns` if one is named
        (what `ip netns exec NETNS` does for a daemon: join its network namespace), at
        niceness `nice` more than the zygote's (as `nice -n NICE`), on the CPUs `cpus` if
        given (as `taskset -c CPUS`)."""
        with self.cond:
            self.next_id += 1
            rid = self.next_id
        argv = daemon_argv(args, main)
        req = {"op": "spawn", "id": rid, "argv": argv, "env": env, "main": main}
        req.update(netns=netns, nice=nice, cpus=cpus)
        req.update(cwd=cwd or os.getcwd(), log=str(log))
        _write(self.req_w, req)
        with self.cond:
            self.cond.wait_for(lambda: rid in self.replies or not self.alive, 120)
            reply = self.replies.pop(rid, None)
        if not reply or reply.get("op") != "spawned":
            raise RuntimeError(f"fork server: no daemon for {args[:1]}: {reply}")
        return ForkedProc(self, reply["pid"], argv)

    def close(self, timeout: float = 120) -> None:
        """No more requests: the zygote exits once its children have (they are stopped by
        the caller first); SIGTERM, then SIGKILL, if it does not."""
        with contextlib.suppress(OSError):
            os.close(self.req_w)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(5)
        with contextlib.suppress(OSError):
            os.close(self.rep_r)
        self.log.close()


def parse_cpu_list(text: str) -> list[int]:
    """The CPUs of a `taskset -c` list ("0", "0,2", "1-3"); [] if it is not one."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return []
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


class ForkLauncher:
    """A launcher for apps/localnet.set_launcher (tests/conftest.py sets one for the whole
    session): a `seedflood` or harness/hooked_peer.py command line (`python -m seedflood
    --log-format json ARGS`) is forked from one zygote, started on the first such command
    with that command's environment; the daemon that comes out is the same program with
    the same argv, environment, cwd and log file, minus the ~7 s of CPU its imports take.
    A command in `ip netns exec NS` is forked into namespace NS, one under `nice -n N` at
    that niceness, one under `taskset -c CPUS` on those CPUs. Anything else it returns
    None for, and NodeProcess starts that as a subprocess: another program or prefix, or
    another OMP_NUM_THREADS than the zygote's (libgomp reads it once, as it loads). If the zygote
    cannot start, every command goes to subprocess, with one line on stderr."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.server: ForkServer | None = None
        self.threads: str | None = None
        self.broken = False
        self.forked = 0

    def main_of(self, cmd: list[str]) -> tuple[str, list[str], str, int, list[int]] | None:
        """(entry point, ARGS, network namespace or "", niceness, CPUs or []) of
        `[taskset -c CPUS] [nice -n N] [ip netns exec NS] PROGRAM --log-format json ARGS`;
        None for any other."""
        netns, nice, cpus = "", 0, []
        if cmd[:2] == ["taskset", "-c"] and len(cmd) > 2:
            cpus = parse_cpu_list(cmd[2])
            if not cpus:
                return None
            cmd = cmd[3:]
        if cmd[:2] == ["nice", "-n"] and len(cmd) > 2 and cmd[2].lstrip("-").isdigit():
            nice, cmd = int(cmd[2]), cmd[3:]
        if cmd[:3] == ["ip", "netns", "exec"] and len(cmd) > 3:
            netns, cmd = cmd[3], cmd[4:]
        if cmd[:3] == [sys.executable, "-m", "seedflood"]:
            main, rest = DEFAULT_MAIN, cmd[3:]
        elif len(cmd) > 1 and cmd[0] == sys.executable and _same_file(cmd[1], HOOKED_PEER):
            main, rest = "harness.hooked_peer:main", cmd[2:]
        else:
            return None
        if rest[:2] != ["--log-format", "json"]:
            return None
        return main, rest[2:], netns, nice, cpus

    def __call__(self, cmd: list[str], env: dict[str, str], log: Path) -> ForkedProc | None:
        found = None if self.broken else self.main_of(cmd)
        if found is None:
            return None
        if self.server is None:
            try:
                self.server = ForkServer(self.log, env)
            except (OSError, RuntimeError) as exc:
                self.broken = True
                print(f"fork server: {exc}; daemons start as subprocesses", file=sys.stderr)
                return None
            self.threads = env.get("OMP_NUM_THREADS")
        if env.get("OMP_NUM_THREADS") != self.threads or not self.server.alive:
            return None
        main, args, netns, nice, cpus = found
        self.forked += 1
        return self.server.spawn(args, env, log, main=main, netns=netns, nice=nice, cpus=cpus)

    def close(self) -> None:
        if self.server is not None:
            self.server.close(timeout=30)


def _same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
