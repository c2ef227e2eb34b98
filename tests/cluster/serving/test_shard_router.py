"""The shard router's retry rules (unit test of error paths with stand-in shard handles): a shard call that fails or
answers 503 is asked again, only that shard; answers of different model versions are all asked again; a refusal
is returned as is; past the deadline a 503 names the shard and its error. The live path is
test_serve_shards.py."""
from __future__ import annotations

import asyncio

import pytest

from cluster.serving.shard_router import ShardRouter

DOCUMENT = {"count": 6, "dim": 2, "parts": [{"offset": 0, "rows": 3}, {"offset": 3, "rows": 3}]}


class _Method:
    def __init__(self, answers: list) -> None:
        self.answers, self.calls = answers, 0

    def remote(self, items: list):
        """One call carrying ``items`` (search bodies): the next answer for each, or the call fails with the first
        exception among them."""
        answers = [self.answers[min(self.calls + n, len(self.answers) - 1)] for n in range(len(items))]
        self.calls += len(items)

        async def result():
            failure = next((a for a in answers if isinstance(a, BaseException)), None)
            if failure is not None:
                raise failure
            return answers
        return result()


class _Shard:
    def __init__(self, *answers) -> None:
        self.search_bodies = _Method(list(answers))


def _ok(version: str, *rows) -> tuple[int, dict]:
    return 200, {"model": "m", "model_version": version, "index_manifest": "x" * 64, "k": 2,
                 "results": [{"id": f"{p}", "position": p, "score": s, "item_version": version, "adapter": None}
                             for p, s in rows]}


def _router(*shards, retry_s: float = 5.0) -> ShardRouter:
    return ShardRouter({"index": "unused", "shard_retry_s": retry_s}, ("s" * 64, DOCUMENT), list(shards))


def test_a_failed_shard_call_is_asked_again_alone_and_merged_exactly():
    lost = _Shard(RuntimeError("ActorDiedError: the actor died"), (503, {"error": {"message": "loading"}}),
                  _ok("1", (0, 0.5), (2, 0.1)))
    steady = _Shard(_ok("1", (0, 0.5), (1, 0.4)))
    router = _router(lost, steady)
    status, answer = asyncio.run(router.search(b"{}", "application/json"))
    assert status == 200 and lost.search_bodies.calls == 3 and steady.search_bodies.calls == 1
    assert [(r["position"], r["shard"]) for r in answer["results"]] == [(0, 0), (3, 1)]   # tie: lowest global row
    assert router.retries == 2


def test_answers_of_different_versions_are_asked_again():
    first = _Shard(_ok("1", (0, 0.9)), _ok("2", (0, 0.9)))
    second = _Shard(_ok("2", (1, 0.8)))
    status, answer = asyncio.run(_router(first, second).search(b"{}", None))
    assert status == 200 and answer["model_version"] == "2" and first.search_bodies.calls == 2
    assert [r["position"] for r in answer["results"]] == [0, 4]


def test_a_refusal_is_the_answer_and_a_lost_shard_gives_a_503_past_the_deadline():
    refusal = (400, {"error": {"status": 400, "field": "k", "message": "too large"}})
    assert asyncio.run(_router(_Shard(refusal), _Shard(refusal)).search(b"{}", None)) == refusal
    status, answer = asyncio.run(_router(_Shard(RuntimeError("gone")), _Shard(_ok("1", (0, 1.0))),
                                         retry_s=0.3).search(b"{}", None))
    assert status == 503 and "shard 0: RuntimeError: gone" in answer["error"]["message"]


def test_shard_handles_must_match_the_parts():
    with pytest.raises(ValueError, match="1 shard deployments for 2 parts"):
        _router(_Shard(_ok("1")))


class _EchoShard:
    """Answers body b"<n>" with row n % 3 scored n / 10 (per body); records the bodies of every call."""

    def __init__(self, version: str = "1") -> None:
        self.version, self.call_sizes = version, []
        self.search_bodies = self

    def remote(self, items: list):
        self.call_sizes.append(len(items))

        async def result():
            await asyncio.sleep(0.01)
            return [_ok(self.version, (int(body) % 3, int(body) / 10)) for body, _ in items]
        return result()


def test_concurrent_queries_go_to_each_shard_as_one_call_and_are_merged_each_on_its_own():
    shards = [_EchoShard(), _EchoShard()]
    router = _router(*shards)

    async def many():
        return await asyncio.gather(*(router.search(str(n).encode(), None) for n in range(10)))

    answers = asyncio.run(many())
    for n, (status, answer) in enumerate(answers):
        assert status == 200
        # both shards answer local row n % 3 with the same score: the lower global row (shard 0) first
        assert [(r["position"], r["shard"]) for r in answer["results"]] == [(n % 3, 0), (3 + n % 3, 1)]
    for shard in shards:   # two calls sent at once, the other eight bodies waited and went together
        assert shard.call_sizes == [1, 1, 8]
    one_a_call = [_EchoShard(), _EchoShard()]
    router = ShardRouter({"index": "unused", "shard_batch": 1}, ("s" * 64, DOCUMENT), list(one_a_call))

    async def ten():
        return await asyncio.gather(*(router.search(b"1", None) for _ in range(10)))

    assert all(status == 200 for status, _ in asyncio.run(ten()))
    assert one_a_call[0].call_sizes == [1] * 10
