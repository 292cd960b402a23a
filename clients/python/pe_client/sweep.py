"""Scaling sweeps: bits per token of one text at several lengths under several scalings.

Every (length, scaling) cell is one `/score` of the text's first `length` tokens, and all cells are
sent together, so one resident model runs them in shared batches: no restart per configuration,
which is what a context-extension study costs on any other server.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from pe_client._lab import checked_card, gather_all, run_with_twin
from pe_client.async_client import AsyncPEClient
from pe_client.client import PEClient
from pe_client.grid import GridError, ScalingSpec, parse_specs
from pe_client.scaling import PEScaling
from pe_client.types import ModelInfo, ScoreRequest

# Characters first sent to /tokenize per token wanted; doubled until the text yields enough tokens.
_CHARS_PER_TOKEN_GUESS = 4


class SweepCell(BaseModel):
    """One (length, scaling): mean −log2 p over tokens 2..length, and over the tokens past the
    native context (None when the length does not pass it)."""

    model_config = ConfigDict(frozen=True)

    length: int
    scaling: PEScaling
    tokens: int
    bits_per_token: float
    tail_bits_per_token: float | None

    @field_serializer("scaling")
    def _scaling_as_sent(self, scaling: PEScaling) -> dict[str, object]:
        """The fields the request set, as in the SPEC's JSON (unset ones are the server's defaults)."""
        return scaling.model_dump(mode="json", exclude_none=True)


class SweepResult(BaseModel):
    """The cells in grid order (scalings outer, lengths inner) and the sweep's wall time."""

    model_config = ConfigDict(frozen=True)

    model: str
    cells: list[SweepCell]
    wall_s: float
    native_context: int = Field(exclude=True)


async def async_sweep(
    client: AsyncPEClient,
    *,
    text: str,
    lengths: Sequence[int],
    scalings: Sequence[ScalingSpec],
    model: str | None = None,
    concurrency: int | None = None,
    on_cell: Callable[[SweepCell], None] | None = None,
) -> SweepResult:
    """Score `text`'s first L tokens for every L in `lengths` under every scaling.

    `scalings` are SPEC strings (`"yarn:factor=2|4"`) or typed scalings. The grid is checked before
    anything is scored (GridError): SPECs, ranges, lengths against the model's `max_context`, and
    the scalings its scheme takes. `concurrency` caps the cells in flight (None: all at once;
    1: one after another). `on_cell` is called as each cell completes (a progress bar, say). Long
    texts need a client whose timeout allows a long scoring.
    """
    grid = parse_specs(scalings)
    card, checked = await checked_card(client, model, lengths, grid)
    tokens = await leading_tokens(client, text, checked[-1], card.name)
    started = time.perf_counter()

    def job(length: int, scaling: PEScaling) -> Callable[[], Awaitable[SweepCell]]:
        return lambda: _score_cell(client, card, tokens[:length], scaling)

    cells = await gather_all(
        [job(length, scaling) for scaling in grid for length in checked],
        concurrency=concurrency,
        on_done=on_cell,
    )
    return SweepResult(
        model=card.name,
        cells=cells,
        wall_s=time.perf_counter() - started,
        native_context=card.native_context,
    )


def sweep(
    client: PEClient,
    *,
    text: str,
    lengths: Sequence[int],
    scalings: Sequence[ScalingSpec],
    model: str | None = None,
    concurrency: int | None = None,
    on_cell: Callable[[SweepCell], None] | None = None,
) -> SweepResult:
    """`async_sweep` for a blocking caller (the cells still go out together)."""
    return run_with_twin(
        client,
        lambda twin: async_sweep(
            twin,
            text=text,
            lengths=lengths,
            scalings=scalings,
            model=model,
            concurrency=concurrency,
            on_cell=on_cell,
        ),
    )


async def leading_tokens(client: AsyncPEClient, text: str, count: int, model: str) -> list[int]:
    """The first `count` tokens of `text` as the server tokenizes a prompt (BOS first).

    Only a prefix of the text is sent, grown until it yields enough tokens, so a long corpus
    never meets the server's body limit.
    """
    chars = count * _CHARS_PER_TOKEN_GUESS
    while True:
        tokens = await client.tokenize(text[:chars], model=model)
        if len(tokens) >= count:
            return tokens[:count]
        if chars >= len(text):
            raise GridError(f"the text has {len(tokens)} tokens, fewer than the longest length {count}")
        chars *= 2


async def _score_cell(
    client: AsyncPEClient, card: ModelInfo, tokens: list[int], scaling: PEScaling
) -> SweepCell:
    response = await client.score(ScoreRequest(tokens=tokens, model=card.name, pe_scaling=scaling))
    # token_logprobs[i] predicts token i; the first has no prefix, so logprobs[i - 1] is token i's.
    logprobs = [logprob for logprob in response.token_logprobs[1:] if logprob is not None]
    past_native = logprobs[card.native_context - 1 :] if len(tokens) > card.native_context else None
    return SweepCell(
        length=len(tokens),
        scaling=scaling,
        tokens=len(tokens),
        bits_per_token=bits_per_token(logprobs),
        tail_bits_per_token=None if past_native is None else bits_per_token(past_native),
    )


def bits_per_token(logprobs: Sequence[float]) -> float:
    """Mean −log2 p of natural-log probabilities."""
    return -math.fsum(logprobs) / len(logprobs) / math.log(2)
