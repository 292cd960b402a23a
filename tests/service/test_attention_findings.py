"""Two faults the issue-49 fuzz and soak found under `pe_attention` (docs/reliability.md), held
where they live: the rules' validation and a rule row's turned keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from pe_runtime import PEConfigError
from service.engine.engine import InferenceEngine
from service.engine.types import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    ScoreResult,
    ScoringRequest,
)
from service.model.attention_rules import parse_attention
from tests.conftest import TinyCheckpointFactory

HUGE = 10**400  # an integer JSON may carry and no float can hold


@pytest.mark.parametrize(
    ("rule", "field"),
    [
        ({"type": "rerope", "window": HUGE}, "window"),
        ({"type": "rerope", "window": -HUGE}, "window"),
        ({"type": "standard", "logn": HUGE}, "logn"),
        ({"type": "leaky_rerope", "window": 4, "leak": HUGE}, "leak"),
        ({"type": "dca", "chunk_size": HUGE, "local_window": 2}, "chunk_size"),
        ({"type": "streaming", "sink_tokens": HUGE, "window": 4}, "sink_tokens"),
    ],
)
def test_an_integer_past_a_floats_range_is_an_error_on_its_field(rule: dict[str, object], field: str) -> None:
    """It raised OverflowError (a 500 on every route that takes pe_attention: found by make fuzz)."""
    with pytest.raises(PEConfigError) as raised:
        parse_attention(rule)
    assert raised.value.field == field


@pytest.fixture(scope="module")
def rope_dir(make_tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return make_tiny_checkpoint("rope", name="tiny-dca", seed=11, native_context=64)


@pytest.mark.parametrize(("chunk_size", "local_window", "prompt"), [(16, 0, 5), (24, 4, 12), (16, 4, 30)])
def test_a_dca_generation_that_crosses_its_stride_equals_scoring_its_text(
    rope_dir: Path, chunk_size: int, local_window: int, prompt: int
) -> None:
    """A row whose prompt is shorter than the stride turns no key until its text passes it; the
    pass that first turns them must turn every slot (it read the others from an unwritten buffer:
    wrong log-probabilities or NaN, found by the soak)."""
    rule = parse_attention({"type": "dca", "chunk_size": chunk_size, "local_window": local_window})
    tokens = tuple(range(40, 40 + prompt))
    engine = InferenceEngine.from_model_dirs([rope_dir], device="cpu", dtype="float32", max_context=128)
    engine.start()
    try:
        sampling = SamplingParams(max_new_tokens=40, temperature=0.0, logprobs=True, ignore_eos=True)
        request = GenerationRequest("g", "tiny-dca", tokens, sampling, attention=rule, stream=False)
        generated = list(engine.submit(request))[-1]
        assert isinstance(generated, GenerationResult)
        text = tokens + generated.tokens
        scored = list(engine.submit(ScoringRequest("s", "tiny-dca", text, attention=rule)))[-1]
    finally:
        engine.shutdown()
    assert isinstance(generated, GenerationResult) and isinstance(scored, ScoreResult)
    expected = [value for value in scored.token_logprobs[len(tokens) :] if value is not None]
    assert generated.logprobs is not None and len(generated.logprobs) == len(expected) == 40
    assert max(abs(a - b) for a, b in zip(generated.logprobs, expected, strict=True)) <= 1e-4
