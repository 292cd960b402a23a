"""The resident models as the API side sees them, and every check a request meets before it queues.

Both engine front-ends (the in-process one and the client of the engine process) answer
`models`, `resolve_model`, `resolve_pe`, `encode` and `decode` from a catalog of `ModelSpec`s, and
validate submissions with `ModelCatalog.validate`, so a request is judged the same way wherever
the engine runs, and a bad one is refused before it crosses a process boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pe_runtime import PEConfigError, RopeScaling
from service.engine.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError
from service.engine.models import ModelSpec
from service.engine.types import (
    ATTENTION_FIELD,
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    SCALING_FIELD,
    GenerationRequest,
    ModelInfo,
    PEInfo,
    SamplingParams,
    ScoringRequest,
    TokenizerInfo,
)
from service.model.attention_rules import AttentionRule, StreamingAttention
from service.model.config import SCHEMES
from service.model.positional import check_supported_attention, check_supported_scaling

# The first token has no prefix, so at least two are needed for one prediction to score.
MIN_SCORED_TOKENS = 2


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

    def resolve_pe(
        self,
        model: str,
        scaling: RopeScaling | None,
        total_length: int,
        attention: AttentionRule | None = None,
    ) -> PEInfo:
        spec = self.spec(model)
        if scaling is not None:
            check_scaling_supported(spec.info, scaling.type)
        if attention is not None:
            check_attention_supported(spec.info, attention)
            check_streaming_scaling(attention, scaling or spec.effective_scaling(None))
        if total_length > context_limit(spec.info, attention):
            raise ContextLengthError(
                f"prompt plus max_new_tokens is {total_length} tokens, over the max_context of "
                f"{spec.name!r} ({spec.info.max_context})",
                param="max_new_tokens",
            )
        return spec.resolve_pe(scaling, total_length, attention)

    def tokenize(self, model: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.spec(model).encode(text, add_special_tokens=add_special_tokens)

    def tokenizer_info(self, model: str) -> TokenizerInfo:
        return self.spec(model).tokenizer_info

    def detokenize(self, model: str, tokens: list[int]) -> str:
        return self.spec(model).tokenizer.decode(tokens)

    def validate(self, request: GenerationRequest | ScoringRequest) -> PEInfo:
        """Everything a request must satisfy to run; raises the EngineError that names the field."""
        info = self.spec(request.model).info
        if isinstance(request, GenerationRequest):
            tokens, minimum, new_tokens = request.prompt_tokens, 1, request.sampling.max_new_tokens
            if request.resumed is not None:  # the prompt holds the tokens made before the cut too
                minimum += request.resumed.tokens
            _check_sampling(request.sampling, resumed=request.resumed is not None)
            check_tokens(info, request.sampling.stop_token_ids, field="stop_token_ids", minimum=0)
        else:
            tokens, minimum, new_tokens = request.tokens, MIN_SCORED_TOKENS, 0
            if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    f"top_logprobs is out of range: {request.top_logprobs!r}", param="top_logprobs"
                )
        check_tokens(info, tokens, field="tokens", minimum=minimum)
        return self.resolve_pe(request.model, request.scaling, len(tokens) + new_tokens, request.attention)


def check_scaling_supported(info: ModelInfo, scaling_type: str) -> None:
    """A scaling the model's scheme cannot apply is refused, never ignored (`pe_scaling.type`)."""
    _refused_as(info, SCALING_FIELD, lambda: check_supported_scaling(info.scheme, scaling_type))


def check_attention_supported(info: ModelInfo, rule: AttentionRule) -> None:
    """A rule the model's scheme cannot apply is refused, never ignored (`pe_attention.type`)."""
    _refused_as(info, ATTENTION_FIELD, lambda: check_supported_attention(info.scheme, rule))


def _refused_as(info: ModelInfo, field: str, check: Callable[[], None]) -> None:
    """`check`'s PEConfigError as the request's error, naming `<field>.type` and the model."""
    try:
        check()
    except PEConfigError as error:
        raise InvalidRequestError(f"model {info.name!r}: {error.message}", param=field + ".type") from None


def check_tokens(info: ModelInfo, tokens: Sequence[int], *, field: str, minimum: int) -> None:
    """At least `minimum` tokens, each inside the model's vocabulary (named `field.index`)."""
    if len(tokens) < minimum:
        raise InvalidRequestError(
            f"{field} must have at least {minimum} tokens, got {len(tokens)}.", param=field
        )
    for index, token in enumerate(tokens):
        if not 0 <= token < info.vocab_size:
            vocabulary = f"0..{info.vocab_size - 1}"
            message = f"{field}.{index}: id {token} is outside the vocabulary of {info.name} ({vocabulary})."
            raise InvalidRequestError(message, param=f"{field}.{index}")


def check_room(
    info: ModelInfo,
    input_length: int,
    *,
    field: str,
    new_tokens: int,
    new_tokens_field: str = "max_new_tokens",
    attention: AttentionRule | None = None,
) -> None:
    """The input alone, and the tokens asked for alone, must fit the model's max_context (the
    new tokens under `streaming` attention: `--max-stream-tokens`, past max_context).

    The input over the context is the input's fault (named `field`), not the new tokens' (which
    /score has not even got); both together over it is `resolve_pe`'s check, at submission.
    """
    room = info.max_context - (1 if new_tokens else 0)
    if input_length > room:
        needs = ", which must also hold at least one generated token" if new_tokens else ""
        message = f"{field} is {input_length} tokens; the max_context of {info.name} is {info.max_context}"
        raise InvalidRequestError(f"{message}{needs}.", param=field)
    if isinstance(attention, StreamingAttention):
        if new_tokens > info.max_stream_tokens:
            limit = f"the server's --max-stream-tokens ({info.max_stream_tokens})"
            raise InvalidRequestError(
                f"{new_tokens_field} ({new_tokens}) exceeds {limit}.", param=new_tokens_field
            )
    elif new_tokens > info.max_context:
        limit = f"the max_context of {info.name} ({info.max_context})"
        raise InvalidRequestError(
            f"{new_tokens_field} ({new_tokens}) exceeds {limit}.", param=new_tokens_field
        )


def context_limit(info: ModelInfo, attention: AttentionRule | None) -> int:
    """The most tokens a request may reach, prompt and generation: max_context, and past it
    `--max-stream-tokens` more under `streaming` attention, whose row keeps only its window."""
    if isinstance(attention, StreamingAttention):
        return info.max_context + info.max_stream_tokens
    return info.max_context


def check_streaming_scaling(attention: AttentionRule, scaling: RopeScaling) -> None:
    """A streaming row keeps no text to recompute its window from, so its table cannot change with
    its length: dynamic NTK and LongRoPE are refused under it (`pe_attention.type`)."""
    if isinstance(attention, StreamingAttention) and scaling.type in ("dynamic", "longrope"):
        raise InvalidRequestError(
            f"streaming attention keeps only its window, so it cannot follow a {scaling.type!r} "
            "scaling's table as the text grows; use a static scaling",
            param=ATTENTION_FIELD + ".type",
        )


def _check_sampling(params: SamplingParams, *, resumed: bool = False) -> None:
    """Ranges the sampler relies on (the request schemas declare them too; other callers may not).

    A resumed generation's counts are what is left, which may be nothing: its stream was cut
    between its last token and its end (`service.engine.types.Resumed`).
    """
    problems = {
        "max_new_tokens": params.max_new_tokens < (0 if resumed else 1),
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
