"""POST /v1/chat/completions: chat over models whose tokenizer config has a chat template.

The messages are rendered with the model's template as transformers would render them
(`service.api.chat_template`), then run like a completion of that prompt with `n` choices.
Logprobs take the chat shape: per token its text, bytes, log-probability and `top_logprobs`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request, Response

from service.api.chat_template import render_chat
from service.api.deps import AliasesDep, EngineDep, FirstTokenDep, RequestIdDep, SubmissionDep, require_json
from service.api.errors import CLIENT_CLOSED_REQUEST
from service.api.handles import ClientDisconnectedError, final_results
from service.api.openai_runs import cancel_all, created_now, openai_finish_reason, openai_usage, submit_all
from service.api.openapi import openai_errors, openai_stream
from service.api.responses import json_response
from service.api.schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
)
from service.api.streaming import DONE, EventStreamResponse, failure_event, merged_events, sse_event
from service.engine.types import EngineEvent, GenerationResult, RequestHandle, TokenEvent, TopLogprobs
from service.requests.build import generation_request
from service.requests.convert import TokenText, pe_block, token_text
from service.requests.prepare import prepare_for, resolve_target
from service.requests.responses import PEBlock

router = APIRouter(tags=["openai"], dependencies=[Depends(require_json)])


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**openai_stream(ChatCompletionChunk), **openai_errors()},
)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    engine: EngineDep,
    request_id: RequestIdDep,
    first_token: FirstTokenDep,
    submission: SubmissionDep,
    aliases: AliasesDep,
) -> Response:
    """OpenAI's chat completions; extension fields (`pe`, `pe_scaling`, `min_p`, ...) at the top level."""
    target = resolve_target(engine, body, aliases)
    model = target.model
    prompt = render_chat(
        model.name, engine.tokenizer_info(model.name), [m.for_template() for m in body.messages]
    )
    rendered = engine.tokenize(model.name, prompt, add_special_tokens=False)  # the template has its own
    max_tokens = body.max_completion_tokens or body.max_tokens or max(model.max_context - len(rendered), 1)
    prepared = prepare_for(engine, target, rendered, field="messages", new_tokens_field="max_tokens")
    tokens = prepared.tokens
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    jobs = [
        generation_request(
            f"{response_id}-{choice}",
            target,
            tokens,
            body,
            max_new_tokens=max_tokens,
            stop=body.stop_strings(),
            logprobs=body.logprobs,
            top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
            stream=body.stream,
            choice=choice,
        )
        for choice in range(body.n)
    ]
    handles = submit_all(submission, engine, [(job, prepared.names) for job in jobs])
    text = token_text(engine, model.name)
    if body.stream:
        events = _stream(body, handles, response_id, target.name, len(tokens), text, request_id, first_token)
        return EventStreamResponse(events, on_abort=lambda: cancel_all(handles))
    try:
        results = await final_results(handles, request.receive, first_token)
    except ClientDisconnectedError:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    generated = [result for result in results if isinstance(result, GenerationResult)]
    choices = [
        ChatChoice(
            index=index,
            message=AssistantMessage(content=result.text),
            logprobs=_chat_logprobs(result.tokens, result.logprobs, result.top_logprobs, text),
            finish_reason=openai_finish_reason(result),
        )
        for index, result in enumerate(generated)
    ]
    response = ChatCompletionResponse(
        id=response_id,
        created=created_now(),
        model=target.name,
        choices=choices,
        usage=openai_usage(
            len(tokens), sum(len(result.tokens) for result in generated), generated[0].cached_tokens
        ),
        pe=pe_block(generated[0].pe),
    )
    return json_response(response)


def _chat_logprobs(
    tokens: tuple[int, ...],
    logprobs: tuple[float, ...] | tuple[float | None, ...] | None,
    alternatives: tuple[TopLogprobs, ...] | None,
    text: TokenText,
) -> ChatLogprobs | None:
    if logprobs is None:
        return None
    tops = alternatives or tuple(() for _ in tokens)
    content = [
        ChatTokenLogprob(
            **_entry(token, logprob or 0.0, text).model_dump(),
            top_logprobs=[_entry(entry.token, entry.logprob, text) for entry in top],
        )
        for token, logprob, top in zip(tokens, logprobs, tops, strict=True)
    ]
    return ChatLogprobs(content=content)


def _entry(token: int, logprob: float, text: TokenText) -> ChatTopLogprob:
    string = text(token)
    return ChatTopLogprob(token=string, logprob=logprob, bytes=list(string.encode()))


async def _stream(
    body: ChatCompletionRequest,
    handles: list[RequestHandle],
    response_id: str,
    model: str,
    prompt_tokens: int,
    text: TokenText,
    request_id: str,
    on_event: Callable[[EngineEvent], None],
) -> AsyncIterator[bytes]:
    """The assistant role first for every choice, then content deltas, then each choice's end."""
    created = created_now()

    def chunk(choice: ChatChunkChoice, pe: PEBlock | None = None) -> bytes:
        return sse_event(
            ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice], pe=pe)
        )

    try:
        for index in range(len(handles)):
            yield chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")))
        completion_tokens = cached_tokens = 0
        async for index, event in merged_events(handles):
            on_event(event)
            if isinstance(event, TokenEvent):
                logprobs = _chat_logprobs(
                    (event.token,),
                    (event.logprob,) if event.logprob is not None else None,
                    (event.top_logprobs,) if event.top_logprobs is not None else None,
                    text,
                )
                yield chunk(
                    ChatChunkChoice(index=index, delta=ChatDelta(content=event.text), logprobs=logprobs)
                )
            elif isinstance(event, GenerationResult):
                completion_tokens += len(event.tokens)
                cached_tokens += event.cached_tokens if index == 0 else 0
                end = ChatChunkChoice(
                    index=index, delta=ChatDelta(), finish_reason=openai_finish_reason(event)
                )
                yield chunk(end, pe=pe_block(event.pe))
        if body.include_usage:
            usage = openai_usage(prompt_tokens, completion_tokens, cached_tokens)
            yield sse_event(
                ChatCompletionChunk(id=response_id, created=created, model=model, choices=[], usage=usage)
            )
        yield DONE
    except Exception as error:
        yield failure_event(error, request_id, openai=True)
