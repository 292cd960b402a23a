"""POST /v1/completions: OpenAI's legacy completions API over the engine, JSON or SSE.

Each prompt becomes `n` generations (none when `max_tokens` is 0). With `echo` and `logprobs`, the
prompt's log-probabilities come from the engine's scoring path, the one `/score` runs, so they
equal `/score`'s exactly: this is how evaluation harnesses compute log-likelihoods. Choices are
numbered prompt by prompt, `n` per prompt, as OpenAI numbers them.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request, Response

from service.api.deps import AliasesDep, EngineDep, FirstTokenDep, RequestIdDep, SubmissionDep, require_json
from service.api.errors import CLIENT_CLOSED_REQUEST
from service.api.handles import ClientDisconnectedError, final_results
from service.api.openai_runs import cancel_all, created_now, openai_finish_reason, openai_usage, submit_all
from service.api.openapi import openai_errors, openai_stream
from service.api.responses import json_response
from service.api.schemas.openai import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    OpenAIFinishReason,
)
from service.api.streaming import DONE, EventStreamResponse, failure_event, merged_events, sse_event
from service.engine.catalog import MIN_SCORED_TOKENS
from service.engine.types import (
    Engine,
    EngineEvent,
    FieldNames,
    GenerationRequest,
    GenerationResult,
    PEInfo,
    RequestHandle,
    ScoreResult,
    ScoringRequest,
    TokenEvent,
    TopLogprobs,
)
from service.requests.build import generation_request, scoring_request
from service.requests.convert import TokenText, pe_block, token_text
from service.requests.prepare import PreparedInput, Target, prepare_for, resolve_target

router = APIRouter(tags=["openai"], dependencies=[Depends(require_json)])


@dataclass(frozen=True)
class _Prompt:
    tokens: tuple[int, ...]
    text: str  # what echo returns: the prompt as given, or its tokens decoded


@dataclass
class _Plan:
    """What a request runs: its prompts, and a job per choice and per echoed score, each with the
    names the request gave its input (for the errors of the checks at submission)."""

    prompts: list[PreparedInput]
    generations: list[tuple[GenerationRequest, FieldNames]]  # choice order; empty when max_tokens is 0
    scores: dict[int, tuple[ScoringRequest, FieldNames]]  # prompt index -> its score (echo with logprobs)


@dataclass(frozen=True)
class _Answer:
    """What the response reads of each prompt, once every one has passed its checks."""

    prompts: list[_Prompt]
    unrun_pe: PEInfo | None  # with no generation: the first prompt's, where no score reports it

    def pe_without_generation(self, scored: dict[int, ScoreResult]) -> PEInfo:
        """The `pe` block of a request that generates nothing: its first prompt's configuration,
        from that prompt's score or its checks."""
        return self.unrun_pe if self.unrun_pe is not None else scored[0].pe


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={**openai_stream(CompletionResponse), **openai_errors()},
)
async def completions(
    body: CompletionRequest,
    request: Request,
    engine: EngineDep,
    request_id: RequestIdDep,
    first_token: FirstTokenDep,
    submission: SubmissionDep,
    aliases: AliasesDep,
) -> Response:
    """OpenAI's completions; extension fields (`pe`, `pe_scaling`, `min_p`, ...) at the top level."""
    target = resolve_target(engine, body, aliases)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    plan = _plan(engine, target, body, response_id)
    # With no generation, a prompt that is not scored meets its checks here, queueing nothing.
    unrun = {
        index: engine.check_input(
            target.model.name,
            prepared.tokens,
            new_tokens=0,
            scaling=target.scaling,
            attention=target.attention,
            names=prepared.names,
        )
        for index, prepared in enumerate(plan.prompts)
        if not plan.generations and index not in plan.scores
    }
    score_order = sorted(plan.scores)
    handles = submit_all(
        submission, engine, [*plan.generations, *(plan.scores[index] for index in score_order)]
    )
    generations, scores = (
        handles[: len(plan.generations)],
        dict(zip(score_order, handles[len(plan.generations) :], strict=True)),
    )
    answer = _Answer(prompts=_echoed(engine, target, body, plan), unrun_pe=unrun.get(0))
    text = token_text(engine, target.model.name)
    if body.stream:
        events = _stream(
            body, answer, generations, scores, response_id, target.name, text, request_id, first_token
        )
        return EventStreamResponse(events, on_abort=lambda: cancel_all(handles))
    try:
        results = await final_results(handles, request.receive, first_token)
    except ClientDisconnectedError:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    generated = [
        result for result in results[: len(plan.generations)] if isinstance(result, GenerationResult)
    ]
    scored = {
        index: result
        for index, result in zip(score_order, results[len(plan.generations) :], strict=True)
        if isinstance(result, ScoreResult)
    }
    return json_response(_response(body, answer, generated, scored, response_id, target.name, text))


