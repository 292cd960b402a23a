"""The contract between the inference engine and everything that calls it (HTTP layer, bench).

The HTTP layer never touches torch or a model: it builds one of the frozen requests below, hands it
to `Engine.submit`, and reads `EngineEvent`s back from the returned handle. Keeping this surface
small is what lets the engine change (batching policy, devices, kernels) without the API moving.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pe_runtime import RopeScaling
from service.model.attention_rules import AttentionRule
from service.model.config import Scheme as Scheme  # the scheme names belong to the contract too

FinishReason = Literal["length", "stop", "eos", "cancelled", "error"]
# The reasons a client reads; the other two end a request with an error instead of an answer.
ClientFinishReason = Literal["length", "stop", "eos"]

# The request field that carries the scaling, named in every error about it.
SCALING_FIELD = "pe_scaling"
# The request field that carries the attention rule (`service.model.attention_rules`).
ATTENTION_FIELD = "pe_attention"
# The request field that names the model; an error about what a model name set names it.
MODEL_FIELD = "model"


@dataclass(frozen=True)
class FieldNames:
    """The caller's names for what the engine checks, so that an error names the field the user
    sent: the input (`tokens`; `prompt`, `prompt.2` or `messages` on other routes), the input where
    its length is in question (`length`, default `tokens`), the bound on new tokens, a resumed
    stream's tokens, and the configuration a model name set (`NAME@SPEC`, an alias): an error
    about a field in `set_by_model` is an error on `model`, which wrote it."""

    tokens: str = "tokens"
    length: str | None = None
    new_tokens: str = "max_new_tokens"
    resumed: str = "resume_from.tokens"
    model: str | None = None
    set_by_model: tuple[str, ...] = ()

    @property
    def input_length(self) -> str:
        return self.length or self.tokens


# The engine's own names: its requests' fields (a caller that builds them itself, the warm-up).
ENGINE_NAMES = FieldNames()


# Bounds of the sampling controls, shared by the engine's own checks and the API's schemas.
MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding knobs; `temperature == 0` means greedy. Plain data: it is pickled to
    the engine process.

    The penalties change the logits a token is chosen from, never the reported log-probabilities
    (those stay the raw distribution's): `repetition_penalty` (1 = off) follows transformers, over
    prompt and output tokens; `presence_penalty` and `frequency_penalty` follow OpenAI, over output
    tokens. `min_p` keeps tokens at least that fraction as likely as the most likely one. Before
    `min_tokens` tokens, EOS, `stop_token_ids` and stop strings cannot end the generation;
    `ignore_eos` makes EOS an ordinary token. `top_logprobs` is how many alternatives to report.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0


@dataclass(frozen=True)
class Resumed:
    """What a generation resumed after its stream was cut had already produced (docs/reliability.md).

    The request's `prompt_tokens` end with those `tokens` (its client holds them; the prefix cache
    serves them), and its `sampling` counts what is left: `max_new_tokens` and `min_tokens` less
    those tokens, so that the KV reservation and the context checks are the uncut request's. The
    engine treats them as output already sent: the sampler counts them (penalties, each draw's
    index), the text stream reads them (stop strings across the cut, text held back), and one that
    had ended the generation (a cut between the last token and the end) ends it at once.
    `min_tokens` is the whole generation's, which says which of them could have ended it.
    """

    tokens: int
    min_tokens: int


@dataclass(frozen=True)
class GenerationRequest:
    """A generation job. `scaling=None` means "the model's own default scaling", `attention=None`
    standard attention (`pe_attention`).

    `stream=False` says the caller wants only the result: the handle then yields the first token's
    event (time to first token stays observable) and the final result, which spares the engine and
    the caller one event per token. `resumed`: a stream continued after a cut (see `Resumed`).
    """

    request_id: str
    model: str
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    scaling: RopeScaling | None = None
    stream: bool = True
    resumed: Resumed | None = None
    attention: AttentionRule | None = None


@dataclass(frozen=True)
class ScoringRequest:
    """A scoring job: log-probability of every token given its prefix (one prefill, no decode).

    `top_logprobs` > 0 also reports that many most likely tokens at every position.
    """

    request_id: str
    model: str
    tokens: tuple[int, ...]
    scaling: RopeScaling | None = None
    top_logprobs: int = 0
    attention: AttentionRule | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What `/models` reports; also used to resolve `model` / `pe` in a request."""

    name: str
    scheme: Scheme
    native_context: int
    max_context: int
    supported_scalings: tuple[str, ...]
    supported_attention: tuple[str, ...]
    parameters: int
    device: str
    dtype: str
    vocab_size: int
    backend: str = "eager"  # the decode path its steps run on (`service.model.backend`)
    weights: str = "float"  # how its linear weights are kept (`service.model.quantized`)
    # A training-side zoo member's method (`training.extension`: pi-ft, yarn-ft, pose, randpos).
    training_method: str | None = None
    # The most tokens a generation under `pe_attention` streaming may make, past max_context (0:
    # the scheme cannot stream).
    max_stream_tokens: int = 0


