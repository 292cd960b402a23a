"""The sampling controls every generating route accepts, with their bounds, defined once.

`/generate`, gRPC `Generate` and the OpenAI routes inherit `SamplingControls`, so a bound is the
same everywhere and a bad value is named by the same field; `service.requests.build` turns them
into the engine's `SamplingParams`. Bounds are the engine's (`service.engine.types`), which
checks them again.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from service.engine.types import MAX_PENALTY, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS

MAX_SEED = 2**63 - 1

TokenId = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
TopLogprobsCount = Annotated[
    int,
    Field(ge=0, le=MAX_TOP_LOGPROBS, description="How many most likely alternatives to report per token."),
]


class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingControls(StrictBody):
    """Decoding knobs shared by every generating route; the defaults leave each one off."""

    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False, description="0 is greedy.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, allow_inf_nan=False, description="Drop tokens less likely than min_p x the best."
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=100.0,
        allow_inf_nan=False,
        description="transformers' rule over prompt and output tokens; 1 is off.",
    )
    presence_penalty: Penalty = Field(0.0, description="OpenAI's rule over output tokens.")
    frequency_penalty: Penalty = Field(0.0, description="OpenAI's rule over output tokens.")
    ignore_eos: bool = Field(False, description="EOS does not end the generation.")
    min_tokens: int = Field(0, ge=0, description="EOS, stop tokens and stop strings end nothing before this.")
    stop_token_ids: list[TokenId] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS, description="Token ids that end the generation."
    )
