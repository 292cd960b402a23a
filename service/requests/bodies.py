"""Request bodies of `/generate` and `/score`, and of gRPC `Generate` and `Score`, whose messages
are read into these same models: strict types, bounds, no unknown fields.

Bounds that depend on the chosen model (vocabulary, max_context) are checked after the model is
resolved, in `service.requests.prepare`; everything knowable from the body alone is checked here.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from service.engine.types import Scheme
from service.requests.sampling import SamplingControls, StrictBody, TokenId, TopLogprobsCount
from service.requests.scaling import PEScaling

MAX_STOP_SEQUENCES = 8
MAX_STOP_CHARS = 64

StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class ModelSelection(StrictBody):
    """Which resident model runs a request, and how its positions are scaled."""

    model: str | None = Field(None, min_length=1, max_length=256, description="A name from GET /models.")
    pe: Scheme | None = Field(None, description="Pick the first resident model trained with this scheme.")
    pe_scaling: PEScaling | None = Field(None, description="RoPE scaling; absent: the model's default.")
    pe_attention: dict[str, Any] | None = Field(
        None,
        description=(
            "How attention places queries and keys: `type` standard, self_extend, rerope, leaky_rerope, "
            "dca or streaming with its fields, and optional `logn` (docs/attention.md); absent: standard."
        ),
        examples=[
            {"type": "self_extend", "group_size": 4, "window": 1024},
            {"type": "standard", "logn": 8192},
        ],
    )


class InferenceInput(ModelSelection):
    """What to run and on which model: shared by generation and scoring.

    Exactly one of `prompt` and `tokens` must be given. `model` and `pe` are both optional; when
    both are given they must agree.
    """

    prompt: str | None = Field(None, min_length=1, description="Text, encoded by the model's tokenizer.")
    tokens: list[TokenId] | None = Field(None, min_length=1, description="Token ids, used as given.")


class ResumeFrom(StrictBody):
    """Where a cut stream left off: the ids of the tokens its client received, in order."""

    tokens: list[TokenId] = Field(min_length=1, description="At most max_new_tokens, in the vocabulary.")


class GenerateRequest(InferenceInput, SamplingControls):
    max_new_tokens: int = Field(64, ge=1, description="At most the model's max_context.")
    stop: list[StopSequence] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    logprobs: bool = Field(False, description="Raw-distribution log-probability of each generated token.")
    top_logprobs: TopLogprobsCount = 0
    resume_from: ResumeFrom | None = Field(
        None,
        description=(
            "Resume a streamed generation that was cut: the rest of the stream, as if uncut, from the "
            "tokens already received (the same tokens as uncut when greedy or seeded). Streams only."
        ),
    )


class ScoreRequest(InferenceInput):
    top_logprobs: TopLogprobsCount = 0
