"""Passkey retrieval: a random number hidden at some depth of filler text, asked back under each
configuration (scaling, and attention rule when one is given).

The haystack is the classic one (Mohtashami and Jaggi's landmark-attention test): repeated
sentences with nothing to learn from, so only attention to the needle can find the key. Each trial
has its own key and its own filler (the sentences of every line in an order drawn for it), both
drawn from the seed; trial i's filler is the same text in every cell, so the prompts that share it
go to the server one after another, the one with the most filler before its key first, and the
server's prefix cache computes that filler once. A model with a chat template is asked through
it (the server renders it: /tokenize with messages), a base model through a completion prompt
ending in "The pass key is"; both are then generated greedily from the same token ids, so each
prompt is exactly as long as the grid says. A cell reports how many of its trials found the key
and the 95% Wilson score interval of that share, which stays inside 0..1 and is honest at a
handful of trials.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, computed_field

from pe_client._lab import SentAttention, SentScaling, checked_target, gather_all, greedy_text, run_with_twin
from pe_client.async_client import AsyncPEClient
from pe_client.client import PEClient
from pe_client.grid import AttentionSpec, Configuration, GridError, ModelTarget, ScalingSpec, check_grid
from pe_client.haystack import noise_lines
from pe_client.types import ChatMessage

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
COMPLETION_QUESTION = "What is the pass key? The pass key is"
CHAT_QUESTION = "What is the pass key? Answer with the number only."
# Enough for a five-digit key after a short preamble ("The pass key is 12345.") in any tokenizer.
ANSWER_TOKENS = 16
# Filler repetitions of the first measurement, from which the tokens per repetition are read.
_PROBE_REPEATS = 32
_KEYS = range(10_000, 100_000)
# The normal quantile of a two-sided 95% interval.
_Z_95 = 1.959963984540054


def wilson_interval(successes: int, trials: int, z: float = _Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial share (95% by default).

    Unlike the normal approximation it never leaves 0..1 and does not collapse to a point at 0 or
    all successes, which is where a passkey cell with a few trials usually is.
    """
    share = successes / trials
    spread = z * z / trials
    centre = (share + spread / 2) / (1 + spread)
    half = z * math.sqrt(share * (1 - share) / trials + spread / (4 * trials)) / (1 + spread)
    # At none or all found the bound is exactly 0 or 1; the subtraction would leave a rounding error.
    low = 0.0 if successes == 0 else centre - half
    high = 1.0 if successes == trials else centre + half
    return low, high


class PasskeyCell(BaseModel):
    """How many of `trials` keys the model gave back at this length, depth and configuration;
    `interval` is the 95% Wilson score interval of the share found."""

    model_config = ConfigDict(frozen=True)

    length: int
    depth: float
    scaling: SentScaling
    attention: SentAttention = None
    trials: int
    correct: int

    @computed_field  # type: ignore[prop-decorator]
    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.correct, self.trials)


class PasskeyResult(BaseModel):
    """Cells in grid order (configuration, then length, then depth); `model` (the name the requests
    carried), `chat` and `wall_s` are not part of the JSON the CLI prints."""

    model_config = ConfigDict(frozen=True)

    cells: list[PasskeyCell]
    model: str = Field(exclude=True)
    chat: bool = Field(exclude=True)
    wall_s: float = Field(exclude=True)


@dataclass(frozen=True)
class _Trial:
    """One trial's draws: the key, and the seed of its filler's sentence orders."""

    key: int
    filler_seed: int


@dataclass(frozen=True)
class _Probe:
    """One prompt: its place in the grid, its key, its token ids, which trial of its cell it is
    and how many filler lines precede its key (those it shares with the trial's other prompts)."""

    length: int
    depth: float
    key: int
    tokens: list[int]
    trial: int
    filler_before: int


