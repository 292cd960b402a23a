"""Scaling sweeps: bits per token of one text at several lengths under several configurations
(each scaling, crossed with each attention rule when rules are given).

A (length, configuration) cell is the mean −log2 p of the text's first `length` tokens, as
`/score` of those tokens gives it. The cells of one configuration are prefixes of the same text,
and a causal model scores a prefix as it scores the whole, so each configuration is scored once, at
its longest length, and its shorter cells are read off that pass's per-token log-probabilities: a
grid costs one pass per configuration, not one per cell. The exception is a scaling whose positions
depend on the total length (dynamic NTK's base follows it, LongRoPE switches tables at the original
context): a long pass's prefix is not what a short pass computes, so those keep one pass per
length. No attention rule is such an exception (`LENGTH_DEPENDENT_ATTENTION`).

The passes go out together (a bounded number at a time), so one resident model runs them in shared
batches: no restart per configuration, which is what a context-extension study costs on any other
server.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from pe_client._lab import SentAttention, SentScaling, checked_target, gather_all, run_with_twin
from pe_client.async_client import AsyncPEClient
from pe_client.attention import PEAttention
from pe_client.client import PEClient
from pe_client.errors import PEServeError
from pe_client.grid import AttentionSpec, Configuration, GridError, ModelTarget, ScalingSpec, check_grid
from pe_client.scaling import PEScaling
from pe_client.types import ScoreRequest

# Characters first sent to /tokenize per token wanted; doubled until the text yields enough tokens.
_CHARS_PER_TOKEN_GUESS = 4

LENGTH_DEPENDENT_SCALINGS = frozenset({"dynamic", "longrope"})
"""Scaling types whose positions depend on the sequence's total length (the server gives every
position the table for the whole sequence): a prefix of a long pass differs from a short pass."""

LENGTH_DEPENDENT_ATTENTION: frozenset[str] = frozenset()
"""Attention rule types whose positions depend on the total length: none. Every rule places a
(query, key) pair and decides whether the query sees the key from the two text indices alone
(`service/model/attention_rules.py`: Self-Extend's groups, (leaky) ReRoPE's window, DCA's chunks,
StreamingLLM's sinks and window, log-n's per-query factor), so under any rule a long pass's prefix
is what a short pass computes."""

PASSES_IN_FLIGHT = 16
"""`/score` passes a sweep keeps in flight by default: the server's default scoring places
(`--max-batch-size`), so one engine step can batch them all, and a large grid of length-dependent
cells stays well under the server's queue limit."""


class SweepCell(BaseModel):
    """One (length, configuration): mean −log2 p over tokens 2..length, and over the tokens past
    the native context (None when the length does not pass it). `attention` is None when no rule
    was sent."""

    model_config = ConfigDict(frozen=True)

    length: int
    scaling: SentScaling
    attention: SentAttention = None
    tokens: int
    bits_per_token: float
    tail_bits_per_token: float | None


class SweepResult(BaseModel):
    """The cells in grid order (configurations outer: scalings, then attention rules; lengths
    inner) and the sweep's wall time; `model` is the name the requests carried."""

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
    scalings: Sequence[ScalingSpec] | None = None,
    attentions: Sequence[AttentionSpec] | None = None,
    model: str | None = None,
    concurrency: int | None = None,
    on_cell: Callable[[SweepCell], None] | None = None,
) -> SweepResult:
    """Score `text`'s first L tokens for every L in `lengths` under every configuration.

    `scalings` are SPEC strings (`"yarn:factor=2|4"`) or typed scalings, each crossed with every
    attention rule of `attentions` (SPECs or typed rules; None sends no `pe_attention`). `model`
    may be a resident model, an `--alias` name or either with `@SPEC`s; what the name sets is the
    grid's one scaling (or rule) and travels in the name, and `scalings` (or `attentions`) must
    then be left out. The grid is checked before anything is scored (GridError): SPECs, ranges,
    lengths against the model's `max_context`, and the scalings its scheme takes. Each
    configuration is one `/score` at the longest length, its shorter cells read from that pass's
    prefix (`score_passes`); a length-dependent scaling (dynamic, longrope) is one `/score` per
    length. `concurrency` caps the passes in flight (None: `PASSES_IN_FLIGHT`; 1: one after
    another). `on_cell` is called for each cell as its pass completes (a progress bar, say). Long
    texts need a client whose timeout allows a long scoring.
    """
    check_grid(scalings, attentions, model)
    target, grid, checked = await checked_target(client, model, lengths, scalings, attentions)
    tokens = await leading_tokens(client, text, checked[-1], target.card.name)
    started = time.perf_counter()
    passes = score_passes(grid, checked)

    def job(
        configuration: Configuration, length: int, cells: list[int]
    ) -> Callable[[], Awaitable[list[SweepCell]]]:
        return lambda: _score_pass(client, target, tokens[:length], configuration, cells)

    def cells_done(cells: list[SweepCell]) -> None:
        if on_cell is not None:
            for cell in cells:
                on_cell(cell)

    scored = await gather_all(
        [job(configuration, length, cells) for configuration, length, cells in passes],
        concurrency=PASSES_IN_FLIGHT if concurrency is None else concurrency,
        on_done=cells_done,
    )
    # Keyed by the grid's own configurations: scalings with list fields (longrope) do not hash.
    by_place = {
        (id(configuration), cell.length): cell
        for (configuration, _, _), cells in zip(passes, scored, strict=True)
        for cell in cells
    }
    return SweepResult(
        model=target.name,
        cells=[by_place[id(configuration), length] for configuration in grid for length in checked],
        wall_s=time.perf_counter() - started,
        native_context=target.card.native_context,
    )


