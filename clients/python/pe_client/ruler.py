"""RULER on a resident model: synthetic long-context tasks scored by length under every configuration.

The samples (`pe_client.ruler_tasks`) are generated here, offline, and each is fitted to its length
in the model's own tokens through the server's `/tokenize` (with the chat template when the model
has one), so a prompt is within 10% of its length and its answer still fits `max_context`. The
same prompts are then asked under each (scaling, attention rule) configuration, all at once so the
server batches them, answered greedily, and scored by RULER's `string_match_all`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from pe_client._lab import SentAttention, SentScaling, checked_target, gather_all, greedy_text, run_with_twin
from pe_client.async_client import AsyncPEClient
from pe_client.client import PEClient
from pe_client.grid import AttentionSpec, Configuration, GridError, ScalingSpec, check_grid
from pe_client.haystack import NOISE, Haystack
from pe_client.ruler_tasks import (
    TASKS,
    Fitted,
    TaskPrompt,
    answer_tokens,
    check_tasks,
    fit,
    recipe,
    string_match_all,
)
from pe_client.types import ChatMessage, ModelInfo

# A prompt has at least this share of its length in tokens (and never more than the length).
MIN_FILL = 0.9


class RulerCell(BaseModel):
    """One (task, length, configuration): the mean `string_match_all` of its samples, 0..1."""

    model_config = ConfigDict(frozen=True)

    task: str
    length: int
    scaling: SentScaling
    attention: SentAttention = None
    samples: int
    score: float


class RulerSample(BaseModel):
    """One answered sample, as `--dump` writes it: the prompt sent (the chat message for a chat
    model), its length in tokens, the expected answers and the greedy output."""

    model_config = ConfigDict(frozen=True)

    task: str
    length: int
    scaling: SentScaling
    attention: SentAttention = None
    prompt: str
    prompt_tokens: int
    answers: list[str]
    output: str


class RulerResult(BaseModel):
    """Cells in grid order (configuration, then task, then length); `samples` (the same order,
    samples innermost) and `chat` are not part of the JSON the CLI prints."""

    model_config = ConfigDict(frozen=True)

    model: str
    cells: list[RulerCell]
    wall_s: float
    samples: list[RulerSample] = Field(exclude=True)
    chat: bool = Field(exclude=True)


@dataclass(frozen=True)
class _Prompt:
    """A fitted sample ready to ask: where it belongs, the task's prompt, and the text and token
    ids sent for it (chat or completion form)."""

    task: str
    length: int
    task_prompt: TaskPrompt
    text: str
    tokens: list[int]


async def async_ruler(
    client: AsyncPEClient,
    *,
    lengths: Sequence[int],
    tasks: Sequence[str] = TASKS,
    samples: int = 10,
    scalings: Sequence[ScalingSpec] | None = None,
    attentions: Sequence[AttentionSpec] | None = None,
    model: str | None = None,
    seed: int = 0,
    haystack: str | None = None,
    concurrency: int | None = None,
    on_sample: Callable[[RulerSample], None] | None = None,
) -> RulerResult:
    """Score `samples` samples of every task at every length under every configuration.

    `tasks` are names from `TASKS`; `haystack` is the filler text of the needle and variable
    tasks (None: RULER's noise); each scaling (None: `none`) is crossed with each attention rule
    (`attentions`, SPECs or typed rules; None sends no `pe_attention`). `model` may carry the
    scaling or the rule in its name (`NAME@SPEC`, an `--alias` name), which then stands for
    `scalings` or `attentions`. Samples are drawn from `seed`, the same for every configuration.
    The grid is checked before any request but GET /models (and GET /v1/models for an alias)
    (GridError): tasks, SPECs, lengths against `max_context` and the room each task's answer needs. All
    prompts are fitted before the first generation. `on_sample` is called as each answer arrives.

    A needle or variable task's prompts of one length share their haystack up to their first
    item, so under each configuration they go one after another (a chain, most shared haystack
    first: the server's prefix cache then holds what each later prompt opens with); the chains and
    the other samples run together, at most `concurrency` at once.
    """
    checked_tasks = check_tasks(tasks)
    if samples < 1:
        raise GridError(f"samples must be at least 1, got {samples}")
    check_grid(scalings, attentions, model)
    filler = Haystack(NOISE if haystack is None else haystack)
    target, grid, checked = await checked_target(
        client, model, lengths, scalings, attentions, default_scalings=("none",)
    )
    card = target.card
    budgets = {(task, length): _budget(task, length, card) for task in checked_tasks for length in checked}
    chat = (await client.tokenizer_info(card.name)).chat_template is not None

    async def measure(prompt: TaskPrompt) -> list[int]:
        if chat:
            message = ChatMessage(role="user", content=prompt.chat_text)
            return await client.tokenize(messages=[message], model=card.name)
        return await client.tokenize(prompt.completion_text, model=card.name)

    def fit_group(task: str, length: int) -> Callable[[], Awaitable[list[_Prompt]]]:
        async def run() -> list[_Prompt]:
            prompts: list[_Prompt] = []
            previous: Fitted | None = None
            for index in range(samples):
                sample = recipe(task, seed=seed, length=length, index=index, haystack=filler)
                try:
                    fitted = await fit(
                        sample,
                        measure,
                        budgets[task, length],
                        start=0 if previous is None else previous.size,
                        tokens_per_unit=1.0 if previous is None else previous.tokens_per_unit,
                    )
                except GridError as exc:
                    raise GridError(f"{task} at length {length}: {exc}") from exc
                _check_fill(task, length, len(fitted.tokens))
                prompt = fitted.prompt
                text = prompt.chat_text if chat else prompt.completion_text
                prompts.append(_Prompt(task, length, prompt, text, fitted.tokens))
                previous = fitted
            return prompts

        return run

    groups = await gather_all(
        [fit_group(task, length) for task in checked_tasks for length in checked],
        concurrency=concurrency,
        on_done=None,
    )
    prompts = [prompt for group in groups for prompt in group]
    started = time.perf_counter()

    async def ask(prompt: _Prompt, configuration: Configuration) -> RulerSample:
        output = await greedy_text(
            client,
            target=target,
            tokens=prompt.tokens,
            configuration=configuration,
            max_new_tokens=answer_tokens(prompt.task),
        )
        scaling, attention = configuration
        sample = RulerSample(
            task=prompt.task,
            length=prompt.length,
            scaling=scaling,
            attention=attention,
            prompt=prompt.text,
            prompt_tokens=len(prompt.tokens),
            answers=list(prompt.task_prompt.answers),
            output=output,
        )
        if on_sample is not None:
            on_sample(sample)
        return sample

    def job(chain: list[int], configuration: Configuration) -> Callable[[], Awaitable[list[RulerSample]]]:
        async def ask_in_turn() -> list[RulerSample]:
            return [await ask(prompts[index], configuration) for index in chain]

        return ask_in_turn

    chains = _chains(prompts)
    jobs = [(index, chain) for index in range(len(grid)) for chain in chains]
    answers = await gather_all(
        [job(chain, grid[index]) for index, chain in jobs], concurrency=concurrency, on_done=None
    )
    asked: dict[tuple[int, int], RulerSample] = {}
    for (index, chain), chain_answers in zip(jobs, answers, strict=True):
        asked.update(((index, prompt), sample) for prompt, sample in zip(chain, chain_answers, strict=True))
    answered = [asked[index, prompt] for index in range(len(grid)) for prompt in range(len(prompts))]
    return RulerResult(
        model=target.name,
        cells=_cells(grid, answered),
        wall_s=time.perf_counter() - started,
        samples=answered,
        chat=chat,
    )


def ruler(
    client: PEClient,
    *,
    lengths: Sequence[int],
    tasks: Sequence[str] = TASKS,
    samples: int = 10,
    scalings: Sequence[ScalingSpec] | None = None,
    attentions: Sequence[AttentionSpec] | None = None,
    model: str | None = None,
    seed: int = 0,
    haystack: str | None = None,
    concurrency: int | None = None,
    on_sample: Callable[[RulerSample], None] | None = None,
) -> RulerResult:
    """`async_ruler` for a blocking caller (the prompts still go out together)."""
    return run_with_twin(
        client,
        lambda twin: async_ruler(
            twin,
            lengths=lengths,
            tasks=tasks,
            samples=samples,
            scalings=scalings,
            attentions=attentions,
            model=model,
            seed=seed,
            haystack=haystack,
            concurrency=concurrency,
            on_sample=on_sample,
        ),
    )


def _chains(prompts: Sequence[_Prompt]) -> list[list[int]]:
    """The prompts (by index) a configuration asks in turn. A task's prompts of one length that
    open with the same haystack go in one chain, most shared words first: the server's prefix cache
    then holds the opening each later one shares with the one before. A prompt that shares only
    its intro goes alone."""
    shared: defaultdict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    alone: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        if prompt.task_prompt.shared_words is None:
            alone.append([index])
        else:
            shared[prompt.task, prompt.length].append((-prompt.task_prompt.shared_words, index))
    return [[index for _, index in sorted(chain)] for chain in shared.values()] + alone


def _budget(task: str, length: int, card: ModelInfo) -> int:
    """The most tokens a prompt may have: its length, less what the answer needs past `max_context`."""
    budget = min(length, card.max_context - answer_tokens(task))
    if budget < math.ceil(MIN_FILL * length):
        raise GridError(
            f"length {length}: {task}'s answer takes up to {answer_tokens(task)} tokens, so a prompt "
            f"within {card.name}'s max_context {card.max_context} would be under 90% of the length"
        )
    return budget


def _check_fill(task: str, length: int, tokens: int) -> None:
    """A haystack whose words are very long tokens apart can leave a prompt short of its length."""
    if tokens < math.ceil(MIN_FILL * length):
        raise GridError(
            f"{task} at length {length}: the closest prompt has {tokens} tokens, under 90% of the length"
        )


def _cells(grid: Sequence[Configuration], answered: Sequence[RulerSample]) -> list[RulerCell]:
    """Each (configuration, task, length)'s mean score, in the order its samples were asked."""
    scores: dict[tuple[int, str, int], list[float]] = defaultdict(list)
    per_configuration = len(answered) // len(grid)
    for position, sample in enumerate(answered):
        key = (position // per_configuration, sample.task, sample.length)
        scores[key].append(string_match_all(sample.output, sample.answers))
    return [
        RulerCell(
            task=task,
            length=length,
            scaling=grid[index][0],
            attention=grid[index][1],
            samples=len(values),
            score=math.fsum(values) / len(values),
        )
        for (index, task, length), values in scores.items()
    ]
