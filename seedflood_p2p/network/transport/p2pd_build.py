"""Our build of p2pd: hivemind's bundled daemon, unpacked and patched where it has no flag.

The bundled p2pd (learning-at-home/go-libp2p-daemon v0.5.0.hivemind1, go-libp2p 0.32.1,
go-libp2p-pubsub 0.10.0, Go 1.20.11, UPX 4.02) exposes only GossipSub's heartbeat. What a
run of many peers needs set lives in constants and package variables, and one line of its
main starts a second, unmetered relay (the known defect in docs/ROADMAP.md). There is no Go
toolchain or module proxy to rebuild it here or on a volunteer's machine, so this module
makes the build from the binary itself, once per machine and setting:

    unpack   the file is UPX-packed: run it under ptrace to its Go entry point (a hardware
             breakpoint; the stub has then written the whole image) and read the image
             back; its own ELF headers, in the image, give the original file's layout
    patch    at addresses found in the binary's function table (pclntab) and disassembly,
             each checked against the bytes expected there before it is written
    cache    `$SEEDFLOOD_CACHE/p2pd/<source>-<patches>/p2pd` (default ~/.cache/seedflood),
             written to a temporary name and renamed

The patches (`MeshSettings`; every address is for the one known build, `KNOWN_SHA256`):

    relay          `if c.Relay.Enabled { d.EnableRelayV2() }` in main.main jumps over the
                   call: the relay service is the configured, metered one, or none
    degree         GossipSub D, with Dlo = D - 1, Dhi = 2D, Dlazy = D, Dscore = 2D/3 and
                   Dout = D/3 (the spec's ratios at D = 6)
    history        mcache windows kept (HistoryLength) and gossiped (HistoryGossip)
    gossip_factor  the share of a node's non-mesh topic peers each heartbeat's IHAVE goes
                   to, at least Dlazy of them (GossipFactor)
    seen_ttl       how long a message id stays seen (TimeCacheDuration)
    queues         validation queue, subscription buffer, inbound RPC queue, outbound queue
                   per peer: each drops a message when full (the validation queue and the
                   subscription buffer on a burst the Python side was slow to take)

Anything unexpected (another p2pd, no ptrace, bytes not as expected) raises BuildError; the
caller then runs the bundled binary as it is and says so once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

KNOWN_SHA256 = "42f8f48e62583b97cdba3c31439c08029fb2b9fc506b5bdd82c46b7cc1d279d8"
ENTRY = 0x471360  # _rt0_amd64_linux
IMAGE = (0x400000, 0x1FCB000)  # the unpacked image: text, rodata, data and bss
UNPACK_SECONDS = 20.0


class BuildError(Exception):
    """Our build could not be made; the bundled binary runs instead."""


@dataclass(frozen=True)
class MeshSettings:
    """What our build sets: GossipSub's defaults, but the queues (GossipSub's 32 dropped
    1% of a daemon's updates at 2,000/s and 4% at 4,000/s, 4096 none: bench/results/
    ingest-queues-*.md), the degree and the gossip factor (D = 6 and 0.25 made each
    message cost each node 9.5 KB received and 1.3 ms of p2pd CPU at N = 192, 4 and 0
    made it 2.4 KB and 0.7 ms, every message delivered under 5% loss: bench/results/
    mesh*.md), and the relay fix."""

    degree: int = 4
    history: int = 5
    history_gossip: int = 3
    gossip_factor: float = 0.0
    seen_ttl: float = 120.0
    validation_queue: int = 4096
    subscription_buffer: int = 4096
    inbound_queue: int = 4096
    outbound_queue: int = 4096

    def check(self) -> None:
        """GossipSub's own checks (GossipSubParams.validate), as one readable line."""
        if not 3 <= self.degree <= 1000:
            raise ValueError(f"gossip degree {self.degree} is outside 3..1000")
        if not 1 <= self.history_gossip <= self.history <= 1000:
            raise ValueError(
                f"gossip history {self.history} must be 1..1000 and at least the windows "
                f"gossiped ({self.history_gossip})"
            )
        if not 0.0 <= self.gossip_factor <= 1.0:
            raise ValueError(f"gossip factor {self.gossip_factor} is outside 0..1")
        if not 1.0 <= self.seen_ttl <= 86400.0:
            raise ValueError(f"seen-message TTL {self.seen_ttl} s is outside 1..86400 s")
        for name in ("validation_queue", "subscription_buffer", "inbound_queue", "outbound_queue"):
            if not 1 <= getattr(self, name) <= 1 << 20:
                raise ValueError(f"{name} {getattr(self, name)} is outside 1..{1 << 20}")


@dataclass(frozen=True)
class _Patch:
    name: str
    address: int
    expected: bytes  # the bytes there in the known build (checked first)
    value: bytes  # what is written, at address + len(expected) - len(value)


# the bundled binary's own settings: a build of these changes only the relay jump
GOSSIPSUB_DEFAULTS = MeshSettings(
    degree=6,
    gossip_factor=0.25,
    validation_queue=32,
    subscription_buffer=32,
    inbound_queue=32,
    outbound_queue=32,
)


