"""`StepBudget` and `plan_chunk`: how much prompt and scoring work a step may do.

The rules are checked with given timings (tests never depend on the machine's speed), then on a
real core: with a time rule that allows almost nothing, chunks are spread over steps a layer at a
time, and long prompts and documents beside a stream still give what one pass gives, also when a
row of a spread chunk is cancelled half-way.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from torch import Tensor

from service.engine.budget import (
    IDLE_BUDGET_FACTOR,
    MIN_CHUNK_UNITS,
    MIN_ROW_WIDTH,
    StepBudget,
    chunk_cost,
    chunk_width,
    plan_chunk,
    rows_per_chunk,
)
from service.engine.catalog import ModelCatalog
from service.engine.core import EngineCore, Job
from service.engine.engine import load_models
from service.engine.errors import EngineError
from service.engine.runner import ModelRunner, PassRows
from service.engine.types import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    ScoreResult,
    ScoringRequest,
)
from service.model.paged_cache import PagedRows
from service.model.transformer import Stages
from tests.conftest import TinyCheckpointFactory


def timed_budget(tokens: int = 192, slowdown: float = 3.0) -> StepBudget:
    """A budget that has seen 192 units of chunks take 24 ms (0.125 ms a unit)."""
    budget = StepBudget(tokens, slowdown)
    budget.observe(192, 0.024, allowance=192)
    return budget


def test_with_nothing_timed_yet_a_decoding_step_spends_the_token_budget() -> None:
    assert StepBudget(192, 3.0).allowance(0.004, streaming=True) == 192


def test_with_no_row_decoding_a_step_may_spend_the_idle_budget() -> None:
    assert timed_budget().allowance(None, streaming=False) == 192 * IDLE_BUDGET_FACTOR


def test_beside_a_stream_chunks_are_held_to_the_slowdown_times_the_decode_pass() -> None:
    budget = timed_budget()
    assert budget.allowance(0.004, streaming=True) == 96  # 3 x 4 ms = 12 ms of chunks
    assert budget.allowance(0.016, streaming=True) == 192  # 48 ms would fit 384: the token budget caps it


def test_with_no_stream_decoding_a_step_may_spend_the_idle_budget() -> None:
    """Nobody watches the gaps of a non-streamed request; wider chunks shorten its total time."""
    assert timed_budget().allowance(0.004, streaming=False) == 192 * IDLE_BUDGET_FACTOR


def test_the_speed_estimate_follows_recent_chunks_that_filled_their_allowance() -> None:
    budget = timed_budget()
    budget.observe(48, 0.024, allowance=60)  # deep in a long prompt: 0.5 ms a unit
    assert budget.seconds_per_unit == pytest.approx(0.5 * 0.000125 + 0.5 * 0.0005)
    assert budget.allowance(0.004, streaming=True) == int(0.012 / 0.0003125)
    budget.observe(5, 0.010, allowance=96)  # a prompt's last 5 tokens: the pass's fixed cost, not its speed
    budget.observe(0, 0.5, allowance=96)  # a step whose chunks all failed teaches nothing
    assert budget.seconds_per_unit == pytest.approx(0.0003125)


def test_a_slow_chunk_leaves_a_step_at_least_one_unit() -> None:
    budget = StepBudget(192, 3.0)
    budget.observe(20, 1.0, allowance=20)
    assert budget.allowance(0.001, streaming=True) == 1
    assert StepBudget(8, 3.0).allowance(10.0, streaming=True) == 8  # never above the token budget


def test_a_chunk_within_the_allowance_runs_every_layer_in_one_step() -> None:
    plan = plan_chunk(192, rows=2, past=0, remaining=500, layers=4)
    assert plan.layers_per_step == 4 and plan.cost_per_step == plan.cost <= 192
    assert plan_chunk(192, rows=1, past=0, remaining=5, layers=4).width == 5  # no wider than the prompt


def test_below_the_smallest_chunk_the_pass_is_spread_over_steps() -> None:
    """Deep in a long context the smallest chunk costs more than the allowance: its layers are
    shared out so that each step takes about the allowance."""
    plan = plan_chunk(5, rows=1, past=3800, remaining=200, layers=4)
    assert plan.width == chunk_width(MIN_CHUNK_UNITS, 1, 3800) and plan.cost == chunk_cost(
        1, plan.width, 3800
    )
    assert plan.layers_per_step == 1 and plan.cost_per_step == -(-plan.cost // 4)
    assert plan_chunk(1, rows=1, past=3800, remaining=200, layers=4).layers_per_step == 1  # never below one
    assert plan_chunk(9, rows=1, past=3800, remaining=200, layers=4).layers_per_step == 2


def test_slowdown_zero_is_the_token_budget_alone() -> None:
    assert timed_budget(64, 0.0).allowance(0.001, streaming=True) == 64


def tight_and_whole_runs(
    directory: Path,
    jobs: list[GenerationRequest | ScoringRequest],
    cancel_at: tuple[int, int] | None = None,
) -> tuple[dict[int, object], dict[int, object], dict[int, int], dict[int, int]]:
    """Every job's final item on a core with a time rule that allows one unit a step, and on one that
    reads every prompt in one pass; and the step at which each job ended, in each. Job 0 (a
    stream) starts first, the others one step apart; `cancel_at` = (job, step) cancels that job
    at that step of the tight run."""
    models = load_models([directory], device="cpu", dtype="float32")
    reference = load_models([directory], device="cpu", dtype="float32")
    catalog = ModelCatalog([served.spec for served in models])

    def run(core: EngineCore, cancel: tuple[int, int] | None) -> tuple[dict[int, object], dict[int, int]]:
        finals: dict[int, object] = {}
        ended: dict[int, int] = {}
        steps = 0
        while steps < len(jobs) or core.has_work():
            if steps < len(jobs):
                core.add(Job(steps, jobs[steps], catalog.validate(jobs[steps]), time.perf_counter()))
            if cancel is not None and steps == cancel[1]:
                core.cancel(cancel[0])
            for key, item in core.step().events:
                if isinstance(item, GenerationResult | ScoreResult | EngineError):
                    finals[key], ended[key] = item, steps
            steps += 1
        return finals, ended

    tight, tight_ended = run(EngineCore(models, step_token_budget=192, prefill_slowdown=1e-9), cancel_at)
    whole, whole_ended = run(EngineCore(reference, step_token_budget=4096, prefill_slowdown=0.0), None)
    return tight, whole, tight_ended, whole_ended


def generation(key: int, prompt: tuple[int, ...], *, stream: bool = False) -> GenerationRequest:
    """A stream runs long (the time rule applies while it decodes); the others are short."""
    sampling = SamplingParams(max_new_tokens=100 if stream else 12, temperature=0.0, logprobs=True)
    return GenerationRequest(f"r{key}", "budgeted", prompt, sampling, stream=stream)


LONG_PROMPTS = [tuple(range(120)), tuple((5 * i) % 256 for i in range(200))]


@pytest.fixture(scope="module")
def four_layers(make_tiny_checkpoint: TinyCheckpointFactory) -> Path:
    directory: Path = make_tiny_checkpoint("rope", name="budgeted", native_context=16, n_layers=4)
    return directory


def assert_same_generations(first: object, second: object) -> None:
    assert isinstance(first, GenerationResult) and isinstance(second, GenerationResult)
    assert first.tokens == second.tokens
    assert first.logprobs is not None and second.logprobs is not None
    assert max(abs(a - b) for a, b in zip(first.logprobs, second.logprobs, strict=True)) <= 1e-4


def test_prompts_spread_over_steps_beside_a_stream_generate_what_one_pass_does(four_layers: Path) -> None:
    jobs: list[GenerationRequest | ScoringRequest] = [
        generation(0, (256, 1, 2, 3), stream=True),
        *(generation(key, prompt) for key, prompt in enumerate(LONG_PROMPTS, 1)),
    ]
    tight, whole, tight_ended, whole_ended = tight_and_whole_runs(four_layers, jobs)
    assert set(tight) == set(whole) == {0, 1, 2}
    for key in tight:
        assert_same_generations(tight[key], whole[key])
    # Read in one pass, the long prompts end 12 steps after they arrive; spread, a layer of a
    # smallest chunk per step, they take dozens of steps.
    assert whole_ended[2] <= 2 + 13 and tight_ended[2] > whole_ended[2] + 40


def test_a_short_prompt_is_not_held_behind_a_long_one(four_layers: Path) -> None:
    """Beside a stream, a step buys one row's chunk; a short prompt that arrives while a long one is
    being read takes the next chunk (the row with the least prompt left goes first), so it is
    answered before the long prompt, and both generate what one pass does."""
    jobs: list[GenerationRequest | ScoringRequest] = [
        generation(0, (256, 1, 2, 3), stream=True),
        generation(1, LONG_PROMPTS[1]),
        generation(2, (9, 8, 7)),
    ]
    tight, whole, tight_ended, _ = tight_and_whole_runs(four_layers, jobs)
    for key in (1, 2):
        assert_same_generations(tight[key], whole[key])
    # First come first served, the short one ended at step 28, after the long one (24).
    assert tight_ended[2] < tight_ended[1]


def test_a_document_spread_over_steps_scores_what_one_pass_does(four_layers: Path) -> None:
    document = ScoringRequest("doc", "budgeted", tuple((3 * i) % 256 for i in range(150)))
    tight, whole, _, _ = tight_and_whole_runs(four_layers, [generation(0, (256, 7), stream=True), document])
    spread, reference = tight[1], whole[1]
    assert isinstance(spread, ScoreResult) and isinstance(reference, ScoreResult)
    assert spread.token_logprobs[0] is None and reference.token_logprobs[0] is None
    pairs = zip(spread.token_logprobs[1:], reference.token_logprobs[1:], strict=True)
    assert max(abs(a - b) for a, b in pairs if a is not None and b is not None) <= 1e-4
    assert_same_generations(tight[0], whole[0])


def test_cancelling_a_row_of_a_spread_chunk_leaves_the_other_rows_exact(four_layers: Path) -> None:
    """After a short prompt has timed the chunks, two long prompts share spread chunks; one is
    cancelled half-way through a chunk (its blocks go back to the pool), and the other then
    generates exactly what it does alone."""
    jobs: list[GenerationRequest | ScoringRequest] = [
        generation(0, (256, 1, 2, 3), stream=True),
        generation(1, tuple(range(1, 110))),
        *(generation(key, prompt) for key, prompt in enumerate(LONG_PROMPTS, 2)),
    ]
    tight, whole, _, _ = tight_and_whole_runs(four_layers, jobs, cancel_at=(2, 10))
    assert isinstance(tight[2], GenerationResult) and tight[2].finish_reason == "cancelled"
    for key in (0, 1, 3):
        assert_same_generations(tight[key], whole[key])


def test_a_fault_half_way_through_a_spread_chunk_reruns_its_rows_alone_and_they_stay_exact(
    four_layers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every spread chunk raises after its first layer, as a kernel failure would: its rows are
    rerun alone (in one pass each) from their untouched caches and generate what they do in one
    pass. (A chunk is spread only when even the narrowest costs more than the step's allowance,
    which then buys one row: `rows_per_chunk`.)"""
    jobs: list[GenerationRequest | ScoringRequest] = [
        generation(0, (256, 1, 2, 3), stream=True),
        generation(1, tuple(range(1, 110))),
        *(generation(key, prompt) for key, prompt in enumerate(LONG_PROMPTS, 2)),
    ]
    faults: list[int] = []
    original = ModelRunner.stages

    def faulty(runner: ModelRunner, rows: PassRows, view: PagedRows) -> Stages[Tensor] | None:
        stages = original(runner, rows, view)
        if stages is None:
            return None

        def failing() -> Stages[Tensor]:
            next(stages)  # the first layer runs and writes its entries
            yield
            faults.append(len(rows))
            raise RuntimeError("planted fault")

        return failing()

    monkeypatch.setattr(ModelRunner, "stages", faulty)
    tight, whole, _, _ = tight_and_whole_runs(four_layers, jobs)
    assert faults and set(faults) == {1}
    for key in range(4):
        assert_same_generations(tight[key], whole[key])


