"""The engine requests, each built by one function, whichever protocol the request came in on.

A field a client may set reaches the engine through exactly one schema (`service.requests.bodies`,
`service.requests.sampling`) and one builder here; the transports call the builders with what
their own shapes name differently (`max_tokens` against `max_new_tokens`, `n` choices).
"""

from __future__ import annotations

from dataclasses import replace

from service.engine.types import GenerationRequest, Resumed, SamplingParams, ScoringRequest
from service.requests.bodies import GenerateRequest, ScoreRequest
from service.requests.prepare import PreparedInput, Target
from service.requests.sampling import MAX_SEED, SamplingControls


def generation_request(
    request_id: str,
    target: Target,
    prompt_tokens: tuple[int, ...],
    controls: SamplingControls,
    *,
    max_new_tokens: int,
    stop: tuple[str, ...],
    logprobs: bool,
    top_logprobs: int,
    stream: bool,
    choice: int = 0,
) -> GenerationRequest:
    """One generation; `choice` tells the n choices of one request apart (their seeds differ)."""
    seed = None if controls.seed is None else (controls.seed + choice) % (MAX_SEED + 1)
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=controls.temperature,
        top_k=controls.top_k,
        top_p=controls.top_p,
        seed=seed,
        stop=stop,
        logprobs=logprobs,
        min_p=controls.min_p,
        repetition_penalty=controls.repetition_penalty,
        presence_penalty=controls.presence_penalty,
        frequency_penalty=controls.frequency_penalty,
        ignore_eos=controls.ignore_eos,
        min_tokens=controls.min_tokens,
        stop_token_ids=tuple(controls.stop_token_ids),
        top_logprobs=top_logprobs,
    )
    return GenerationRequest(
        request_id=request_id,
        model=target.model.name,
        prompt_tokens=prompt_tokens,
        sampling=sampling,
        scaling=target.scaling,
        stream=stream,
        attention=target.attention,
    )


def generate_job(
    request_id: str, body: GenerateRequest, prepared: PreparedInput, *, stream: bool
) -> GenerationRequest:
    """The generation a `/generate` body or a gRPC `Generate` asks for (resumed, with `resume_from`)."""
    job = generation_request(
        request_id,
        prepared.target,
        prepared.tokens,
        body,
        max_new_tokens=body.max_new_tokens,
        stop=tuple(body.stop),
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs,
        stream=stream,
    )
    return resumed_job(job, prepared.resumed) if prepared.resumed else job


def resumed_job(job: GenerationRequest, held: tuple[int, ...]) -> GenerationRequest:
    """`job` continued after its stream was cut at `held`, the tokens its client has: they end the
    prompt and the sampling counts what is left (`service.engine.types.Resumed`)."""
    sampling = job.sampling
    left = replace(
        sampling,
        max_new_tokens=sampling.max_new_tokens - len(held),
        min_tokens=max(0, sampling.min_tokens - len(held)),
    )
    return replace(
        job,
        prompt_tokens=job.prompt_tokens + held,
        sampling=left,
        resumed=Resumed(tokens=len(held), min_tokens=sampling.min_tokens),
    )


def score_job(request_id: str, body: ScoreRequest, prepared: PreparedInput) -> ScoringRequest:
    """The scoring a `/score` body or a gRPC `Score` asks for."""
    return scoring_request(request_id, prepared.target, prepared.tokens, top_logprobs=body.top_logprobs)


def scoring_request(
    request_id: str, target: Target, tokens: tuple[int, ...], *, top_logprobs: int = 0
) -> ScoringRequest:
    """One scoring pass: the log-probability of every token given its prefix."""
    return ScoringRequest(
        request_id=request_id,
        model=target.model.name,
        tokens=tokens,
        scaling=target.scaling,
        top_logprobs=top_logprobs,
        attention=target.attention,
    )
