"""Background tasks are held until they finish (core/tasks.py): a task waiting on a future
only its own coroutine holds is not collected while pending, as an unheld one is."""

import asyncio
import gc

from seedflood_p2p.core.tasks import BackgroundTasks


async def _waits_forever(closed: list[str]) -> None:
    waiting = asyncio.get_running_loop().create_future()  # held by this coroutine only
    try:
        await waiting
    finally:
        closed.append("closed")


def test_an_unheld_pending_task_is_collected_and_a_held_one_is_not():
    async def scenario() -> tuple[list[str], list[str], int]:
        unheld, held = [], []
        asyncio.get_running_loop().create_task(_waits_forever(unheld))  # nobody holds it
        tasks = BackgroundTasks()
        tasks.spawn(_waits_forever(held), name="held")
        await asyncio.sleep(0)  # both start and wait
        gc.collect()  # the unheld task is destroyed pending, its coroutine closed here
        collected = list(unheld), list(held), len(tasks)
        tasks.cancel_all()
        for _ in range(3):  # the cancellation, then the done callbacks
            await asyncio.sleep(0)
        return (*collected, len(tasks), held)

    unheld, held_then, running, left, held_after = asyncio.run(scenario())
    assert unheld == ["closed"]  # what happened to the disconnect task of a ban
    assert held_then == [] and running == 1  # held: still waiting, not collected
    assert left == 0 and held_after == ["closed"]  # cancelled at shutdown, then forgotten


def test_done_tasks_are_forgotten_and_their_callback_runs():
    async def scenario() -> tuple[int, list[str]]:
        seen: list[str] = []

        async def quick() -> str:
            return "ok"

        tasks = BackgroundTasks()
        tasks.spawn(quick(), name="quick", on_done=lambda t: seen.append(t.result()))
        await asyncio.sleep(0.01)
        return len(tasks), seen

    left, seen = asyncio.run(scenario())
    assert left == 0 and seen == ["ok"]


def test_without_a_running_loop_the_coroutine_is_closed_and_the_error_raised():
    ran: list[str] = []

    async def body() -> None:
        ran.append("ran")

    coro = body()
    try:
        BackgroundTasks().spawn(coro, name="no loop")
    except RuntimeError:
        pass
    else:
        raise AssertionError("spawn without a running loop must raise")
    # closed, not left pending: awaiting it now fails, and it never ran
    assert coro.cr_frame is None and ran == []
