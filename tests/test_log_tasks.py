"""`kill -USR1` on a peer daemon logs where each of its asyncio tasks waits."""

import asyncio
import logging

from peer.daemon import log_tasks


async def test_each_task_is_logged_with_its_await_chain(caplog):
    async def inner_wait():
        await asyncio.sleep(30)

    async def outer_wait():
        await inner_wait()

    task = asyncio.create_task(outer_wait(), name="stuck")
    await asyncio.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="seedflood.peer"):
        log_tasks()
    task.cancel()
    lines = {r.fields["task"]: r.fields["where"] for r in caplog.records if hasattr(r, "fields")}
    assert "outer_wait" in lines["stuck"] and "inner_wait" in lines["stuck"]
    assert lines["stuck"].index("outer_wait") < lines["stuck"].index("inner_wait")
