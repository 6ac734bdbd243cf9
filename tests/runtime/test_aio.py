"""The one supervisor: the first failure stops everything, a loop that ends is a crash;
and the stall watch: a loop held over its threshold is logged with what held it."""

import asyncio
import time

import pytest

from flexmarl.runtime.aio import StallWatch, TaskEnded, supervise


async def test_finite_tasks_return_their_results_in_order():
    async def value(x, delay):
        await asyncio.sleep(delay)
        return x

    tasks = [asyncio.create_task(value(i, 0.01 * (3 - i))) for i in range(3)]
    assert await supervise(tasks) == [0, 1, 2]


async def test_the_first_failure_cancels_the_others_and_is_raised_as_is():
    cancelled = asyncio.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def boom():
        await asyncio.sleep(0.01)
        raise ValueError("bad")

    slow = asyncio.create_task(forever())
    with pytest.raises(ValueError, match="bad"):
        await supervise([slow, asyncio.create_task(boom())])
    assert cancelled.is_set() and slow.cancelled()


async def test_a_loop_meant_to_run_forever_that_ends_is_a_failure_naming_it():
    async def ends():
        return None

    other = asyncio.create_task(asyncio.sleep(3600))
    with pytest.raises(TaskEnded, match="'receive' ended early"):
        await supervise([asyncio.create_task(ends(), name="receive"), other], forever=True)
    assert other.cancelled()


async def test_a_watched_background_task_ending_cancels_the_work_but_is_left_to_its_owner():
    async def fails():
        await asyncio.sleep(0.01)
        raise OSError("socket closed")

    background = asyncio.create_task(fails(), name="heartbeat")
    keeps_running = asyncio.create_task(asyncio.sleep(3600), name="event-log")
    work = asyncio.create_task(asyncio.sleep(3600), name="training")
    with pytest.raises(TaskEnded) as info:
        await supervise([work], watch=[background, keeps_running])
    assert info.value.name == "heartbeat" and isinstance(info.value.cause, OSError)
    assert work.cancelled() and not keeps_running.done()
    keeps_running.cancel()


async def test_cancelling_the_caller_cancels_the_supervised_tasks():
    work = asyncio.create_task(asyncio.sleep(3600))
    outer = asyncio.create_task(supervise([work]))
    await asyncio.sleep(0.01)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert work.cancelled()


async def test_a_failure_behind_the_one_raised_is_never_left_unretrieved():
    """Two tasks fail at once, or one fails while the caller is being cancelled: only one
    error is raised, and asyncio never reports the other as 'never retrieved'."""
    import gc

    reported = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda loop, context: reported.append(context["message"]))

    async def fails(why):
        raise RuntimeError(why)

    first, second = asyncio.create_task(fails("first")), asyncio.create_task(fails("second"))
    await asyncio.sleep(0)  # both done before the supervisor looks
    with pytest.raises(RuntimeError):
        await supervise([first, second])
    failed = asyncio.create_task(fails("while cancelled"))
    outer = asyncio.create_task(supervise([failed, asyncio.create_task(asyncio.sleep(3600))]))
    await asyncio.sleep(0)
    outer.cancel()
    with pytest.raises((asyncio.CancelledError, RuntimeError)):
        await outer
    del first, second, failed, outer
    gc.collect()
    await asyncio.sleep(0)
    assert reported == []


def hold_the_loop(seconds):
    time.sleep(seconds)


async def test_a_loop_held_past_the_threshold_is_logged_with_the_code_that_held_it(caplog):
    async with StallWatch("test", threshold_s=0.4).watching() as watch:
        await asyncio.sleep(0.3)
        hold_the_loop(1.5)
        await asyncio.sleep(0.6)  # it turns again: the stall ends
    held = [(seconds, what) for seconds, what in watch.stalls if "hold_the_loop" in what]
    assert held and held[0][1].startswith("test_aio.py:") and held[0][0] > 0.4
    said = [r.getMessage() for r in caplog.records if "hold_the_loop" in r.getMessage()]
    assert any(m.startswith("test: the event loop has been held for ") for m in said)
    assert any(m.startswith("test: the event loop was held for about ") for m in said)
    assert "Traceback" not in caplog.text


async def test_a_loop_that_keeps_turning_is_not_logged(caplog):
    async with StallWatch("test", threshold_s=0.4).watching() as watch:
        for _ in range(20):  # twice the threshold and its tick: a watch that missed the turns would speak
            await asyncio.sleep(0.05)
    # A stall the watch blames on the machine (the whole process held, on a loaded host) is
    # not the loop's; any other, ended or still held, would name the idle loop's frames.
    assert [s for s in watch.stalls if not s[1].startswith("nothing of ours")] == []
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("test: the event loop")]
    assert [m for m in said if "nothing of ours" not in m] == []
