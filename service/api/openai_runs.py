"""What the OpenAI routes share: submitting a request's jobs together, and OpenAI's vocabulary.

One OpenAI request may become several engine jobs (`n` choices, several prompts, an echoed
prompt's score). They are submitted at once and, should one submission be refused (queue full,
draining), the ones already queued are cancelled, so a refused request leaves nothing running.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from service.api.schemas.openai import OpenAIFinishReason, OpenAIUsage, PromptTokensDetails
from service.engine.types import (
    Engine,
    FieldNames,
    GenerationRequest,
    GenerationResult,
    RequestHandle,
    ScoringRequest,
)
from service.requests.convert import finish_reason
from service.requests.running import Submission


def submit_all(
    submission: Submission,
    engine: Engine,
    jobs: Sequence[tuple[GenerationRequest | ScoringRequest, FieldNames]],
) -> list[RequestHandle]:
    """Queue every job (each with how the request named its input), or none: a refused
    submission (a bad input, queue full, a per-key limit, draining) cancels the jobs queued before it."""
    handles: list[RequestHandle] = []
    try:
        for job, names in jobs:
            handles.append(submission.submit(engine, job, names))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return handles


def cancel_all(handles: Sequence[RequestHandle]) -> None:
    for handle in handles:
        handle.cancel()


def openai_finish_reason(result: GenerationResult) -> OpenAIFinishReason:
    """OpenAI knows "stop" and "length"; EOS is a stop (a cancelled generation is a 503 as on /generate)."""
    return "length" if finish_reason(result) == "length" else "stop"


def openai_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> OpenAIUsage:
    """`cached_tokens`: of the prompt tokens, those its first choice read from the prefix cache
    (a prompt is counted once, whatever `n`)."""
    return OpenAIUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def created_now() -> int:
    return int(time.time())
