"""`RunOnce` on a real event loop: one run per key, answers kept within their bounds, failures
not kept, and a run cancelled once its last caller has left."""

from __future__ import annotations

import asyncio

import pytest

from service.requests.once import RunOnce, Start


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def counting(runs: list[str], body: bytes, release: asyncio.Event | None = None) -> Start:
    async def start() -> bytes:
        runs.append(body.decode())
        if release is not None:
            await release.wait()
        return body

    return start


def test_callers_of_one_key_share_one_run_and_a_late_one_gets_the_kept_answer() -> None:
    async def main() -> None:
        once, release = RunOnce(), asyncio.Event()
        runs: list[str] = []

        async def ask() -> bytes:
            with once.attached("k", counting(runs, b"answer", release)) as shared:
                return await shared

        waiting = [asyncio.ensure_future(ask()) for _ in range(3)]
        await asyncio.sleep(0)
        release.set()
        assert await asyncio.gather(*waiting) == [b"answer"] * 3
        assert await ask() == b"answer"
        assert runs == ["answer"]
        assert once.held() == (1, len(b"answer"))

    asyncio.run(main())


def test_a_failed_run_is_not_kept() -> None:
    async def main() -> None:
        once = RunOnce()
        attempts: list[str] = []

        async def fails() -> bytes:
            attempts.append("failed")
            raise RuntimeError("engine gone")

        for _ in range(2):
            with once.attached("k", fails) as shared, pytest.raises(RuntimeError):
                await shared
        assert attempts == ["failed", "failed"] and once.held() == (0, 0)

    asyncio.run(main())


def test_answers_are_bounded_in_count_bytes_and_age() -> None:
    async def main() -> None:
        clock = Clock()
        once = RunOnce(capacity=3, max_bytes=10, keep_s=60.0, clock=clock)
        runs: list[str] = []

        async def ask(key: str, body: bytes) -> bytes:
            with once.attached(key, counting(runs, body)) as shared:
                return await shared

        for key in "abcd":
            await ask(key, key.encode() * 2)
        assert once.held() == (3, 6), "the oldest of four dropped past three answers"
        await ask("e", b"x" * 9)
        assert once.held() == (1, 9), "bytes past the bound evict the oldest first"
        await ask("f", b"y" * 11)
        assert once.held() == (1, 9), "an answer larger than the bound is not kept"
        clock.now = 61.0
        await ask("e", b"x" * 9)
        assert runs.count("x" * 9) == 2, "an answer past its age runs again"

    asyncio.run(main())


def test_the_run_is_cancelled_when_its_last_caller_leaves_and_not_before() -> None:
    async def main() -> None:
        once, started, cancelled = RunOnce(), asyncio.Event(), asyncio.Event()

        async def endless() -> bytes:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return b""

        async def ask() -> bytes:
            with once.attached("k", endless) as shared:
                return await asyncio.shield(shared)

        first, second = asyncio.ensure_future(ask()), asyncio.ensure_future(ask())
        await started.wait()
        first.cancel()
        await asyncio.sleep(0.01)
        assert not cancelled.is_set(), "another caller still waits"
        second.cancel()
        await asyncio.wait_for(cancelled.wait(), 5)
        assert once.held() == (0, 0)

    asyncio.run(main())