def length_dependent(configuration: Configuration) -> bool:
    """Whether a configuration's positions depend on the total length, so that a long pass's
    prefix is not a short pass (`LENGTH_DEPENDENT_SCALINGS`, `LENGTH_DEPENDENT_ATTENTION`)."""
    scaling, attention = configuration
    return scaling.type in LENGTH_DEPENDENT_SCALINGS or (
        attention is not None and attention.type in LENGTH_DEPENDENT_ATTENTION
    )


def score_passes(
    configurations: Sequence[Configuration], lengths: Sequence[int]
) -> list[tuple[Configuration, int, list[int]]]:
    """The `/score` passes a grid needs, as (configuration, tokens scored, the cells' lengths it
    gives).

    `lengths` ascending. A configuration whose positions do not depend on the total length is one
    pass at the longest length giving every cell; a length-dependent one (`length_dependent`) is
    one pass per length.
    """
    passes: list[tuple[Configuration, int, list[int]]] = []
    for configuration in configurations:
        if length_dependent(configuration):
            passes.extend((configuration, length, [length]) for length in lengths)
        else:
            passes.append((configuration, lengths[-1], list(lengths)))
    return passes


def sweep(
    client: PEClient,
    *,
    text: str,
    lengths: Sequence[int],
    scalings: Sequence[ScalingSpec] | None = None,
    attentions: Sequence[AttentionSpec] | None = None,
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
            attentions=attentions,
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
    client: AsyncPEClient,
    target: ModelTarget,
    tokens: list[int],
    configuration: Configuration,
    lengths: list[int],
) -> list[SweepCell]:
    """One `/score` of `tokens` under `configuration`, and the cell of each length in `lengths`
    (each at most `len(tokens)`) read from its first tokens' log-probabilities."""
    request = ScoreRequest.model_validate({**target.request_fields(configuration), "tokens": tokens})
    response = await client.score(request)
    # token_logprobs[i] predicts token i; the first has no prefix, so logprobs[i - 1] is token i's.
    logprobs = [logprob for logprob in response.token_logprobs[1:] if logprob is not None]
    if len(logprobs) != len(tokens) - 1:
        raise PEServeError(f"/score returned {len(logprobs)} log-probabilities for {len(tokens)} tokens")
    scaling, attention = configuration
    native = target.card.native_context
    return [prefix_cell(logprobs, length, scaling, native, attention) for length in lengths]


def prefix_cell(
    logprobs: Sequence[float],
    length: int,
    scaling: PEScaling,
    native_context: int,
    attention: PEAttention | None = None,
) -> SweepCell:
    """The cell of the first `length` tokens from a pass's log-probabilities of tokens 2.. (natural
    log; at least `length - 1` of them): the mean over tokens 2..length, and over those past the
    native context (None when `length` does not pass it)."""
    prefix = logprobs[: length - 1]
    return SweepCell(
        length=length,
        scaling=scaling,
        attention=attention,
        tokens=length,
        bits_per_token=bits_per_token(prefix),
        tail_bits_per_token=bits_per_token(prefix[native_context - 1 :]) if length > native_context else None,
    )


def bits_per_token(logprobs: Sequence[float]) -> float:
    """Mean −log2 p of natural-log probabilities."""
    return -math.fsum(logprobs) / len(logprobs) / math.log(2)
