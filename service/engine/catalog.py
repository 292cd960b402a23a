"""The resident models as the API side sees them, and every check a request meets before it queues.

Both engine front-ends (the in-process one and the client of the engine process) answer
`models`, `resolve_model`, `resolve_pe`, `encode` and `decode` from a catalog of `ModelSpec`s, and
validate submissions with `ModelCatalog.validate`, so a request is judged the same way wherever
the engine runs, and a bad one is refused before it crosses a process boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from pe_runtime import PEConfigError, RopeScaling
from service.engine.errors import ContextLengthError, EngineError, InvalidRequestError, ModelNotFoundError
from service.engine.models import ModelSpec
from service.engine.types import (
    ATTENTION_FIELD,
    ENGINE_NAMES,
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    MODEL_FIELD,
    SCALING_FIELD,
    FieldNames,
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
        """What a configuration resolves to on a model at `total_length` tokens, or why it cannot
        (an `--alias` at start-up, with no input yet); a request's input is `check_input`'s."""
        spec = self.spec(model)
        check_configuration(spec, scaling, attention)
        if total_length > context_limit(spec.info, attention):
            raise ContextLengthError(
                f"{total_length} tokens are over the max_context of {spec.name!r} ({spec.info.max_context})",
                param="max_new_tokens",
            )
        return spec.resolve_pe(scaling, total_length, attention)

    def check_input(
        self,
        model: str,
        tokens: Sequence[int],
        *,
        new_tokens: int,
        scaling: RopeScaling | None,
        attention: AttentionRule | None = None,
        names: FieldNames = ENGINE_NAMES,
        minimum: int = 1,
        resumed: Sequence[int] = (),
    ) -> PEInfo:
        """What an input and its configuration must satisfy on a model, checked once per request
        and reported in the order a user would want: how the model is asked to run, then whether
        the input is in its vocabulary, then whether input and new tokens fit (`resumed`: the
        tokens a cut stream had made, which its client sends back)."""
        spec = self.spec(model)
        info = spec.info
        with blamed_on_model(names):
            check_configuration(spec, scaling, attention)
            check_tokens(info, tokens, field=names.tokens, minimum=minimum)
            if resumed:
                check_tokens(info, resumed, field=names.resumed, minimum=1)
            check_room(
                info,
                len(tokens),
                field=names.input_length,
                new_tokens=new_tokens + len(resumed),
                new_tokens_field=names.new_tokens,
                attention=attention,
            )
            total = len(tokens) + len(resumed) + new_tokens
            if total > context_limit(info, attention):
                raise ContextLengthError(
                    f"{names.input_length} plus {names.new_tokens} is {total} tokens, over the "
                    f"max_context of {spec.name!r} ({info.max_context})",
                    param=names.new_tokens,
                )
            return spec.resolve_pe(scaling, total, attention)

    def tokenize(self, model: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.spec(model).encode(text, add_special_tokens=add_special_tokens)

    def tokenizer_info(self, model: str) -> TokenizerInfo:
        return self.spec(model).tokenizer_info

    def detokenize(self, model: str, tokens: list[int]) -> str:
        return self.spec(model).tokenizer.decode(tokens)

    def validate(
        self, request: GenerationRequest | ScoringRequest, names: FieldNames = ENGINE_NAMES
    ) -> PEInfo:
        """Everything a request must satisfy to run, checked here only, at submission; raises the
        EngineError that names the field as the caller wrote it (`names`)."""
        if isinstance(request, GenerationRequest):
            held = request.resumed.tokens if request.resumed is not None else 0
            _check_sampling(request.sampling, resumed=request.resumed is not None)
            check_tokens(
                self.spec(request.model).info,
                request.sampling.stop_token_ids,
                field="stop_token_ids",
                minimum=0,
            )
            cut = len(request.prompt_tokens) - held  # the prompt ends with the tokens made before the cut
            return self.check_input(
                request.model,
                request.prompt_tokens[:cut],
                new_tokens=request.sampling.max_new_tokens,
                scaling=request.scaling,
                attention=request.attention,
                names=names,
                resumed=request.prompt_tokens[cut:],
            )
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs is out of range: {request.top_logprobs!r}", param="top_logprobs"
            )
        return self.check_input(
            request.model,
            request.tokens,
            new_tokens=0,
            scaling=request.scaling,
            attention=request.attention,
            names=names,
            minimum=MIN_SCORED_TOKENS,
        )


def check_configuration(
    spec: ModelSpec, scaling: RopeScaling | None, attention: AttentionRule | None
) -> None:
    """The scaling and the rule are ones the model's scheme applies, and apply together."""
    if scaling is not None:
        check_scaling_supported(spec.info, scaling.type)
    if attention is not None:
        check_attention_supported(spec.info, attention)
        check_streaming_scaling(attention, scaling or spec.effective_scaling(None))


@contextmanager
def blamed_on_model(names: FieldNames) -> Iterator[None]:
    """Within: an error about a field the model name set (`pe_scaling.factor` from
    `NAME@yarn:factor=0.5`) is an error on `model`, whose message names that field."""
    try:
        yield
    except (EngineError, PEConfigError) as raised:
        message = raised.message
        param = f"{SCALING_FIELD}.{raised.field}" if isinstance(raised, PEConfigError) else raised.param
        named = param is not None and param.split(".")[0] in names.set_by_model
        if names.model is None or not named:
            raise
        raise InvalidRequestError(as_model_error(names.model, param, message), param=MODEL_FIELD) from None


def as_model_error(model: str, param: str | None, message: str) -> str:
    """How an error on a field that a model name set reads, as an error on `model`:
    `model 'NAME@yarn:factor=0.5': pe_scaling.factor: ...`."""
    detail = message if param is None or message.startswith(f"{param}:") else f"{param}: {message}"
    return f"{MODEL_FIELD} {model!r}: {detail}"


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
