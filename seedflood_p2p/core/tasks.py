"""Fire-and-forget asyncio tasks, held until they finish.

The event loop keeps only weak references to its tasks. A task nobody holds, waiting on a
future that only its own coroutine holds, can be garbage-collected while pending ("Task was
destroyed but it is pending!"); its coroutine is then closed by the collector, on whichever
thread triggered the collection, and runs its cleanup there. With uvloop's transports in
that cleanup this is not safe: an honest daemon died with SIGSEGV right after that message,
for the task that disconnected a peer it had just banned. So every background task a
component starts without awaiting it goes through `BackgroundTasks.spawn`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine


class BackgroundTasks:
    """Tasks a component started and does not await: each is held until it is done."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(
        self,
        coro: Coroutine,
        name: str | None = None,
        on_done: Callable[[asyncio.Task], None] | None = None,
    ) -> asyncio.Task:
        """Start `coro` on the running loop; `on_done(task)` runs when it finishes. Without
        a running loop (a tool, a synchronous test) `coro` is closed and RuntimeError
        raised, so no coroutine is left never awaited."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            coro.close()
            raise
        task = loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if on_done is not None:
            task.add_done_callback(on_done)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def cancel_all(self) -> None:
        """Cancel every task still running (at shutdown)."""
        for task in list(self._tasks):
            task.cancel()