def _plan(engine: Engine, target: Target, body: CompletionRequest, response_id: str) -> _Plan:
    prompts = [
        prepare_for(
            engine,
            target,
            given,
            field="prompt" if isinstance(given, str) else f"prompt.{index}",
            new_tokens_field="max_tokens",
            length_field="prompt",
        )
        for index, given in enumerate(body.prompts())
    ]
    wants_logprobs = body.logprobs is not None
    generations = [
        (
            generation_request(
                f"{response_id}-{choice}",
                target,
                prompts[choice // body.n].tokens,
                body,
                max_new_tokens=body.max_tokens,
                stop=body.stop_strings(),
                logprobs=wants_logprobs,
                top_logprobs=body.logprobs or 0,
                stream=body.stream,
                choice=choice % body.n,
            ),
            prompts[choice // body.n].names,
        )
        for choice in range(len(prompts) * body.n)
        if body.max_tokens > 0
    ]
    scores = {
        index: (
            scoring_request(
                f"{response_id}-prompt-{index}", target, prompt.tokens, top_logprobs=body.logprobs or 0
            ),
            prompt.names,
        )
        for index, prompt in enumerate(prompts)
        if body.echo
        and wants_logprobs
        and len(prompt.tokens) >= MIN_SCORED_TOKENS  # one has nothing to score
    }
    return _Plan(prompts=prompts, generations=generations, scores=scores)


def _echoed(engine: Engine, target: Target, body: CompletionRequest, plan: _Plan) -> list[_Prompt]:
    """Each prompt with what echo returns: the text as given, or its ids decoded (which can be
    done only now that they have passed the vocabulary check)."""
    return [
        _Prompt(
            tokens=prepared.tokens,
            text=given
            if isinstance(given, str)
            else engine.detokenize(target.model.name, list(prepared.tokens)),
        )
        for given, prepared in zip(body.prompts(), plan.prompts, strict=True)
    ]


def _choices(prompts: Sequence[_Prompt], n: int) -> list[tuple[int, _Prompt]]:
    return [(index * n + copy, prompt) for index, prompt in enumerate(prompts) for copy in range(n)]


def _response(
    body: CompletionRequest,
    answer: _Answer,
    generated: list[GenerationResult],
    scored: dict[int, ScoreResult],
    response_id: str,
    model: str,
    text: TokenText,
) -> CompletionResponse:
    choices = []
    for choice, prompt in _choices(answer.prompts, body.n):
        result = generated[choice] if generated else None
        prompt_index = choice // body.n
        logprobs = None
        if body.logprobs is not None:
            pieces = _prompt_pieces(prompt, scored.get(prompt_index)) if body.echo else []
            if result is not None:
                pieces += _generated_pieces(result)
            logprobs = _legacy_logprobs(pieces, text)
        choices.append(
            CompletionChoice(
                index=choice,
                text=(prompt.text if body.echo else "") + (result.text if result is not None else ""),
                logprobs=logprobs,
                finish_reason=openai_finish_reason(result) if result is not None else "length",
            )
        )
    completion_tokens = sum(len(result.tokens) for result in generated)
    pe = generated[0].pe if generated else answer.pe_without_generation(scored)
    return CompletionResponse(
        id=response_id,
        created=created_now(),
        model=model,
        choices=choices,
        usage=openai_usage(
            sum(len(prompt.tokens) for prompt in answer.prompts),
            completion_tokens,
            sum(result.cached_tokens for index, result in enumerate(generated) if index % body.n == 0),
        ),
        pe=pe_block(pe),
    )


# A token with its raw log-probability (None for the first prompt token) and its alternatives.
_Piece = tuple[int, float | None, TopLogprobs | None]


def _prompt_pieces(prompt: _Prompt, score: ScoreResult | None) -> list[_Piece]:
    if score is None:  # a one-token prompt: nothing predicts it
        return [(token, None, None) for token in prompt.tokens]
    alternatives = score.top_logprobs or [None] * len(score.tokens)
    return list(zip(score.tokens, score.token_logprobs, alternatives, strict=True))


def _generated_pieces(result: GenerationResult) -> list[_Piece]:
    assert result.logprobs is not None
    alternatives = result.top_logprobs or [None] * len(result.tokens)
    return list(zip(result.tokens, result.logprobs, alternatives, strict=True))


def _legacy_logprobs(pieces: Sequence[_Piece], text: TokenText, offset: int = 0) -> CompletionLogprobs:
    """OpenAI's legacy logprobs: alternatives by text, always with the chosen token among them."""
    strings = [text(token) for token, _, _ in pieces]
    tops: list[dict[str, float] | None] = []
    offsets = []
    for (_, logprob, alternatives), string in zip(pieces, strings, strict=True):
        offsets.append(offset)
        offset += len(string)
        if logprob is None:
            tops.append(None)
            continue
        top = {text(entry.token): entry.logprob for entry in alternatives or ()}
        top.setdefault(string, logprob)
        tops.append(top)
    return CompletionLogprobs(
        tokens=strings,
        token_logprobs=[logprob for _, logprob, _ in pieces],
        top_logprobs=tops,
        text_offset=offsets,
    )


async def _stream(
    body: CompletionRequest,
    answer: _Answer,
    generations: list[RequestHandle],
    scores: dict[int, RequestHandle],
    response_id: str,
    model: str,
    text: TokenText,
    request_id: str,
    on_event: Callable[[EngineEvent], None],
) -> AsyncIterator[bytes]:
    """Echoed prompts first (once their scores are in), then tokens as they come, then the ends."""
    created = created_now()

    def chunk(
        index: int,
        piece: str,
        logprobs: CompletionLogprobs | None,
        finish: OpenAIFinishReason | None = None,
        pe: PEInfo | None = None,
    ) -> bytes:
        choice = CompletionChoice(index=index, text=piece, logprobs=logprobs, finish_reason=finish)
        block = pe_block(pe) if pe is not None else None
        return sse_event(
            CompletionResponse(id=response_id, created=created, model=model, choices=[choice], pe=block)
        )

    try:
        scored: dict[int, ScoreResult] = {}
        for index, handle in scores.items():
            async for event in handle:
                if isinstance(event, ScoreResult):
                    scored[index] = event
        offsets = [0] * (len(answer.prompts) * body.n)
        for choice, prompt in _choices(answer.prompts, body.n):
            if body.echo:
                pieces = _prompt_pieces(prompt, scored.get(choice // body.n))
                logprobs = _legacy_logprobs(pieces, text) if body.logprobs is not None else None
                offsets[choice] = sum(len(text(token)) for token in prompt.tokens)
                yield chunk(choice, prompt.text, logprobs)
            if not generations:
                yield chunk(choice, "", None, "length", answer.pe_without_generation(scored))
        completion_tokens = cached_tokens = 0
        async for choice, event in merged_events(generations):
            on_event(event)
            if isinstance(event, TokenEvent):
                logprobs = None
                if body.logprobs is not None:
                    logprobs = _legacy_logprobs(
                        [(event.token, event.logprob, event.top_logprobs)], text, offsets[choice]
                    )
                    offsets[choice] += len(text(event.token))
                yield chunk(choice, event.text, logprobs)
            elif isinstance(event, GenerationResult):
                completion_tokens += len(event.tokens)
                cached_tokens += event.cached_tokens if choice % body.n == 0 else 0
                yield chunk(choice, "", None, openai_finish_reason(event), event.pe)
        if body.include_usage:
            prompt_tokens = sum(len(prompt.tokens) for prompt in answer.prompts)
            usage = openai_usage(prompt_tokens, completion_tokens, cached_tokens)
            yield sse_event(
                CompletionResponse(id=response_id, created=created, model=model, choices=[], usage=usage)
            )
        yield DONE
    except Exception as error:
        yield failure_event(error, request_id, openai=True)
