"""Passkey retrieval: a random number hidden at some depth of filler text, asked back under each scaling.

The haystack is the classic one (Mohtashami and Jaggi's landmark-attention test): repeated
sentences with nothing to learn from, so only attention to the needle can find the key. A model
with a chat template is asked through it (the server renders it: /tokenize with messages), a base
model through a completion prompt ending in "The pass key is"; both are then generated greedily
from the same token ids, so each prompt is exactly as long as the grid says.
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from pe_client._lab import checked_card, gather_all, run_with_twin
from pe_client.async_client import AsyncPEClient
from pe_client.client import PEClient
from pe_client.grid import GridError, ScalingSpec, parse_specs
from pe_client.scaling import PEScaling
from pe_client.types import ChatMessage, GenerateRequest

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
COMPLETION_QUESTION = "What is the pass key? The pass key is"
CHAT_QUESTION = "What is the pass key? Answer with the number only."
# Enough for a five-digit key after a short preamble ("The pass key is 12345.") in any tokenizer.
ANSWER_TOKENS = 16
# Filler repetitions of the first measurement, from which the tokens per repetition are read.
_PROBE_REPEATS = 32


class PasskeyCell(BaseModel):
    """How many of `trials` keys the model gave back at this length, depth and scaling."""

    model_config = ConfigDict(frozen=True)

    length: int
    depth: float
    scaling: PEScaling
    trials: int
    correct: int

    @field_serializer("scaling")
    def _scaling_as_sent(self, scaling: PEScaling) -> dict[str, object]:
        """The fields the request set, as in the SPEC's JSON (unset ones are the server's defaults)."""
        return scaling.model_dump(mode="json", exclude_none=True)


class PasskeyResult(BaseModel):
    """Cells in grid order (scaling, then length, then depth); `model`, `chat` and `wall_s` are not
    part of the JSON the CLI prints."""

    model_config = ConfigDict(frozen=True)

    cells: list[PasskeyCell]
    model: str = Field(exclude=True)
    chat: bool = Field(exclude=True)
    wall_s: float = Field(exclude=True)


@dataclass(frozen=True)
class _Probe:
    """One prompt: its place in the grid, its key and its token ids."""

    length: int
    depth: float
    key: int
    tokens: list[int]


async def async_passkey(
    client: AsyncPEClient,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    scalings: Sequence[ScalingSpec],
    model: str | None = None,
    trials: int = 1,
    seed: int = 0,
    concurrency: int | None = None,
    on_cell: Callable[[bool], None] | None = None,
) -> PasskeyResult:
    """Ask for a hidden key at every (length, depth), `trials` keys each, under every scaling.

    A prompt of length L holds L − 16 tokens (room for the answer within `max_context`); depth 0
    puts the key at the start of the filler, 1 at its end. The same keys are asked under every
    scaling, drawn from `seed`. The grid is checked before any prompt is built (GridError).
    `on_cell` is called with each answer's correctness as it arrives.
    """
    grid = parse_specs(scalings)
    if trials < 1:
        raise GridError(f"trials must be at least 1, got {trials}")
    if not depths or any(not 0.0 <= depth <= 1.0 for depth in depths):
        raise GridError(f"depths must lie between 0 and 1, got {list(depths)}")
    card, checked = await checked_card(client, model, lengths, grid)
    if checked[0] <= ANSWER_TOKENS * 2:
        raise GridError(
            f"length {checked[0]} leaves no room for a haystack (at least {ANSWER_TOKENS * 2 + 1})"
        )
    chat = (await client.tokenizer_info(card.name)).chat_template is not None
    build = _PromptBuilder(client, card.name, chat)
    draw = random.Random(seed)
    probes = [
        await build.probe(length, depth, draw.randrange(10_000, 100_000))
        for length in checked
        for depth in depths
        for _ in range(trials)
    ]
    started = time.perf_counter()

    def job(probe: _Probe, scaling: PEScaling) -> Callable[[], Awaitable[bool]]:
        return lambda: _answer(client, card.name, probe, scaling)

    asked = [(index, probe) for index in range(len(grid)) for probe in probes]
    answers = await gather_all(
        [job(probe, grid[index]) for index, probe in asked], concurrency=concurrency, on_done=on_cell
    )
    correct: Counter[tuple[int, int, float]] = Counter()
    for (index, probe), found in zip(asked, answers, strict=True):
        correct[index, probe.length, probe.depth] += found
    cells = [
        PasskeyCell(
            length=length,
            depth=depth,
            scaling=scaling,
            trials=trials,
            correct=correct[index, length, depth],
        )
        for index, scaling in enumerate(grid)
        for length in checked
        for depth in depths
    ]
    return PasskeyResult(cells=cells, model=card.name, chat=chat, wall_s=time.perf_counter() - started)


def passkey(
    client: PEClient,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    scalings: Sequence[ScalingSpec],
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
            model=model,
            trials=trials,
            seed=seed,
            concurrency=concurrency,
            on_cell=on_cell,
        ),
    )


class _PromptBuilder:
    """Token ids of haystack prompts, sized to a length with the server's own tokenizer."""

    def __init__(self, client: AsyncPEClient, model: str, chat: bool) -> None:
        self._client = client
        self._model = model
        self._chat = chat
        self._tokens_per_repeat: float | None = None

    async def probe(self, length: int, depth: float, key: int) -> _Probe:
        """The longest prompt of at most `length − ANSWER_TOKENS` tokens with the key at `depth`."""
        budget = length - ANSWER_TOKENS
        empty = len(await self._tokens(0, depth, key))
        per_repeat = await self._per_repeat(depth, key, empty)
        repeats = max(0, int((budget - empty) / per_repeat))
        while True:
            tokens = await self._tokens(repeats, depth, key)
            if len(tokens) <= budget or repeats == 0:
                break
            repeats -= max(1, int((len(tokens) - budget) / per_repeat))
        if len(tokens) > budget:
            raise GridError(f"length {length} is too short for the passkey prompt ({len(tokens)} tokens)")
        return _Probe(length, depth, key, tokens)

    async def _per_repeat(self, depth: float, key: int, empty: int) -> float:
        if self._tokens_per_repeat is None:
            probe = len(await self._tokens(_PROBE_REPEATS, depth, key))
            self._tokens_per_repeat = max(1.0, (probe - empty) / _PROBE_REPEATS)
        return self._tokens_per_repeat

    async def _tokens(self, repeats: int, depth: float, key: int) -> list[int]:
        before = round(repeats * depth)
        haystack = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (repeats - before)
        if self._chat:
            message = ChatMessage(role="user", content=f"{haystack}\n{CHAT_QUESTION}")
            return await self._client.tokenize(messages=[message], model=self._model)
        return await self._client.tokenize(haystack + COMPLETION_QUESTION, model=self._model)


async def _answer(client: AsyncPEClient, model: str, probe: _Probe, scaling: PEScaling) -> bool:
    """Whether the first number of the greedy answer is the key."""
    generation = await client.generate(
        GenerateRequest(
            tokens=probe.tokens,
            model=model,
            pe_scaling=scaling,
            max_new_tokens=ANSWER_TOKENS,
            temperature=0.0,
        )
    )
    first_number = re.search(r"\d+", generation.text)
    return first_number is not None and int(first_number.group()) == probe.key
