"""cancel_all stops tasks even when one swallows a cancellation, as asyncio.wait_for on Python
3.11 can when the awaited operation completes at that moment (a launchpad once never exited)."""

from __future__ import annotations

import asyncio

from torchpass_common.tasks import cancel_all


def test_a_task_that_swallows_a_cancellation_is_still_stopped() -> None:
    swallowed = []

    async def heartbeats() -> None:  # the shape of a loop whose wait_for ate the cancel
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)

    async def main() -> asyncio.Task[None]:
        task = asyncio.create_task(heartbeats())
        await asyncio.sleep(0.05)
        await asyncio.wait_for(cancel_all([task], every=0.1), timeout=5)
        return task

    task = asyncio.run(main())
    assert swallowed and task.cancelled()


def test_tasks_that_end_or_fail_on_cancel_are_waited_for() -> None:
    order: list[str] = []

    async def tidy() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)  # cleanup that takes a moment
            order.append("tidied")

    async def fails() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("broken on the way out") from None

    async def main() -> None:
        tasks = [asyncio.create_task(tidy()), asyncio.create_task(fails())]
        await asyncio.sleep(0.01)
        await cancel_all(tasks)
        assert all(t.done() for t in tasks)
        order.append("returned")

    asyncio.run(main())
    assert order == ["tidied", "returned"]
