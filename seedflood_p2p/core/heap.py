"""The daemons' startup heap, kept out of the cyclic garbage collector's passes.

A daemon imports torch, transformers and hivemind and loads its model before it serves:
some 400,000 objects that live as long as the process. CPython's collector walks every
tracked object of a generation each time it collects it, and rows arriving by the
thousand (a joiner's repair pages, a flood of gossip) trigger collections all along.
Decoding repair pages beside that heap took 9.56 us a row, 3.92 with it frozen
(bench/results/gc-freeze.md); a daemon flooded with 4,000 updates a second spent the same
CPU either way, but each full collection paused its event loop: the p99 time from arrival
to ledger fell from 134-180 ms to 35-38 ms (bench/results/ingest-gc-*.md). `gc.freeze`
moves what exists into a permanent generation the collector never walks; what is
allocated later is collected as before.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("seedflood.heap")


def freeze_startup_heap() -> int:
    """Collect once (startup's garbage goes now), then freeze everything left. Call it
    once the daemon has loaded everything it keeps, before it serves. Returns how many
    objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d startup objects out of the garbage collector's passes", frozen)
    return frozen
