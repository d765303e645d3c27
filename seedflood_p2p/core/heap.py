"""The daemons' startup heap, kept out of the cyclic garbage collector's passes.

A daemon imports torch, transformers and hivemind and loads its model before it serves:
some 400,000 objects that live as long as the process. CPython's collector walks every
tracked object of a generation each time it collects it, and rows arriving by the
thousand (a joiner's repair pages, a flood of gossip) trigger collections all along: in
an allocation-heavy loop beside that heap, three quarters of the CPU went to walking it
(bench/results/gc-freeze.md). `gc.freeze` moves what exists into a permanent generation
the collector never walks; what is allocated later is collected as before.
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
