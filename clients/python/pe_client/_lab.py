"""What the lab's commands share: the model (its card, and what its name sets), the async twin of
a sync client, sending a batch of requests together so that the server runs them in one batch,
greedy answers under a configuration, and cells that show their configuration as it was sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, PlainSerializer

from pe_client.async_client import AsyncPEClient
from pe_client.attention import PEAttention
from pe_client.client import PEClient
from pe_client.grid import (
    AttentionSpec,
    Configuration,
    GridError,
    ModelTarget,
    ScalingSpec,
    check_lengths,
    check_supported,
    configurations,
    needs_aliases,
    pick_model,
)
from pe_client.scaling import PEScaling
from pe_client.types import GenerateRequest

T = TypeVar("T")


def _as_sent(value: BaseModel | None) -> dict[str, Any] | None:
    """The fields the request set, as in the SPEC's JSON (unset ones are the server's defaults)."""
    return None if value is None else value.model_dump(mode="json", exclude_none=True)


SentScaling = Annotated[PEScaling, PlainSerializer(_as_sent)]
"""A cell's scaling, serialized with the fields the request set."""
SentAttention = Annotated[PEAttention | None, PlainSerializer(_as_sent)]
"""A cell's attention rule (None: no `pe_attention` was sent), serialized like `SentScaling`."""


async def greedy_text(
    client: AsyncPEClient,
    *,
    target: ModelTarget,
    tokens: list[int],
    configuration: Configuration,
    max_new_tokens: int,
) -> str:
    """The greedy continuation of `tokens` under a (scaling, attention rule) configuration; a None
    rule is left out of the body, like every unset field, and so is what the model's name sets."""
    request = GenerateRequest.model_validate(
        {
            **target.request_fields(configuration),
            "tokens": tokens,
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
        }
    )
    return (await client.generate(request)).text


async def checked_target(
    client: AsyncPEClient,
    model: str | None,
    lengths: Sequence[int],
    scalings: Sequence[ScalingSpec] | None,
    attentions: Sequence[AttentionSpec] | None,
    *,
    default_scalings: Sequence[ScalingSpec] = (),
) -> tuple[ModelTarget, list[Configuration], list[int]]:
    """The model, the grid's configurations under its name, and the sorted lengths, once all fit
    the model's card. `GET /models` is the only request, and `GET /v1/models` (the `--alias` names)
    for a name that is no resident model's. No `scalings` means `default_scalings` unless the
    name sets the scaling."""
    cards = await client.models()
    target = pick_model(cards, model, await alias_targets(client) if needs_aliases(cards, model) else None)
    if not scalings and target.named.scaling is None:
        scalings = default_scalings
    grid = configurations(scalings, attentions, target.named, model=model)
    checked = check_lengths(lengths, target.card)
    check_supported(grid, target.card)
    return target, grid, checked


async def alias_targets(client: AsyncPEClient) -> dict[str, str]:
    """The server's `--alias` names and their TARGETs (`MODEL@SPEC...`), from `GET /v1/models`,
    which lists them beside the resident models (an alias is the entry with a `target`)."""
    response = await client._send(client._build_request(client._http, "GET", "/v1/models"))
    return {
        entry["id"]: entry["target"] for entry in response.json()["data"] if entry.get("target") is not None
    }


async def gather_all(
    jobs: Sequence[Callable[[], Awaitable[T]]],
    *,
    concurrency: int | None,
    on_done: Callable[[T], None] | None,
) -> list[T]:
    """Run every job, at most `concurrency` at once (None: all together), results in job order.

    Jobs run in a task group: when one fails or the caller is cancelled (Ctrl-C, a timeout), the
    others are cancelled, which closes their HTTP requests, and the server cancels what they asked.
    The first failure is raised as itself (a GridError, an APIStatusError), not in the group's
    ExceptionGroup, so callers and the CLI handle it as they would a single request's.
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

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(run(job)) for job in jobs]
    except ExceptionGroup as failed:
        first = failed.exceptions[0]
        raise first from first.__cause__
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
