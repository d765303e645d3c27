"""`freeze_startup_heap`: what exists when it is called leaves the collector's passes
(CPython's permanent generation); what is allocated later is collected as before."""

import gc

from seedflood_p2p.core.heap import freeze_startup_heap


def test_the_startup_heap_is_frozen_and_later_garbage_still_collected():
    before = [object()]  # a container the collector tracks
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is before for o in gc.get_objects())  # out of every generation

        after = [object()]
        assert any(o is after for o in gc.get_objects())
        cycle: list = []
        cycle.append(cycle)  # garbage only the cyclic collector frees
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()  # this test's process goes on with other tests
    assert any(o is before for o in gc.get_objects())
