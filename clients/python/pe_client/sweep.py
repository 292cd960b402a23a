"""Scaling sweeps: bits per token of one text at several lengths under several scalings.

A (length, scaling) cell is the mean −log2 p of the text's first `length` tokens, as `/score` of
those tokens gives it. The cells of one scaling are prefixes of the same text, and a causal model
scores a prefix as it scores the whole, so each scaling is scored once, at its longest length, and
its shorter cells are read off that pass's per-token log-probabilities: a grid costs one pass per
configuration, not one per cell. The exception is a scaling whose positions depend on the total
length (dynamic NTK's base follows it, LongRoPE switches tables at the original context): a long
pass's prefix is not what a short pass computes, so those keep one pass per length.

The passes go out together (a bounded number at a time), so one resident model runs them in shared
batches: no restart per configuration, which is what a context-extension study costs on any other
server.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from pe_client._lab import checked_card, gather_all, run_with_twin
from pe_client.async_client import AsyncPEClient
from pe_client.client import PEClient
from pe_client.errors import PEServeError
from pe_client.grid import GridError, ScalingSpec, parse_specs
from pe_client.scaling import PEScaling
from pe_client.types import ModelInfo, ScoreRequest

# Characters first sent to /tokenize per token wanted; doubled until the text yields enough tokens.
_CHARS_PER_TOKEN_GUESS = 4

LENGTH_DEPENDENT_SCALINGS = frozenset({"dynamic", "longrope"})
"""Scaling types whose positions depend on the sequence's total length (the server gives every
position the table for the whole sequence): a prefix of a long pass differs from a short pass."""

PASSES_IN_FLIGHT = 16
"""`/score` passes a sweep keeps in flight by default: the server's default scoring places
(`--max-batch-size`), so one engine step can batch them all, and a large grid of length-dependent
cells stays well under the server's queue limit."""


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
    the scalings its scheme takes. Each scaling is one `/score` at the longest length, its shorter
    cells read from that pass's prefix (`score_passes`); a length-dependent scaling (dynamic,
    longrope) is one `/score` per length. `concurrency` caps the passes in flight (None:
    `PASSES_IN_FLIGHT`; 1: one after another). `on_cell` is called for each cell as its pass
    completes (a progress bar, say). Long texts need a client whose timeout allows a long scoring.
    """
    grid = parse_specs(scalings)
    card, checked = await checked_card(client, model, lengths, grid)
    tokens = await leading_tokens(client, text, checked[-1], card.name)
    started = time.perf_counter()
    passes = score_passes(grid, checked)

    def job(scaling: PEScaling, length: int, cells: list[int]) -> Callable[[], Awaitable[list[SweepCell]]]:
        return lambda: _score_pass(client, card, tokens[:length], scaling, cells)

    def cells_done(cells: list[SweepCell]) -> None:
        if on_cell is not None:
            for cell in cells:
                on_cell(cell)

    scored = await gather_all(
        [job(scaling, length, cells) for scaling, length, cells in passes],
        concurrency=PASSES_IN_FLIGHT if concurrency is None else concurrency,
        on_done=cells_done,
    )
    # Keyed by the grid's own scaling objects: scalings with list fields (longrope) do not hash.
    by_place = {
        (id(scaling), cell.length): cell
        for (scaling, _, _), cells in zip(passes, scored, strict=True)
        for cell in cells
    }
    return SweepResult(
        model=card.name,
        cells=[by_place[id(scaling), length] for scaling in grid for length in checked],
        wall_s=time.perf_counter() - started,
        native_context=card.native_context,
    )


def score_passes(
    scalings: Sequence[PEScaling], lengths: Sequence[int]
) -> list[tuple[PEScaling, int, list[int]]]:
    """The `/score` passes a grid needs, as (scaling, tokens scored, the cells' lengths it gives).

    `lengths` ascending. A scaling whose positions do not depend on the total length is one pass
    at the longest length giving every cell; a length-dependent one (`LENGTH_DEPENDENT_SCALINGS`)
    is one pass per length.
    """
    passes: list[tuple[PEScaling, int, list[int]]] = []
    for scaling in scalings:
        if scaling.type in LENGTH_DEPENDENT_SCALINGS:
            passes.extend((scaling, length, [length]) for length in lengths)
        else:
            passes.append((scaling, lengths[-1], list(lengths)))
    return passes


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
    """`async_sweep` for a blocking caller (the passes still go out together)."""
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


async def _score_pass(
    client: AsyncPEClient, card: ModelInfo, tokens: list[int], scaling: PEScaling, lengths: list[int]
) -> list[SweepCell]:
    """One `/score` of `tokens` under `scaling`, and the cell of each length in `lengths` (each at
    most `len(tokens)`) read from its first tokens' log-probabilities."""
    response = await client.score(ScoreRequest(tokens=tokens, model=card.name, pe_scaling=scaling))
    # token_logprobs[i] predicts token i; the first has no prefix, so logprobs[i - 1] is token i's.
    logprobs = [logprob for logprob in response.token_logprobs[1:] if logprob is not None]
    if len(logprobs) != len(tokens) - 1:
        raise PEServeError(f"/score returned {len(logprobs)} log-probabilities for {len(tokens)} tokens")
    return [prefix_cell(logprobs, length, scaling, card.native_context) for length in lengths]


def prefix_cell(logprobs: Sequence[float], length: int, scaling: PEScaling, native_context: int) -> SweepCell:
    """The cell of the first `length` tokens from a pass's log-probabilities of tokens 2.. (natural
    log; at least `length - 1` of them): the mean over tokens 2..length, and over those past the
    native context (None when `length` does not pass it)."""
    prefix = logprobs[: length - 1]
    return SweepCell(
        length=length,
        scaling=scaling,
        tokens=length,
        bits_per_token=bits_per_token(prefix),
        tail_bits_per_token=bits_per_token(prefix[native_context - 1 :]) if length > native_context else None,
    )


def bits_per_token(logprobs: Sequence[float]) -> float:
    """Mean −log2 p of natural-log probabilities."""
    return -math.fsum(logprobs) / len(logprobs) / math.log(2)
