"""The sampling controls every generating route accepts, with their bounds, defined once.

`/generate` and the OpenAI routes inherit `SamplingControls`, so a bound is the same everywhere
and a bad value is named by the same field (422 on `/generate`, 400 on `/v1`, see
`service.api.errors`). Bounds are the engine's (`service.engine.types`), which checks them again.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from service.engine.types import MAX_PENALTY, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, SamplingParams

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

    def sampling_params(
        self,
        *,
        max_new_tokens: int,
        stop: tuple[str, ...],
        logprobs: bool,
        top_logprobs: int,
        seed_offset: int = 0,
    ) -> SamplingParams:
        """The engine's parameters; `seed_offset` tells the n choices of one request apart."""
        seed = None if self.seed is None else (self.seed + seed_offset) % (MAX_SEED + 1)
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=seed,
            stop=stop,
            logprobs=logprobs,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids),
            top_logprobs=top_logprobs,
        )
