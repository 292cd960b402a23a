"""The sampling controls one by one (the documented rule, on logits we choose), then in the engine:
each does what it says on a real model, and mixed in one batch it never changes another row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from service.engine.sampler import Sampler, adjusted_logits, sample_rows
from service.engine.text_stream import TextStream
from service.engine.types import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    ScoreResult,
    ScoringRequest,
)
from service.tokenizers import ByteTokenizer
from tests.service.test_engine import alone, assert_same_generation, result_of, running_engine

LOGITS = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.0])
EOS = 1  # the argmax of LOGITS, so EOS is what greedy decoding picks unless something stops it
PROMPT = (256, 72, 101, 108, 108, 111, 44, 32)


def adjusted(
    params: SamplingParams, *, prompt: tuple[int, ...] = (), output: tuple[int, ...] = ()
) -> torch.Tensor:
    sampler = Sampler(params, prompt=prompt, eos_ids=(EOS,))
    adjusted_logits([sampler], LOGITS[None])  # allocates the penalty state as a step would
    for token in output:
        sampler.record(token)
    return adjusted_logits([sampler], LOGITS[None])[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    result = adjusted(SamplingParams(repetition_penalty=2.0), prompt=(1,), output=(2,))
    assert result.tolist() == pytest.approx([0.1, 2.0 / 2.0, -1.0 * 2.0, 1.5, 0.0])
    # Greedy now prefers token 3, as the rule says it must: 2.0 / 2 < 1.5.
    assert (
        Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=(1,)).sample(LOGITS)[0] == 3
    )


@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 5e-324])
def test_a_repetition_penalty_near_zero_saturates_instead_of_breaking_the_draw(penalty: float) -> None:
    """Found by `make fuzz`: a positive penalty that is 0 or subnormal in float32 divided a logit
    to inf, the draw's softmax turned it into NaN and the engine process died. The limit is the
    seen positive-logit tokens only, which tie."""
    sampler = Sampler(SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=4), prompt=(1, 3))
    assert {sampler.sample(LOGITS)[0] for _ in range(50)} == {1, 3}
    greedy = Sampler(SamplingParams(temperature=0.0, repetition_penalty=penalty), prompt=(1, 3))
    assert greedy.sample(LOGITS)[0] in (1, 3)


def test_a_row_left_with_no_token_gets_none_and_the_others_are_drawn_as_alone() -> None:
    every_token = tuple(range(len(LOGITS)))
    stuck = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=every_token, seed=1)
    sampled = SamplingParams(temperature=1.0, seed=2)

    def draws(params: list[SamplingParams]) -> list[list[int | None]]:
        samplers = [Sampler(p, eos_ids=(EOS,)) for p in params]
        steps = [sample_rows(samplers, LOGITS.expand(len(params), -1)) for _ in range(10)]
        return [[pick.token if pick else None for pick in step] for step in steps]

    together = draws([stuck, sampled])
    assert all(step[0] is None for step in together)
    assert [step[1] for step in together] == [step[0] for step in draws([sampled])]


def test_presence_and_frequency_penalties_follow_openai_over_output_tokens() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    result = adjusted(params, prompt=(0,), output=(3, 3, 4))
    expected = LOGITS - torch.tensor([0.0, 0.0, 0.0, 2 * 0.25 + 0.5, 0.25 + 0.5])
    assert result.tolist() == pytest.approx(expected.tolist())


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,)), eos_ids=(EOS,))
    picks = [sampler.sample(LOGITS)[0] for _ in range(3)]
    assert picks == [0, 0, EOS]  # 1 (EOS) and 3 (a stop token) are blocked for the first two


def test_ignore_eos_does_not_block_eos_it_only_stops_it_ending_the_sequence() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, ignore_eos=True, min_tokens=5), eos_ids=(EOS,))
    assert sampler.blocked_tokens() == ()


def test_min_p_keeps_tokens_at_least_that_fraction_of_the_most_likely() -> None:
    # p(3) / p(1) = e^-0.5 = 0.61 stays; p(0) / p(1) = e^-1.9 = 0.15 and lower go.
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=0))
    assert {sampler.sample(LOGITS)[0] for _ in range(200)} == {1, 3}


def test_top_logprobs_are_the_raw_distributions_best_sorted_with_the_chosen_token() -> None:
    raw = torch.log_softmax(LOGITS, -1)
    sampler = Sampler(SamplingParams(temperature=2.0, repetition_penalty=3.0, top_logprobs=3, seed=5))
    for _ in range(20):
        (pick,) = sample_rows([sampler], LOGITS[None])
        assert pick is not None and pick.top_logprobs is not None
        assert [entry.token for entry in pick.top_logprobs] == [1, 3, 0]
        assert [entry.logprob for entry in pick.top_logprobs] == pytest.approx(raw[[1, 3, 0]].tolist())
        if pick.token in (1, 3, 0):
            assert any(entry.token == pick.token for entry in pick.top_logprobs)


def test_rows_with_different_controls_in_one_call_get_what_each_gets_alone() -> None:
    settings = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=1.0, min_p=0.3, seed=3, top_logprobs=2),
        SamplingParams(temperature=0.0, min_tokens=3, presence_penalty=1.0, frequency_penalty=-0.5),
    ]
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 2, LOGITS - 1])

    def run(indices: list[int]) -> list[list[tuple[int, float]]]:
        samplers = [Sampler(settings[i], prompt=(1, 4), eos_ids=(EOS,)) for i in indices]
        steps = [[pick for pick in sample_rows(samplers, rows[indices]) if pick] for _ in range(5)]
        return [[(step[j].token, step[j].logprob) for step in steps] for j in range(len(indices))]

    together = run([0, 1, 2, 3])
    assert together == [run([i])[0] for i in range(4)]


# -- in the engine, on a real model ------------------------------------------------------------


def greedy(model: str, **sampling: Any) -> GenerationRequest:
    params = {"max_new_tokens": 12, "temperature": 0.0, "logprobs": True} | sampling
    return GenerationRequest(
        request_id="g", model=model, prompt_tokens=PROMPT, sampling=SamplingParams(**params)
    )


ZOO_ROPE = Path(__file__).resolve().parents[2] / "models" / "zoo-rope"
MODEL = "zoo-rope"  # trained, so greedy output is varied text rather than one repeated token


@pytest.fixture(scope="module")
def plain_dir() -> Path:
    return ZOO_ROPE


@pytest.fixture(scope="module")
def reference(plain_dir: Path) -> GenerationResult:
    with running_engine([plain_dir]) as engine:
        return alone(engine, greedy(MODEL))


@pytest.fixture(scope="module")
def eos_dir(tmp_path_factory: pytest.TempPathFactory, reference: GenerationResult) -> Path:
    """The same weights with EOS set to the token greedy decoding produces first."""
    directory = tmp_path_factory.mktemp("eos") / MODEL
    shutil.copytree(ZOO_ROPE, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"eos_id": reference.tokens[0]}))
    return directory


def test_eos_ends_a_generation_and_min_tokens_or_ignore_eos_carry_on(eos_dir: Path) -> None:
    with running_engine([eos_dir]) as engine:
        plain = alone(engine, greedy(MODEL))
        held = alone(engine, greedy(MODEL, min_tokens=6))
        ignored = alone(engine, greedy(MODEL, ignore_eos=True))
    eos = plain.tokens[0]
    assert (plain.finish_reason, len(plain.tokens)) == ("eos", 1)
    assert len(held.tokens) >= 6 and eos not in held.tokens[:6]
    assert (ignored.finish_reason, len(ignored.tokens)) == ("length", 12)


def test_a_stop_token_id_ends_the_generation_with_stop(plain_dir: Path, reference: GenerationResult) -> None:
    stop = reference.tokens[4]
    first = reference.tokens.index(stop)
    with running_engine([plain_dir]) as engine:
        result = alone(engine, greedy(MODEL, stop_token_ids=(stop,)))
    assert result.finish_reason == "stop"
    assert result.tokens == reference.tokens[: first + 1]


def test_repetition_penalty_changes_greedy_output_and_never_the_raw_logprobs(
    plain_dir: Path, reference: GenerationResult
) -> None:
    with running_engine([plain_dir]) as engine:
        penalized = alone(engine, greedy(MODEL, repetition_penalty=5.0))
        scored = engine.submit(ScoringRequest(request_id="s", model=MODEL, tokens=PROMPT + penalized.tokens))
        score = list(scored)[-1]
    assert penalized.tokens != reference.tokens
    assert isinstance(score, ScoreResult) and penalized.logprobs is not None
    assert list(penalized.logprobs) == pytest.approx(score.token_logprobs[len(PROMPT) :], abs=1e-4)


def test_top_logprobs_in_generation_and_scoring_agree(plain_dir: Path) -> None:
    with running_engine([plain_dir]) as engine:
        generated = alone(engine, greedy(MODEL, top_logprobs=5, max_new_tokens=4))
        scoring = ScoringRequest(
            request_id="s", model=MODEL, tokens=PROMPT + generated.tokens, top_logprobs=5
        )
        score = list(engine.submit(scoring))[-1]
    assert isinstance(score, ScoreResult)
    assert generated.top_logprobs is not None and score.top_logprobs is not None
    for position, alternatives in enumerate(generated.top_logprobs):
        assert alternatives[0].token == generated.tokens[position]  # greedy picks the best
        logprobs = [entry.logprob for entry in alternatives]
        assert logprobs == sorted(logprobs, reverse=True)
        scored = score.top_logprobs[len(PROMPT) + position]
        assert scored is not None
        assert [entry.token for entry in scored] == [entry.token for entry in alternatives]
        assert [entry.logprob for entry in scored] == pytest.approx(logprobs, abs=1e-4)


CONTROLS: dict[str, dict[str, Any]] = {
    "min_p": {"temperature": 1.0, "min_p": 0.2, "seed": 11},
    "repetition_penalty": {"repetition_penalty": 1.8},
    "presence_penalty": {"presence_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": 1.0},
    "ignore_eos": {"ignore_eos": True},
    "min_tokens": {"min_tokens": 8},
    "stop_token_ids": {"stop_token_ids": (72, 101)},
    "top_logprobs": {"top_logprobs": 4},
}


def test_every_control_shares_one_batch_without_changing_other_rows(plain_dir: Path) -> None:
    requests = [
        greedy(MODEL),
        *(greedy(MODEL, **options) for options in CONTROLS.values()),
    ]
    requests.append(greedy(MODEL, temperature=0.7, seed=2))
    with running_engine([plain_dir], start=False, max_batch_size=16) as engine:
        handles = [engine.submit(request) for request in requests]
        engine.start()  # all admitted in one step: they share every decode pass
        batched = [result_of(handle) for handle in handles]
        singles = [alone(engine, request) for request in requests]
    assert len({result.tokens for result in batched}) >= 5  # the penalties and min_p did change theirs
    for result, single in zip(batched, singles, strict=True):
        assert_same_generation(result, single)
        assert result.finish_reason == single.finish_reason
        assert result.top_logprobs == single.top_logprobs or _close(result, single)


def _close(batched: GenerationResult, single: GenerationResult) -> bool:
    """Alternatives equal to 1e-4 (a batched pass may differ from a lone one in the last bits)."""
    assert batched.top_logprobs is not None and single.top_logprobs is not None
    pairs = zip(batched.top_logprobs, single.top_logprobs, strict=True)
    return all(
        [a.token for a in left] == [b.token for b in right]
        and all(abs(a.logprob - b.logprob) <= 1e-4 for a, b in zip(left, right, strict=True))
        for left, right in pairs
    )


def test_stop_strings_completed_before_min_tokens_do_not_stop_later_ones_do() -> None:
    stream = TextStream(ByteTokenizer().decode, ("ab",))
    pieces = [stream.push(ord(char), may_stop=False) for char in "xab"]
    assert not stream.stopped  # "ab" came while stops were suppressed
    pieces += [stream.push(ord(char)) for char in "ca"]
    assert not stream.stopped and "".join(pieces) == "xabc"  # "a" may begin a stop: held back
    stream.push(ord("b"))
    assert stream.stopped and stream.text == "xabc"


def test_a_text_nobody_reads_before_the_end_is_decoded_once_and_equals_the_incremental_one() -> None:
    text = "héllo wörld"  # multi-byte characters: the incremental decoder holds half characters back
    tokens = list(text.encode())
    incremental = TextStream(ByteTokenizer().decode, ())
    at_once = TextStream(ByteTokenizer().decode, (), incremental=False)
    released = [incremental.push(token, final=i == len(tokens) - 1) for i, token in enumerate(tokens)]
    silent = [at_once.push(token) for token in tokens[:5]]
    assert silent == [""] * 5 and at_once.text == "héll"  # read early (a cancelled request): all so far
    for i, token in enumerate(tokens[5:], start=5):
        last = at_once.push(token, final=i == len(tokens) - 1)
    assert "".join(released) == incremental.text == at_once.text == last == text
    with_stop = TextStream(ByteTokenizer().decode, ("wö",), incremental=False)
    for token in tokens:
        with_stop.push(token)
    assert with_stop.stopped and with_stop.text == "héllo "  # stop strings keep it incremental
