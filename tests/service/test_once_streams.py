"""`RunOnce` for streams and fingerprints, on a real event loop: a stream retried mid-way reads
every chunk of the one run, a refused start is raised and not kept, what the start set up is
released when the last reader leaves, and a key reused for another request is refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from service.requests.errors import ErrorKind, RequestError
from service.requests.once import RunOnce, StartStream

CHUNKS = [b"one", b"two", b"three"]


class Source:
    """A stream's start: counts its runs, hands out chunks when told, and records its release."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.refuse = refuse
        self.runs = 0
        self.released = 0
        self.next_chunk = asyncio.Queue[bytes | None]()

    def start(self) -> AsyncIterator[bytes]:
        self.runs += 1
        if self.refuse:
            raise RequestError(ErrorKind.QUEUE_FULL, "full")
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            while (chunk := await self.next_chunk.get()) is not None:
                yield chunk
        finally:
            self.released += 1

    def feed(self, *chunks: bytes | None) -> None:
        for chunk in chunks:
            self.next_chunk.put_nowait(chunk)


async def read(
    once: RunOnce, start: StartStream, key: str | None = "k", fingerprint: str = "f"
) -> list[bytes]:
    async with once.streamed(key, start, fingerprint) as chunks:
        return [chunk async for chunk in chunks]


def test_a_stream_retried_mid_way_reads_every_chunk_of_the_one_run_and_a_late_one_the_kept_chunks() -> None:
    async def main() -> None:
        once, source = RunOnce(), Source()
        first = asyncio.ensure_future(read(once, source.start))
        source.feed(CHUNKS[0])
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(read(once, source.start))
        await asyncio.sleep(0.01)
        source.feed(*CHUNKS[1:], None)
        assert await first == await second == CHUNKS
        assert await read(once, source.start) == CHUNKS
        assert source.runs == 1 and once.held() == (1, sum(map(len, CHUNKS)))

    asyncio.run(main())


def test_a_refused_start_is_raised_on_entering_and_not_kept() -> None:
    async def main() -> None:
        once, source = RunOnce(), Source(refuse=True)
        for _ in range(2):
            with pytest.raises(RequestError) as caught:
                await read(once, source.start)
            assert caught.value.kind is ErrorKind.QUEUE_FULL
        assert source.runs == 2 and once.held() == (0, 0)

    asyncio.run(main())


def test_what_the_start_set_up_is_released_when_the_last_reader_leaves() -> None:
    async def main() -> None:
        once, source = RunOnce(), Source()
        entered = asyncio.Event()

        async def leave_at_once() -> None:
            async with once.streamed("k", source.start, "f"):
                entered.set()
                await asyncio.Event().wait()

        readers = [asyncio.ensure_future(read(once, source.start)), asyncio.ensure_future(leave_at_once())]
        await entered.wait()
        readers[1].cancel()
        await asyncio.sleep(0.01)
        assert source.released == 0, "one reader still follows the run"
        readers[0].cancel()
        await asyncio.sleep(0.01)
        assert source.runs == source.released == 1 and once.held() == (0, 0)

    asyncio.run(main())


def test_a_key_reused_for_another_request_is_refused_while_it_runs_and_once_kept() -> None:
    async def main() -> None:
        once, source = RunOnce(), Source()

        async def refused() -> RequestError:
            with pytest.raises(RequestError) as caught:
                await read(once, source.start, fingerprint="other")
            return caught.value

        first = asyncio.ensure_future(read(once, source.start, fingerprint="asked"))
        await asyncio.sleep(0.01)
        while_running = await refused()
        source.feed(b"answer", None)
        assert await first == [b"answer"]
        for error in (while_running, await refused()):
            assert error.kind is ErrorKind.INVALID and error.param == "request_id"
        assert source.runs == 1

    asyncio.run(main())


def test_without_a_key_each_run_is_its_own_and_nothing_is_kept() -> None:
    async def main() -> None:
        once, source = RunOnce(), Source()
        source.feed(b"a", None, b"b", None)
        assert [await read(once, source.start, key=None) for _ in range(2)] == [[b"a"], [b"b"]]

        async def body() -> bytes:
            return b"alone"

        with once.attached(None, body) as answer:
            assert await answer == b"alone"
        assert source.runs == 2 and once.held() == (0, 0)

    asyncio.run(main())
