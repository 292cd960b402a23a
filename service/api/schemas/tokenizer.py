"""Bodies of the tokenizer routes, named as vLLM names them (evaluation clients tokenize remotely)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from service.api.schemas.openai import ChatMessage
from service.requests.sampling import StrictBody, TokenId

ModelField = Field(
    None, min_length=1, max_length=256, description="A name from GET /models; default model if absent."
)


class TokenizeRequest(StrictBody):
    """Exactly one of `prompt` (text) and `messages` (rendered with the model's chat template)."""

    model: str | None = ModelField
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(
        None, description="Add BOS and the like; default true for a prompt, false for messages (as vLLM)."
    )
    add_generation_prompt: bool = Field(
        True, description="For messages: end with the assistant's turn opening."
    )


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(StrictBody):
    model: str | None = ModelField
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    model: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    model_max_length: int = Field(description="The longest prompt plus output the server runs on this model.")
