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

    def remote(self, *args):
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1

        async def result():
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return result()


class _Shard:
    def __init__(self, *answers) -> None:
        self.search_body = _Method(list(answers))


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
    assert status == 200 and lost.search_body.calls == 3 and steady.search_body.calls == 1
    assert [(r["position"], r["shard"]) for r in answer["results"]] == [(0, 0), (3, 1)]   # tie: lowest global row
    assert router.retries == 2


def test_answers_of_different_versions_are_asked_again():
    first = _Shard(_ok("1", (0, 0.9)), _ok("2", (0, 0.9)))
    second = _Shard(_ok("2", (1, 0.8)))
    status, answer = asyncio.run(_router(first, second).search(b"{}", None))
    assert status == 200 and answer["model_version"] == "2" and first.search_body.calls == 2
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