async def async_passkey(
    client: AsyncPEClient,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    scalings: Sequence[ScalingSpec] | None = None,
    attentions: Sequence[AttentionSpec] | None = None,
    model: str | None = None,
    trials: int = 1,
    seed: int = 0,
    concurrency: int | None = None,
    on_cell: Callable[[bool], None] | None = None,
) -> PasskeyResult:
    """Ask for a hidden key at every (length, depth), `trials` keys each, under every configuration.

    A prompt of length L holds L − 16 tokens (room for the answer within `max_context`); depth 0
    puts the key at the start of the filler, 1 at its end. Each trial's key (distinct within a
    cell) and filler are drawn from `seed`, and the same prompts are asked under every
    configuration: each scaling crossed with each attention rule (`attentions`, SPECs or typed
    rules; None sends no `pe_attention`). `model` may carry the scaling or the rule in its name
    (`NAME@SPEC`, an `--alias` name), which then stands for `scalings` or `attentions`. The grid is
    checked before any prompt is built (GridError). `on_cell` is called with each answer's
    correctness as it arrives.

    The prompts of one configuration and trial share their filler, so they go one after another
    (a chain, most filler before the key first: the server's prefix cache then holds the filler
    each later prompt starts with); the chains run together, at most `concurrency` at once.
    """
    check_grid(scalings, attentions, model)
    if trials < 1:
        raise GridError(f"trials must be at least 1, got {trials}")
    if not depths or any(not 0.0 <= depth <= 1.0 for depth in depths):
        raise GridError(f"depths must lie between 0 and 1, got {list(depths)}")
    target, grid, checked = await checked_target(client, model, lengths, scalings, attentions)
    card = target.card
    if checked[0] <= ANSWER_TOKENS * 2:
        raise GridError(
            f"length {checked[0]} leaves no room for a haystack (at least {ANSWER_TOKENS * 2 + 1})"
        )
    chat = (await client.tokenizer_info(card.name)).chat_template is not None
    build = _PromptBuilder(client, card.name, chat)
    draw = random.Random(seed)
    fillers = [draw.getrandbits(32) for _ in range(trials)]
    probes = [
        await build.probe(length, depth, trial, _Trial(key, fillers[trial]))
        for length in checked
        for depth in depths
        for trial, key in enumerate(draw.sample(_KEYS, trials))
    ]
    started = time.perf_counter()
    chains = [
        (index, sorted((probe for probe in probes if probe.trial == trial), key=_most_filler_first))
        for index in range(len(grid))
        for trial in range(trials)
    ]

    def job(configuration: Configuration, chain: list[_Probe]) -> Callable[[], Awaitable[list[bool]]]:
        async def ask_in_turn() -> list[bool]:
            found = []
            for probe in chain:
                found.append(await _answer(client, target, probe, configuration))
                if on_cell is not None:
                    on_cell(found[-1])
            return found

        return ask_in_turn

    answers = await gather_all(
        [job(grid[index], chain) for index, chain in chains], concurrency=concurrency, on_done=None
    )
    correct: Counter[tuple[int, int, float]] = Counter()
    for (index, chain), found in zip(chains, answers, strict=True):
        for probe, key_found in zip(chain, found, strict=True):
            correct[index, probe.length, probe.depth] += key_found
    cells = [
        PasskeyCell(
            length=length,
            depth=depth,
            scaling=scaling,
            attention=attention,
            trials=trials,
            correct=correct[index, length, depth],
        )
        for index, (scaling, attention) in enumerate(grid)
        for length in checked
        for depth in depths
    ]
    return PasskeyResult(cells=cells, model=target.name, chat=chat, wall_s=time.perf_counter() - started)


def passkey(
    client: PEClient,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    scalings: Sequence[ScalingSpec] | None = None,
    attentions: Sequence[AttentionSpec] | None = None,
    model: str | None = None,
    trials: int = 1,
    seed: int = 0,
    concurrency: int | None = None,
    on_cell: Callable[[bool], None] | None = None,
) -> PasskeyResult:
    """`async_passkey` for a blocking caller (the prompts still go out together)."""
    return run_with_twin(
        client,
        lambda twin: async_passkey(
            twin,
            lengths=lengths,
            depths=depths,
            scalings=scalings,
            attentions=attentions,
            model=model,
            trials=trials,
            seed=seed,
            concurrency=concurrency,
            on_cell=on_cell,
        ),
    )


def _most_filler_first(probe: _Probe) -> tuple[int, int]:
    """A chain's order: each prompt's filler before its key is then a prefix of the first's."""
    return -probe.filler_before, -probe.length


class _PromptBuilder:
    """Token ids of haystack prompts, sized to a length with the server's own tokenizer."""

    def __init__(self, client: AsyncPEClient, model: str, chat: bool) -> None:
        self._client = client
        self._model = model
        self._chat = chat
        self._tokens_per_repeat: float | None = None

    async def probe(self, length: int, depth: float, index: int, trial: _Trial) -> _Probe:
        """The longest prompt of at most `length − ANSWER_TOKENS` tokens with the key at `depth`
        (trial `index` of its cell)."""
        budget = length - ANSWER_TOKENS
        empty = len(await self._tokens(0, depth, trial))
        per_repeat = await self._per_repeat(depth, trial, empty)
        repeats = max(0, int((budget - empty) / per_repeat))
        while True:
            tokens = await self._tokens(repeats, depth, trial)
            if len(tokens) <= budget or repeats == 0:
                break
            repeats -= max(1, int((len(tokens) - budget) / per_repeat))
        if len(tokens) > budget:
            raise GridError(f"length {length} is too short for the passkey prompt ({len(tokens)} tokens)")
        return _Probe(length, depth, trial.key, tokens, index, _before(repeats, depth))

    async def _per_repeat(self, depth: float, trial: _Trial, empty: int) -> float:
        if self._tokens_per_repeat is None:
            probe = len(await self._tokens(_PROBE_REPEATS, depth, trial))
            self._tokens_per_repeat = max(1.0, (probe - empty) / _PROBE_REPEATS)
        return self._tokens_per_repeat

    async def _tokens(self, repeats: int, depth: float, trial: _Trial) -> list[int]:
        lines = noise_lines(trial.filler_seed, repeats)
        before = _before(repeats, depth)
        haystack = "".join([INTRO, *lines[:before], NEEDLE.format(key=trial.key), *lines[before:]])
        if self._chat:
            message = ChatMessage(role="user", content=f"{haystack}\n{CHAT_QUESTION}")
            return await self._client.tokenize(messages=[message], model=self._model)
        return await self._client.tokenize(haystack + COMPLETION_QUESTION, model=self._model)


def _before(repeats: int, depth: float) -> int:
    """How many filler lines come before the key."""
    return round(repeats * depth)


async def _answer(
    client: AsyncPEClient, target: ModelTarget, probe: _Probe, configuration: Configuration
) -> bool:
    """Whether the first number of the greedy answer is the key."""
    text = await greedy_text(
        client, target=target, tokens=probe.tokens, configuration=configuration, max_new_tokens=ANSWER_TOKENS
    )
    first_number = re.search(r"\d+", text)
    return first_number is not None and int(first_number.group()) == probe.key
