"""Request bodies for `/generate` and `/score`: strict JSON types, bounds, no unknown fields.

Bounds that depend on the chosen model (vocabulary, max_context) are checked after the model is
resolved, in `service.api.inputs`; everything knowable from the body alone is checked here.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from service.api.schemas.scaling import PEScaling
from service.engine.types import Scheme

MAX_SEED = 2**63 - 1
MAX_STOP_SEQUENCES = 8
MAX_STOP_CHARS = 64

TokenId = Annotated[int, Field(ge=0)]
StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class _StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InferenceInput(_StrictBody):
    """What to run and on which model: shared by generation and scoring.

    Exactly one of `prompt` and `tokens` must be given. `model` and `pe` are both optional; when
    both are given they must agree.
    """

    prompt: str | None = Field(None, min_length=1, description="Text, encoded by the model's tokenizer.")
    tokens: list[TokenId] | None = Field(None, min_length=1, description="Token ids, used as given.")
    model: str | None = Field(None, min_length=1, max_length=256, description="A name from GET /models.")
    pe: Scheme | None = Field(None, description="Pick the first resident model trained with this scheme.")
    pe_scaling: PEScaling | None = Field(None, description="RoPE scaling; absent: the model's default.")


class GenerateRequest(InferenceInput):
    max_new_tokens: int = Field(64, ge=1, description="At most the model's max_context.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False, description="0 is greedy.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[StopSequence] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    logprobs: bool = Field(False, description="Raw-distribution log-probability of each generated token.")


class ScoreRequest(InferenceInput):
    pass
