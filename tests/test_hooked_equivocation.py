"""The equivocating hooked peer's twin (harness/hooked_peer.py `--equivocate`), without
daemons: the daemon test (tests/test_equivocation_daemon.py) relies on every peer
keeping the twin, whichever copy it saw first, so that must hold for every scalar an
honest peer can send (float16, clipped to |s| <= clip), as it is on the wire."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from harness.hooked_peer import parse_equivocation, twin
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.protocol.message import pack_scalars, unpack_scalars
from seedflood_p2p.protocol.update import keeps_new


def _wire(scalars: tuple[float, ...]) -> tuple[float, ...]:
    return unpack_scalars(pack_scalars(scalars))


def test_the_twin_wins_the_equivocation_rule_for_every_honest_float16_scalar():
    clip = RunConfig().clip
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)
    honest = [float(s) for s in every if np.isfinite(s) and abs(s) <= clip]
    assert len(honest) > 40_000  # both zeros among them
    for s in honest:
        first = _wire((s, 0.5))
        second = _wire(twin(first))
        assert keeps_new(first, second) and not keeps_new(second, first), s


def test_equivocate_flag():
    assert parse_equivocation("3") == (3, 0)
    assert parse_equivocation("3:5") == (3, 5)
    for bad in ("x", "-1", "3:-2", "3:y"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_equivocation(bad)
