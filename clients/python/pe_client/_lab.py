"""What the sweep and the passkey test share: the model's card, the async twin of a sync client, and
sending a batch of requests together so that the server runs them in one batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from pe_client.async_client import AsyncPEClient
from pe_client.client import PEClient
from pe_client.grid import GridError, check_lengths, check_supported, pick_model
from pe_client.scaling import PEScaling
from pe_client.types import ModelInfo

T = TypeVar("T")


async def checked_card(
    client: AsyncPEClient, model: str | None, lengths: Sequence[int], scalings: Sequence[PEScaling]
) -> tuple[ModelInfo, list[int]]:
    """The model's card and the sorted lengths, once both fit it (GET /models is the only request)."""
    card = pick_model(await client.models(), model)
    checked = check_lengths(lengths, card)
    check_supported(scalings, card)
    return card, checked


async def gather_all(
    jobs: Sequence[Callable[[], Awaitable[T]]],
    *,
    concurrency: int | None,
    on_done: Callable[[T], None] | None,
) -> list[T]:
    """Run every job, at most `concurrency` at once (None: all together), results in job order.

    Jobs run in a task group: when one fails or the caller is cancelled (Ctrl-C, a timeout), the
    others are cancelled, which closes their HTTP requests, and the server cancels what they asked.
    """
    if concurrency is not None and concurrency < 1:
        raise GridError(f"concurrency must be at least 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency or len(jobs) or 1)

    async def run(job: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            result = await job()
        if on_done is not None:
            on_done(result)
        return result

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(run(job)) for job in jobs]
    return [task.result() for task in tasks]


def run_with_twin(client: PEClient, work: Callable[[AsyncPEClient], Coroutine[Any, Any, T]]) -> T:
    """Run async lab work for a sync caller, over an async client with the sync client's settings.

    The lab's requests must be in flight together, which a blocking client cannot do; Ctrl-C
    cancels the work (asyncio.run does that), so the requests in flight are closed, not abandoned.
    """

    async def main() -> T:
        async with AsyncPEClient(
            client.base_url,
            api_key=client.api_key,
            timeout=client.timeout,
            max_retries=client.retry_policy.max_retries,
        ) as twin:
            return await work(twin)

    return asyncio.run(main())
