"""`StepBudget`: how much prompt and scoring work a step may do, from the time its parts took.

The rule is checked with given timings (tests never depend on the machine's speed), then on a real
core: with a time rule that allows almost nothing, long prompts beside a stream still advance and
generate what they generate read in one pass.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from service.engine.budget import IDLE_BUDGET_FACTOR, MIN_STEP_UNITS, StepBudget
from service.engine.catalog import ModelCatalog
from service.engine.core import EngineCore, Job
from service.engine.engine import load_models
from service.engine.types import GenerationRequest, GenerationResult, SamplingParams
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


def test_with_no_stream_decoding_the_token_budget_alone_applies() -> None:
    """Nobody watches the gaps of a non-streamed request; bigger chunks shorten its total time."""
    assert timed_budget().allowance(0.004, streaming=False) == 192


def test_the_speed_estimate_follows_recent_chunks_that_filled_their_allowance() -> None:
    budget = timed_budget()
    budget.observe(48, 0.024, allowance=60)  # deep in a long prompt: 0.5 ms a unit
    assert budget.seconds_per_unit == pytest.approx(0.5 * 0.000125 + 0.5 * 0.0005)
    assert budget.allowance(0.004, streaming=True) == int(0.012 / 0.0003125)
    budget.observe(5, 0.010, allowance=96)  # a prompt's last 5 tokens: the pass's fixed cost, not its speed
    budget.observe(0, 0.5, allowance=96)  # a step whose chunks all failed teaches nothing
    assert budget.seconds_per_unit == pytest.approx(0.0003125)


def test_a_step_always_advances_prompts_by_a_few_units() -> None:
    budget = StepBudget(192, 3.0)
    budget.observe(20, 1.0, allowance=20)
    assert budget.allowance(0.001, streaming=True) == MIN_STEP_UNITS
    assert StepBudget(8, 3.0).allowance(0.001, streaming=True) == 8  # never above the token budget


def test_slowdown_zero_is_the_token_budget_alone() -> None:
    assert timed_budget(64, 0.0).allowance(0.001, streaming=True) == 64


def test_prompts_read_under_a_tight_time_rule_generate_what_one_pass_does(
    make_tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    """A stream decodes while two long prompts are read a few units per step: they finish, and
    every request's tokens are those of a core that read each prompt in one pass."""
    directory: Path = make_tiny_checkpoint("rope", name="budgeted", native_context=16)
    models = load_models([directory], device="cpu", dtype="float32")
    catalog = ModelCatalog([served.spec for served in models])
    prompts = [(256, 1, 2, 3), tuple(range(120)), tuple((5 * i) % 256 for i in range(200))]

    def generate(core: EngineCore) -> tuple[dict[int, tuple[int, ...]], int]:
        for key, prompt in enumerate(prompts):
            sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
            job = GenerationRequest(f"r{key}", "budgeted", prompt, sampling, stream=True)
            core.add(Job(key, job, catalog.validate(job), time.perf_counter()))
            core.step()  # the first prompt decodes before the long ones arrive
        results: dict[int, tuple[int, ...]] = {}
        steps = len(prompts)
        while core.has_work():
            results.update(
                (key, item.tokens) for key, item in core.step().events if isinstance(item, GenerationResult)
            )
            steps += 1
        return results, steps

    tight, tight_steps = generate(EngineCore(models, step_token_budget=192, prefill_slowdown=1e-9))
    whole, whole_steps = generate(EngineCore(models, step_token_budget=4096, prefill_slowdown=0.0))
    assert tight == whole and len(tight) == len(prompts)
    assert tight_steps > whole_steps + 10  # the long prompts took many steps of MIN_STEP_UNITS each