@dataclass(frozen=True)
class TokenizerInfo:
    """A model's tokenizer as clients see it: special tokens by text (None where the tokenizer has
    no text for them, as our byte-level one) and id, and the chat template if the model has one."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    chat_template: str | None = None


@dataclass(frozen=True)
class PEInfo:
    """The positional encoding a request actually ran with (scaling resolved with defaults)."""

    scheme: Scheme
    scaling: RopeScaling | None
    attention_factor: float
    native_context: int
    max_context: int
    attention: AttentionRule | None = None  # the resolved `pe_attention`; None: standard


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position, under the raw distribution. Its text is the
    caller's to decode (the API side holds the tokenizer too), which keeps step messages small."""

    token: int
    logprob: float


# The alternatives at one position, most likely first.
TopLogprobs = tuple[TopLogprob, ...]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `text` is the decoded increment (may be empty mid UTF-8 sequence)."""

    token: int
    text: str
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None


@dataclass(frozen=True)
class Timing:
    queue_ms: float
    prefill_ms: float
    decode_ms: float


@dataclass(frozen=True)
class GenerationResult:
    """The final event of a generation: everything the non-streaming response needs.

    Of a resumed generation, as if it had not been cut, but for the tokens its client holds:
    `tokens`, `logprobs` and `top_logprobs` are the new ones only, `resumed` counts the others,
    `prompt_tokens` and `cached_tokens` are the original prompt's.
    """

    tokens: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None
    finish_reason: FinishReason
    prompt_tokens: int
    pe: PEInfo
    timing: Timing
    top_logprobs: tuple[TopLogprobs, ...] | None = None
    cached_tokens: int = 0  # prompt tokens whose entries came from the prefix cache
    resumed: int = 0  # tokens generated before a cut (`Resumed.tokens`), left out of `tokens`


@dataclass(frozen=True)
class ScoreResult:
    """`token_logprobs[0]` is None: the first token has no prefix to be predicted from; so is
    `top_logprobs[0]` when alternatives were asked for."""

    tokens: tuple[int, ...]
    token_logprobs: tuple[float | None, ...]
    total_logprob: float
    pe: PEInfo
    timing: Timing = field(default_factory=lambda: Timing(0.0, 0.0, 0.0))
    top_logprobs: tuple[TopLogprobs | None, ...] | None = None


EngineEvent = TokenEvent | GenerationResult | ScoreResult


class RequestHandle(Protocol):
    """A submitted request. Iterating yields TokenEvents (all of them, or only the first for a
    generation with `stream=False`) then exactly one final result.

    If the request fails inside the engine, iteration raises the `EngineError` that failed it.
    Leaving iteration early does not cancel; call `cancel()` (the HTTP layer does on disconnect).
    """

    request_id: str

    def __aiter__(self) -> AsyncIterator[EngineEvent]: ...

    def __iter__(self) -> Iterator[EngineEvent]: ...

    def cancel(self) -> None: ...


@dataclass(frozen=True)
class EngineStats:
    queue_depth: int
    running: int
    batch_size: int
    generated_tokens_total: int


class Engine(Protocol):
    """What the service needs from the engine.

    `service.engine.client.EngineClient` implements it over a pipe to the engine process (what
    the server runs), `service.engine.engine.InferenceEngine` on a thread of this process.
    """

    def models(self) -> list[ModelInfo]: ...

    def resolve_model(self, model: str | None, scheme: str | None) -> ModelInfo:
        """Pick the model for a request: raises ModelNotFoundError / InvalidRequestError."""
        ...

    def resolve_pe(
        self,
        model: str,
        scaling: RopeScaling | None,
        total_length: int,
        attention: AttentionRule | None = None,
    ) -> PEInfo:
        """Validate a scaling and an attention rule for a model and length; raises
        InvalidRequestError/ContextLengthError."""
        ...

    def tokenize(self, model: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokens of `text`; with `add_special_tokens` what starts a document (BOS) comes first."""
        ...

    def tokenizer_info(self, model: str) -> TokenizerInfo: ...

    def detokenize(self, model: str, tokens: list[int]) -> str: ...

    def check_input(
        self,
        model: str,
        tokens: Sequence[int],
        *,
        new_tokens: int,
        scaling: RopeScaling | None,
        attention: AttentionRule | None = None,
        names: FieldNames = ENGINE_NAMES,
    ) -> PEInfo:
        """What `submit` checks of an input, for a request that queues nothing (an OpenAI echo
        with `max_tokens` 0); raises the EngineError that names the field as `names` do."""
        ...

    def submit(
        self, request: GenerationRequest | ScoringRequest, names: FieldNames = ENGINE_NAMES
    ) -> RequestHandle:
        """Check (every rule a request meets runs here, once) and queue; raises QueueFullError /
        EngineDrainingError / InvalidRequestError at once, naming fields as `names` do."""
        ...

    def stats(self) -> EngineStats: ...

    def healthy(self) -> bool:
        """Whether the engine can take requests now (False while an engine process restarts)."""
        ...

    def lost(self) -> bool:
        """True once the engine can never serve again: the server should exit non-zero."""
        ...

    def metrics_text(self) -> bytes:
        """Prometheus text of metrics kept where the engine runs, if not in this process; may block."""
        ...

    def start(self) -> None: ...

    def drain(self, timeout_s: float) -> bool:
        """Stop accepting work, wait for running requests up to timeout_s; True if all finished."""
        ...

    def shutdown(self) -> None: ...
