"""The resident models as the API side sees them, and every check a request meets before it queues.

Both engine front-ends (the in-process one and the client of the engine process) answer
`models`, `resolve_model`, `resolve_pe`, `encode` and `decode` from a catalog of `ModelSpec`s, and
validate submissions with `ModelCatalog.validate`, so a request is judged the same way wherever
the engine runs, and a bad one is refused before it crosses a process boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

from pe_runtime import RopeScaling
from service.engine.errors import InvalidRequestError, ModelNotFoundError
from service.engine.models import ModelSpec
from service.engine.types import (
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    ModelInfo,
    PEInfo,
    SamplingParams,
    ScoreRequest,
    TokenizerInfo,
)
from service.model.config import SCHEMES


class ModelCatalog:
    def __init__(self, specs: Sequence[ModelSpec]) -> None:
        if not specs:
            raise ValueError("the engine needs at least one model")
        self._specs = {spec.name: spec for spec in specs}
        if len(self._specs) != len(specs):
            raise ValueError("model names must be unique")

    def models(self) -> list[ModelInfo]:
        return [spec.info for spec in self._specs.values()]

    def spec(self, name: str) -> ModelSpec:
        spec = self._specs.get(name)
        if spec is None:
            raise ModelNotFoundError(f"model {name!r} is not loaded", param="model")
        return spec

    def resolve_model(self, model: str | None, scheme: str | None) -> ModelInfo:
        """`model` by name, else the first model (load order) trained with `scheme`, else the first."""
        if model is not None:
            info = self.spec(model).info
            if scheme is not None and info.scheme != scheme:
                raise InvalidRequestError(
                    f"model {model!r} uses the {info.scheme!r} scheme, not {scheme!r}", param="pe"
                )
            return info
        if scheme is None:
            return next(iter(self._specs.values())).info
        for spec in self._specs.values():
            if spec.info.scheme == scheme:
                return spec.info
        if scheme not in SCHEMES:
            raise InvalidRequestError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}", param="pe")
        raise ModelNotFoundError(f"no loaded model uses the {scheme!r} scheme", param="pe")

    def resolve_pe(self, model: str, scaling: RopeScaling | None, total_length: int) -> PEInfo:
        return self.spec(model).resolve_pe(scaling, total_length)

    def encode(self, model: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.spec(model).encode(text, add_special_tokens=add_special_tokens)

    def tokenizer_info(self, model: str) -> TokenizerInfo:
        return self.spec(model).tokenizer_info

    def decode(self, model: str, tokens: list[int]) -> str:
        return self.spec(model).tokenizer.decode(tokens)

    def validate(self, request: GenerationRequest | ScoreRequest) -> PEInfo:
        """Everything a request must satisfy to run; raises the EngineError that names the field."""
        spec = self.spec(request.model)
        generating = isinstance(request, GenerationRequest)
        tokens = request.prompt_tokens if isinstance(request, GenerationRequest) else request.tokens
        _check_tokens(spec, tokens, minimum=1 if generating else 2)
        if isinstance(request, GenerationRequest):
            _check_sampling(request.sampling)
            _check_tokens(spec, request.sampling.stop_token_ids, minimum=0, field="stop_token_ids")
        elif not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs is out of range: {request.top_logprobs!r}", param="top_logprobs"
            )
        new_tokens = request.sampling.max_new_tokens if isinstance(request, GenerationRequest) else 0
        return spec.resolve_pe(request.scaling, len(tokens) + new_tokens)


def _check_tokens(spec: ModelSpec, tokens: Sequence[int], *, minimum: int, field: str = "tokens") -> None:
    if len(tokens) < minimum:
        raise InvalidRequestError(f"at least {minimum} token(s) are needed, got {len(tokens)}", param=field)
    vocab = spec.info.vocab_size
    for index, token in enumerate(tokens):
        if not 0 <= token < vocab:
            raise InvalidRequestError(
                f"token {token} is outside the vocabulary of {spec.name!r} (0..{vocab - 1})",
                param=f"{field}.{index}",
            )


def _check_sampling(params: SamplingParams) -> None:
    """Ranges the sampler relies on (the HTTP layer checks them too; other callers may not)."""
    problems = {
        "max_new_tokens": params.max_new_tokens < 1,
        "temperature": not params.temperature >= 0.0,
        "top_k": params.top_k < 0,
        "top_p": not 0.0 < params.top_p <= 1.0,
        "min_p": not 0.0 <= params.min_p <= 1.0,
        "repetition_penalty": not params.repetition_penalty > 0.0,
        "presence_penalty": not -MAX_PENALTY <= params.presence_penalty <= MAX_PENALTY,
        "frequency_penalty": not -MAX_PENALTY <= params.frequency_penalty <= MAX_PENALTY,
        "min_tokens": not 0 <= params.min_tokens <= params.max_new_tokens,
        "stop_token_ids": len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS,
        "top_logprobs": not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS,
    }
    for field, bad in problems.items():
        if bad:
            value = getattr(params, field)
            raise InvalidRequestError(f"{field} is out of range: {value!r}", param=field)
