"""Bounded batching of concurrent calls to one remote target (a shard deployment): calls made while enough are
already in flight wait and go together as one call, so a router fanning many queries out to many shards pays the
per-call cost once per batch instead of once per query.

A call is sent at once while fewer than ``max_in_flight`` batches are outstanding (no added latency when idle);
otherwise it waits for one of them to return and then leaves with every call that waited since (at most
``max_batch`` per batch). Each caller gets its own item's answer, or the exception of the batch it went in.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

__all__ = ["CallBatcher"]


class CallBatcher:
    """send: async function of a list of items returning one answer per item, in order; max_batch: items per
    call (1: every item its own call); max_in_flight: calls outstanding at once before items wait."""

    def __init__(self, send: Callable[[list], Awaitable[list]], max_batch: int = 32, max_in_flight: int = 2) -> None:
        if int(max_batch) < 1 or int(max_in_flight) < 1:
            raise ValueError(f"call batcher: max_batch and max_in_flight must be >= 1, got {max_batch}, "
                             f"{max_in_flight}")
        self._send = send
        self.max_batch, self.max_in_flight = int(max_batch), int(max_in_flight)
        self._waiting: list[tuple[Any, asyncio.Future]] = []
        self._in_flight = 0
        self.calls = 0           # calls sent (batches)
        self.items = 0           # items they carried

    async def ask(self, item: Any) -> Any:
        """The answer to ``item`` (sent alone or with the items waiting beside it)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        self._dispatch()
        return await future

    def _dispatch(self) -> None:
        while self._waiting and self._in_flight < self.max_in_flight:
            batch, self._waiting = self._waiting[:self.max_batch], self._waiting[self.max_batch:]
            self._in_flight += 1
            self.calls += 1
            self.items += len(batch)
            asyncio.ensure_future(self._run(batch))

    async def _run(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
        try:
            answers = await self._send([item for item, _ in batch])
            if len(answers) != len(batch):
                raise RuntimeError(f"call batcher: {len(answers)} answers for {len(batch)} items")
            for (_, future), answer in zip(batch, answers):
                if not future.done():
                    future.set_result(answer)
        except Exception as error:  # noqa: BLE001 - every caller of the batch gets its error
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
        finally:
            for _, future in batch:   # cancelled underway: no caller waits forever
                if not future.done():
                    future.set_exception(RuntimeError("call batcher: the batch call was cancelled"))
            self._in_flight -= 1
            self._dispatch()
