"""One generation request while it runs: how much of its prompt is cached, its sampler, its text so
far, and when it is done. The engine core turns what it returns into events for the request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pe_runtime import RopeScaling
from service.engine.models import ServedModel
from service.engine.sampler import Sampler
from service.engine.text_stream import TextStream
from service.engine.types import FinishReason, GenerationRequest, GenerationResult, PEInfo, Timing, TokenEvent


@dataclass(eq=False)  # identity: a running request is itself, whatever its state
class RunningSequence:
    key: int  # the job's key in the core
    request: GenerationRequest
    served: ServedModel
    pe: PEInfo
    submitted_at: float
    scaling: RopeScaling = field(init=False)  # the request's, or the model's own
    sampler: Sampler = field(init=False)
    stream: TextStream = field(init=False)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    started_at: float = 0.0
    first_token_at: float = 0.0
    finish_reason: FinishReason | None = None
    prefilled: int = 0  # prompt tokens in the KV cache
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.scaling = self.served.effective_scaling(self.request.scaling)
        self.sampler = Sampler(self.request.sampling)
        self.stream = TextStream(self.served.tokenizer.decode, self.request.sampling.stop)

    @property
    def prompt_remaining(self) -> int:
        return len(self.request.prompt_tokens) - self.prefilled

    def next_prompt_chunk(self, width: int) -> tuple[int, ...]:
        return self.request.prompt_tokens[self.prefilled : self.prefilled + width]

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def accept(self, token: int, logprob: float) -> TokenEvent:
        """Take the sampled token, note whether the request is done, and return its event."""
        if not self.tokens:
            self.first_token_at = time.perf_counter()
        self.tokens.append(token)
        self.logprobs.append(logprob)
        reason = self._finish_reason(token)
        text = self.stream.push(token, final=reason is not None)
        if self.stream.stopped:
            reason = "stop"
        self.finish_reason = reason
        return TokenEvent(token=token, text=text, logprob=logprob if self._wants_logprobs else None)

    def result(self) -> GenerationResult:
        now = time.perf_counter()
        first = self.first_token_at or now
        return GenerationResult(
            tokens=tuple(self.tokens),
            text=self.stream.text,
            logprobs=tuple(self.logprobs) if self._wants_logprobs else None,
            finish_reason=self.finish_reason or "cancelled",
            prompt_tokens=len(self.request.prompt_tokens),
            pe=self.pe,
            timing=Timing(
                queue_ms=_ms(self.started_at - self.submitted_at),
                prefill_ms=_ms(first - self.started_at),
                decode_ms=_ms(now - first),
            ),
        )

    @property
    def _wants_logprobs(self) -> bool:
        return self.request.sampling.logprobs

    def _finish_reason(self, token: int) -> FinishReason | None:
        if token in self.served.spec.config.eos_ids:
            return "eos"
        if len(self.tokens) >= self.request.sampling.max_new_tokens:
            return "length"
        return None


def _ms(seconds: float) -> float:
    return round(max(seconds, 0.0) * 1000.0, 3)
