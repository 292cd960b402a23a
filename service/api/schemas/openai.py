"""Bodies of the OpenAI-compatible routes: OpenAI's field names and shapes, plus our extensions.

The extension fields (`pe`, `pe_scaling`, `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids`) sit at the top level, where OpenAI clients put `extra_body`; they
and every standard field are validated by the same schemas as `/generate`'s (`ModelSelection`,
`SamplingControls`). Unknown fields are refused like anywhere else, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from service.requests.bodies import MAX_STOP_SEQUENCES, ModelSelection, StopSequence
from service.requests.responses import PEBlock
from service.requests.sampling import SamplingControls, StrictBody, TokenId, TopLogprobsCount

MAX_CHOICES = 16
MAX_PROMPTS = 64
MAX_LEGACY_LOGPROBS = 5

TokenPrompt = Annotated[list[TokenId], Field(min_length=1)]
OpenAIFinishReason = Literal["stop", "length"]


class StreamOptions(StrictBody):
    include_usage: bool = False


class OpenAIRequest(ModelSelection, SamplingControls):
    """What completions and chat completions share."""

    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices per prompt (seeds seed, seed+1, ...).")
    stop: StopSequence | Annotated[list[StopSequence], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="Accepted and ignored.")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAIRequest):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenPrompt
        | Annotated[list[TokenPrompt], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int = Field(16, ge=0, description="0 with echo: only the prompt (and its logprobs).")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LEGACY_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("suffix (insertion) is not supported by pe-serve")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("best_of other than 1 is not supported by pe-serve; use n")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompt in its list form: one entry per prompt, each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        ids = [item for item in prompt if isinstance(item, int)]
        if len(ids) == len(prompt):
            return [ids]
        return [item for item in prompt if not isinstance(item, int)]


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as templates read it: content as one string (text parts joined)."""
        content = (
            self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        )
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Default: up to the model's max_context.")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name of max_tokens.")
    logprobs: bool = False
    top_logprobs: TopLogprobsCount | None = None


# -- responses ----------------------------------------------------------------------------------


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens read from the prefix cache, not computed.")


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """The legacy shape: per token its text, log-probability and a {text: logprob} of alternatives."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: OpenAIFinishReason | None


class CompletionResponse(BaseModel):
    """Also each streamed chunk (`choices` empty in the last one when usage was asked for)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage | None = None
    pe: PEBlock | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: OpenAIFinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage
    pe: PEBlock


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: OpenAIFinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: OpenAIUsage | None = None
    pe: PEBlock | None = None


class OpenAIModel(BaseModel):
    """OpenAI's model object plus what `/models` tells about positions."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pe-serve"
    scheme: str
    native_context: int
    max_context: int
    supported_scalings: list[str]
    root: str = Field(
        description="The resident model that runs it (vLLM's name): itself, or an alias's model."
    )
    target: str | None = Field(
        None, description="For an `--alias` name: its TARGET, the model and the SPECs it sets."
    )


class OpenAIModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]
