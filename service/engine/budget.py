"""The step token budget: how much prompt and scoring work one engine step may do besides decoding.

A chunk's time grows with the keys each of its queries attends to, not only with its tokens: on
two CPU cores, 252 prompt tokens of the zoo RoPE model took 28 ms at the start of a prompt and 100
ms at 3,500 tokens of context. The budget therefore prices a token at key length `c` as
`1 + c / ATTENTION_SPAN` units (`chunk_cost`), and a chunk is as wide as its units allow
(`chunk_width`).

How many units a step may spend is `StepBudget`'s rule: at most the token budget, and, while a
decoding row streams its tokens, at most what takes `slowdown` times the step's decode pass at the
speed chunks ran in recent steps. The pricing is one model for every device; the time rule
corrects it where it is off. Beside four streams on two CPU cores (4 ms a step), 192 units deep in
a 4,000-token prompt took 56 ms, a 15x gap in the streams; held to 2 decode passes, a step stays
within 3 (the serving bench's longest gap with a 4,000-token prompt or document arriving went
from 4.3-5.6x the streams' p99 gap to 3.2-4.2x; with 3 it was 3.8-5.1x). Where even the smallest
chunk (`MIN_CHUNK_UNITS`) costs more than the allowance, as a few tokens deep in a long context
do, `plan_chunk` spreads its pass over steps, a few layers each. A row that does not stream sees
no gap, only its total time, which big chunks shorten: with no stream decoding, neither the time
rule (it made the bench's 64 non-streamed requests 22-33% slower in-process) nor the token budget
applies, only `IDLE_BUDGET_FACTOR` times it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ATTENTION_SPAN = 1024
# The most units of prompt and scoring chunks one step runs besides its decode rows
# (`--step-token-budget`): large enough that prompts are read in efficient matrix products.
DEFAULT_STEP_TOKEN_BUDGET = 192
# A step's chunks may take this many times its decode pass (`--prefill-slowdown`; 0: no time rule).
DEFAULT_PREFILL_SLOWDOWN = 2.0
# With no row streaming its tokens, nobody watches the gaps between them, only total times, which
# wider chunks shorten: a step may take this many times the token budget (a burst of requests then
# starts in a step or two; in-process, the serving bench's 64 non-streamed requests finished in
# 21.7-21.9 s instead of 27.5-32.0 s with the token budget, and 64 short ones arriving 1 ms apart
# ran 5-10% faster).
IDLE_BUDGET_FACTOR = 8
# The smallest chunk a step plans, in units. A step allowed less runs such a chunk a few layers at a
# time over several steps (`ChunkPlan.layers_per_step`): deep in a long context even a few tokens
# cost a pass over every cached key, and a long prompt must still advance at a useful width.
MIN_CHUNK_UNITS = 16
# The narrowest chunk a prompt row is given while other rows wait: a row's pass reads every key it
# has cached, in every layer, however few tokens it adds, so rows given a few tokens each read
# their whole windows many times over. Fifteen 12,288-token prompts of SmolLM2 under Self-Extend
# sent at once (the pool admits eight), each advanced a few tokens per pass: eight answered in 26
# minutes (tests ran beside part of it). Rows beyond what the budget buys at this width wait their
# turn (`rows_per_chunk`), the rows with the least prompt left first: all fifteen in 13.5 minutes
# (one alone: 50 s), and a short prompt is not held behind a long one.
MIN_ROW_WIDTH = 64
# Least prompt left first would hold a long prompt back for as long as shorter ones keep arriving
# (beside a stream a chunk buys one row and may take a few steps): a prompt row that this many
# chunks went past goes first (`ModelBatch.prefill_chunk`), so it takes at least every third.
MAX_PASSED_OVER = 2
# Weight of the latest chunk's speed in the running estimate: recent steps, close in context length.
SPEED_SMOOTHING = 0.5


def chunk_width(budget: int, rows: int, past: int) -> int:
    """The widest chunk (at least 1) whose `rows` x width tokens, after `past` cached ones, fit."""
    # rows * w * (1 + (past + w) / S) <= budget, solved for w.
    linear = 1.0 + past / ATTENTION_SPAN
    per_row = budget / rows
    width = (math.sqrt(linear * linear + 4.0 * per_row / ATTENTION_SPAN) - linear) * ATTENTION_SPAN / 2.0
    return max(1, int(width))


def rows_per_chunk(allowance: int, pasts: Sequence[int]) -> int:
    """How many prompt rows, in the order of their cached lengths `pasts`, one chunk advances: as
    many as the allowance gives `MIN_ROW_WIDTH` tokens each, at least one."""
    taken = 1
    while taken < len(pasts) and chunk_cost(taken + 1, MIN_ROW_WIDTH, max(pasts[: taken + 1])) <= allowance:
        taken += 1
    return taken


def useful_chunk_cost(past: int, remaining: int) -> int:
    """The fewest units for which a prompt or document `past` tokens in, `remaining` to read, takes
    a turn after another chunk of the same step ran: `MIN_ROW_WIDTH` tokens (or what is left).

    The first chunk of a step takes what the allowance buys and leaves a few units; the next
    candidate, given those, read a few tokens over its whole cached context, on the eager pass
    spread over steps. Four 4,096-token documents of the zoo RoPE model scored at once took 9-11%
    more engine CPU than the same four one after another for such crumbs; now the next step gives
    the next candidate its turn."""
    return chunk_cost(1, min(MIN_ROW_WIDTH, remaining), past)


def chunk_cost(rows: int, width: int, past: int) -> int:
    """What a chunk of `rows` x `width` tokens after `past` cached ones takes from the budget."""
    return math.ceil(rows * width * (1.0 + (past + width) / ATTENTION_SPAN))


@dataclass(frozen=True)
class ChunkPlan:
    """A chunk of `rows` x `width` tokens whose pass costs `cost` units, run `layers_per_step`
    layers per step (every layer unless the step's allowance is below the chunk's cost)."""

    width: int
    cost: int
    layers_per_step: int
    layers: int

    @property
    def cost_per_step(self) -> int:
        return math.ceil(self.cost * self.layers_per_step / self.layers)


def plan_chunk(allowance: int, rows: int, past: int, remaining: int, layers: int) -> ChunkPlan:
    """The chunk a step's `allowance` buys for `rows` rows `past` tokens in, `remaining` to read."""
    width = min(remaining, chunk_width(max(allowance, MIN_CHUNK_UNITS), rows, past))
    cost = chunk_cost(rows, width, past)
    steps = min(layers, math.ceil(cost / max(allowance, 1)))
    return ChunkPlan(width, cost, max(1, layers // steps), layers)


class StepBudget:
    """The units each step's chunks may spend, learning from the time chunks took.

    The estimate is seconds per unit, smoothed over recent chunks; until a chunk was timed, or with
    `slowdown` 0, a step beside a stream spends the token budget.
    """

    def __init__(self, tokens: int, slowdown: float) -> None:
        self.tokens = tokens
        self.slowdown = slowdown
        self.seconds_per_unit: float | None = None

    def allowance(self, decode_seconds: float | None, *, streaming: bool) -> int:
        """Units for this step's chunks; `decode_seconds` is its decode pass, None when none ran,
        and `streaming` whether a row of that pass streams its tokens."""
        if decode_seconds is None or not streaming:
            return self.tokens * IDLE_BUDGET_FACTOR
        if not self.slowdown or self.seconds_per_unit is None:
            return self.tokens
        timed = int(self.slowdown * decode_seconds / self.seconds_per_unit)
        return max(1, min(self.tokens, timed))

    def observe(self, units: int, seconds: float, allowance: int) -> None:
        """Note that chunks of `units` in all took `seconds` when `allowance` units were allowed.

        Only chunks that filled most of their allowance count: a pass's fixed cost makes the last
        few tokens of a prompt look slow per unit, and counting them would shrink the chunks
        after them below an efficient size.
        """
        if units <= 0 or units < allowance // 2:
            return
        speed = seconds / units
        previous = self.seconds_per_unit
        self.seconds_per_unit = (
            speed if previous is None else SPEED_SMOOTHING * speed + (1.0 - SPEED_SMOOTHING) * previous
        )