def _i64(value: int) -> bytes:
    return struct.pack("<q", value)


def _imm32(value: int) -> bytes:
    return struct.pack("<I", value)


def patches(mesh: MeshSettings) -> list[_Patch]:
    """The byte patches for `mesh`, with the known build's bytes at each place."""
    d = mesh.degree
    gossip_vars = {  # GossipSub package variables read by DefaultGossipSubParams
        "GossipSubD": (0x1C68780, 6, d),
        "GossipSubDlo": (0x1C687A8, 5, d - 1),
        "GossipSubDhi": (0x1C68788, 12, 2 * d),
        "GossipSubDscore": (0x1C687B8, 4, max(1, 2 * d // 3)),
        "GossipSubDout": (0x1C687B0, 2, max(1, d // 3)),
        "GossipSubHistoryLength": (0x1C687F8, 5, mesh.history),
        "GossipSubHistoryGossip": (0x1C687F0, 3, mesh.history_gossip),
        "GossipSubDlazy": (0x1C687A0, 6, d),
        "TimeCacheDuration": (0x1C68848, 120 * 10**9, round(mesh.seen_ttl * 1e9)),
    }
    out = [
        _Patch(name, address, _i64(old), _i64(new))
        for name, (address, old, new) in gossip_vars.items()
    ]
    out.append(  # a float64, between GossipSubFanoutTTL and GossipSubGossipRetransmission
        _Patch(
            "GossipSubGossipFactor",
            0x1C687C8,
            struct.pack("<d", 0.25),
            struct.pack("<d", mesh.gossip_factor),
        )
    )
    # `mov $32, %ebx` before runtime.makechan (the channel's size), and the field store
    # `movq $32, 0x50(%rdi)` of peerOutboundQueueSize, in NewPubSub / (*Topic).Subscribe
    mov32 = b"\xbb" + _imm32(32)
    out += [
        _Patch("validateQ (newValidation)", 0xE68FFE, mov32, _imm32(mesh.validation_queue)),
        _Patch("incoming (NewPubSub)", 0xE690E2, mov32, _imm32(mesh.inbound_queue)),
        _Patch("sub.ch ((*Topic).Subscribe)", 0xE79325, mov32, _imm32(mesh.subscription_buffer)),
        _Patch(
            "peerOutboundQueueSize (NewPubSub)",
            0xE694F8,
            b"\x48\xc7\x47\x50" + _imm32(32),
            _imm32(mesh.outbound_queue),
        ),
        # cmpb $0, 0xb0(%rdx) (c.Relay.Enabled); je over EnableRelayV2 -> jmp
        _Patch("EnableRelayV2 (main.main)", 0xECE443, bytes.fromhex("80bab00000000074"), b"\xeb"),
    ]
    return out


def patch_image(image: bytearray, base: int, mesh: MeshSettings) -> None:
    """Apply `patches(mesh)` to the memory `image` that starts at `base`, in place."""
    for p in patches(mesh):
        at = p.address - base
        if image[at : at + len(p.expected)] != p.expected:
            raise BuildError(
                f"p2pd at {p.address:#x} ({p.name}) holds "
                f"{bytes(image[at : at + len(p.expected)]).hex()}, not {p.expected.hex()}"
            )
        end = at + len(p.expected)
        image[end - len(p.value) : end] = p.value


# -- unpack -------------------------------------------------------------------------------
_PTRACE_TRACEME, _PTRACE_POKEUSER, _PTRACE_CONT = 0, 6, 7
_DEBUGREG = 848  # offsetof(struct user, u_debugreg) on x86_64 Linux


def _ptrace(libc, request: int, pid: int, addr: int, data: int) -> None:
    ctypes.set_errno(0)
    if libc.ptrace(request, pid, ctypes.c_void_p(addr), ctypes.c_void_p(data)) == -1:
        err = ctypes.get_errno()
        if err:
            raise BuildError(f"ptrace({request}) on the unpacking p2pd: {os.strerror(err)}")


def unpacked_image(binary: Path) -> bytes:
    """The memory image of `binary` at its entry point: run it under ptrace, stop it there
    with a hardware breakpoint (the UPX stub has written the image by then), read it."""
    if os.uname().machine != "x86_64":
        raise BuildError(f"our p2pd build is for x86_64, not {os.uname().machine}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    pid = os.fork()
    if pid == 0:  # the child: traced from exec on; it never gets past the entry point
        try:
            libc.ptrace(_PTRACE_TRACEME, 0, None, None)
            os.execv(str(binary), [str(binary), "-h"])
        finally:
            os._exit(127)
    try:
        _wait_stop(pid, "exec")
        _ptrace(libc, _PTRACE_POKEUSER, pid, _DEBUGREG, ENTRY)  # DR0: the entry point
        _ptrace(libc, _PTRACE_POKEUSER, pid, _DEBUGREG + 7 * 8, 1)  # DR7: DR0 on, execute
        _ptrace(libc, _PTRACE_CONT, pid, 0, 0)
        _wait_stop(pid, "the entry point")
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.seek(IMAGE[0])
            image = mem.read(IMAGE[1] - IMAGE[0])
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if len(image) != IMAGE[1] - IMAGE[0] or image[:4] != b"\x7fELF":
        raise BuildError("the unpacked p2pd image is not an ELF image")
    return image


def _wait_stop(pid: int, where: str) -> None:
    deadline = time.monotonic() + UNPACK_SECONDS
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGTRAP:
                return
            raise BuildError(f"the unpacking p2pd did not stop at {where} (status {status:#x})")
        time.sleep(0.005)
    raise BuildError(f"the unpacking p2pd did not reach {where} in {UNPACK_SECONDS:.0f} s")


def _loads(elf: bytes) -> list[tuple[int, int, int]]:
    """(file offset, address, size in the file) of each PT_LOAD segment in `elf`'s headers."""
    phoff, phnum = struct.unpack_from("<Q", elf, 32)[0], struct.unpack_from("<H", elf, 56)[0]
    headers = [struct.unpack_from("<IIQQQQQQ", elf, phoff + 56 * i) for i in range(phnum)]
    return [(h[2], h[3], h[5]) for h in headers if h[0] == 1]


def elf_from_image(image: bytes, base: int) -> bytes:
    """The executable file the image was loaded from: its PT_LOAD segments at their file
    offsets, from the ELF headers in the image's first page. No section headers: they lay
    past the loaded segments (nothing runs from them)."""
    loads = _loads(image)
    out = bytearray(max(offset + filesz for offset, _, filesz in loads))
    for offset, vaddr, filesz in loads:
        at = vaddr - base
        if at < 0 or at + filesz > len(image):
            raise BuildError("a p2pd segment lies outside its unpacked image")
        out[offset : offset + filesz] = image[at : at + filesz]
    struct.pack_into("<Q", out, 40, 0)  # e_shoff
    struct.pack_into("<HHH", out, 58, 0, 0, 0)  # e_shentsize, e_shnum, e_shstrndx
    return bytes(out)


def file_offset(elf: bytes, vaddr: int) -> int:
    """Where the byte loaded at `vaddr` lies in the executable `elf`."""
    for offset, start, filesz in _loads(elf):
        if start <= vaddr < start + filesz:
            return offset + vaddr - start
    raise ValueError(f"{vaddr:#x} is not in a loaded part of the file")


# -- the build ----------------------------------------------------------------------------
def cache_dir() -> Path:
    """`$SEEDFLOOD_CACHE/p2pd`, or `~/.cache/seedflood/p2pd` (the assets' cache root)."""
    env = os.environ.get("SEEDFLOOD_CACHE")
    try:
        root = Path(env).expanduser() if env else Path.home() / ".cache" / "seedflood"
    except RuntimeError as exc:  # no HOME and no passwd entry
        raise BuildError(f"no cache directory for our build ({exc}): set SEEDFLOOD_CACHE") from None
    return root / "p2pd"


def build(bundled: Path, mesh: MeshSettings, cache: Path | None = None) -> Path:
    """Our p2pd for `mesh`, built from `bundled` (hivemind's) once and cached."""
    mesh.check()
    source = hashlib.sha256(bundled.read_bytes()).hexdigest()
    if source != KNOWN_SHA256:
        raise BuildError(
            f"{bundled} is not the p2pd this build knows (sha256 {source[:16]}..., expected "
            f"{KNOWN_SHA256[:16]}...: another hivemind release)"
        )
    settings = hashlib.sha256(repr(sorted(asdict(mesh).items())).encode()).hexdigest()
    # named p2pd, in a folder of its own per build: tools find the daemon by that name
    path = (cache or cache_dir()) / f"{source[:12]}-{settings[:12]}" / "p2pd"
    if path.exists():
        return path
    image = bytearray(_unpack_in_child(bundled))
    patch_image(image, IMAGE[0], mesh)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    part.write_bytes(elf_from_image(image, IMAGE[0]))
    part.chmod(0o755)
    os.replace(part, path)
    return path


def _unpack_in_child(bundled: Path) -> bytes:
    """`unpacked_image` in a fresh interpreter: forking the (threaded) daemon to trace the
    p2pd child is not safe, so a small process of our own does it."""
    with tempfile.TemporaryDirectory(prefix="seedflood-p2pd-") as work:
        out = Path(work) / "image"
        try:
            done = subprocess.run(
                [sys.executable, "-m", __name__, str(bundled), str(out)],
                capture_output=True,
                text=True,
                timeout=3 * UNPACK_SECONDS,
            )
        except subprocess.TimeoutExpired:
            raise BuildError(f"unpacking p2pd took over {3 * UNPACK_SECONDS:.0f} s") from None
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            raise BuildError(f"unpacking p2pd failed: {why}")
        return out.read_bytes()


if __name__ == "__main__":  # python -m ...p2pd_build BUNDLED OUT: write the unpacked image
    try:
        Path(sys.argv[2]).write_bytes(unpacked_image(Path(sys.argv[1])))
    except BuildError as exc:
        sys.exit(f"error: {exc}")
