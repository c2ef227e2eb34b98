"""CallBatcher: concurrent items beyond the calls in flight go together, each caller gets its own answer, a failed
batch fails only its own callers, and max_batch 1 sends every item alone."""
from __future__ import annotations

import asyncio

import pytest

from cluster.serving.call_batcher import CallBatcher


class _Target:
    """A remote stand-in: records each call's items, answers item * 10 after the test releases it."""

    def __init__(self) -> None:
        self.calls: list[list] = []
        self.release = asyncio.Event()
        self.fail_on: set = set()

    async def send(self, items: list) -> list:
        self.calls.append(list(items))
        await self.release.wait()
        if self.fail_on & set(items):
            raise ConnectionError(f"lost with {sorted(self.fail_on & set(items))}")
        return [item * 10 for item in items]


def _run(coroutine):
    return asyncio.run(coroutine)


def test_items_waiting_beside_calls_in_flight_go_as_one_call():
    async def scenario():
        target = _Target()
        batcher = CallBatcher(target.send, max_batch=4, max_in_flight=2)
        tasks = [asyncio.ensure_future(batcher.ask(n)) for n in range(11)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert target.calls == [[0], [1]]          # two sent at once, nine wait
        target.release.set()
        answers = await asyncio.gather(*tasks)
        return target.calls, answers, batcher

    calls, answers, batcher = _run(scenario())
    assert answers == [n * 10 for n in range(11)]
    assert calls == [[0], [1], [2, 3, 4, 5], [6, 7, 8, 9], [10]]
    assert (batcher.calls, batcher.items) == (5, 11)


def test_a_failed_batch_fails_only_its_callers():
    async def scenario():
        target = _Target()
        target.fail_on = {3}
        batcher = CallBatcher(target.send, max_batch=8, max_in_flight=1)
        tasks = [asyncio.ensure_future(batcher.ask(n)) for n in range(6)]
        await asyncio.sleep(0)
        target.release.set()
        return target.calls, await asyncio.gather(*tasks, return_exceptions=True)

    calls, answers = _run(scenario())
    assert calls == [[0], [1, 2, 3, 4, 5]]
    assert answers[0] == 0
    assert all(isinstance(a, ConnectionError) and "lost with [3]" in str(a) for a in answers[1:])


def test_batch_of_one_sends_every_item_alone():
    async def scenario():
        target = _Target()
        target.release.set()
        batcher = CallBatcher(target.send, max_batch=1, max_in_flight=1)
        return target.calls, await asyncio.gather(*(batcher.ask(n) for n in range(4)))

    calls, answers = _run(scenario())
    assert calls == [[0], [1], [2], [3]] and answers == [0, 10, 20, 30]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_batch and max_in_flight must be >= 1"):
        CallBatcher(lambda items: items, max_batch=0)