def test_a_chunk_takes_the_rows_its_allowance_gives_a_useful_width() -> None:
    """Deep in long prompts, an allowance spread over every row would give each a few tokens, and
    each row's pass still reads its whole window: the chunk takes the first rows instead."""
    assert rows_per_chunk(1536, [0] * 15) == 15  # short contexts: every row, each wide enough
    deep = rows_per_chunk(1536, [10_000] * 15)
    assert 1 <= deep < 15
    assert chunk_width(1536, deep, 10_000) >= MIN_ROW_WIDTH
    assert rows_per_chunk(16, [10_000] * 15) == 1  # whatever the allowance, one row advances
    assert rows_per_chunk(10**9, [10_000] * 3) == 3
    # Rows are priced by the deepest row they take: shallow rows first, then the deep one alone.
    assert rows_per_chunk(1536, [0, 0, 10_000]) == 2


def test_a_long_prompt_is_not_starved_by_short_prompts_arriving_behind_it(four_layers: Path) -> None:
    """Beside a stream a chunk buys one row (spread over a few steps here), and the row with the
    least prompt left goes first: a short prompt arriving every step kept a long one waiting for as
    long as they came (it ended at step 113, after 25 of the 40). A row that `MAX_PASSED_OVER`
    chunks went past goes first: it ended at step 48, after 6; every generation stays what one pass
    gives."""
    shorts = range(2, 42)
    jobs: list[GenerationRequest | ScoringRequest] = [
        generation(0, (256, 1, 2, 3), stream=True),
        generation(1, LONG_PROMPTS[1]),
        *(generation(key, (key % 256, 7, 9)) for key in shorts),
    ]
    tight, whole, tight_ended, _ = tight_and_whole_runs(four_layers, jobs)
    for key in (1, *shorts):
        assert_same_generations(tight[key], whole[key])
    before = sum(tight_ended[key] < tight_ended[1] for key in shorts)
    assert before <= len(shorts) // 2, f"{before} short prompts ended before the long one"
