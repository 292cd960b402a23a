"""The step token budget: how wide a prompt or scoring chunk may be at a given context length.

A chunk's time grows with the keys each of its queries attends to, not only with its tokens: on
two CPU cores, 252 prompt tokens of the zoo RoPE model took 28 ms at the start of a prompt and 100
ms at 3,500 tokens of context. The budget therefore prices a token at key length `c` as
`1 + c / ATTENTION_SPAN` tokens, so a step's chunk takes about the same time anywhere in a long
prompt and running streams see the same gap between tokens.
"""

from __future__ import annotations

import math

ATTENTION_SPAN = 1024
# Tokens of prompt and scoring chunks one step may run besides its decode rows (`--step-token-budget`).
# Small enough that a step over a zoo model stays within a few decode steps' time on two CPU cores
# (the longest gap running streams see while a long prompt is read: at 256, a 4,000-token /score
# stretched the gap to 5.4x the p99 gap without it, bench/results/serving.md), large enough that
# prompts are still read in efficient matrix products.
DEFAULT_STEP_TOKEN_BUDGET = 192


def chunk_width(budget: int, rows: int, past: int) -> int:
    """The widest chunk (at least 1) whose `rows` x width tokens, after `past` cached ones, fit."""
    # rows * w * (1 + (past + w) / S) <= budget, solved for w.
    linear = 1.0 + past / ATTENTION_SPAN
    per_row = budget / rows
    width = (math.sqrt(linear * linear + 4.0 * per_row / ATTENTION_SPAN) - linear) * ATTENTION_SPAN / 2.0
    return max(1, int(width))


def chunk_cost(rows: int, width: int, past: int) -> int:
    """What a chunk of `rows` x `width` tokens after `past` cached ones takes from the budget."""
    return math.ceil(rows * width * (1.0 + (past + width) / ATTENTION_SPAN))
