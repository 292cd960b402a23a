"""One generation request while it runs: how much of its prompt is cached, its sampler, its text so
far, and when it is done. The engine core turns what it returns into events for the request.

A resumed generation (`GenerationRequest.resumed`) first reads the tokens it had produced before
its stream was cut, through the same steps as a new token except the event: its text stream is
then where the cut stream's was (text held back, stop strings that may span the cut), and if
those tokens had ended it, it is done before it runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pe_runtime import RopeScaling
from service.engine.models import ServedModel
from service.engine.sampler import Pick, Sampler
from service.engine.text_stream import TextStream
from service.engine.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    PEInfo,
    Timing,
    TokenEvent,
    TopLogprobs,
)


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
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    started_at: float = 0.0
    first_token_at: float = 0.0
    finish_reason: FinishReason | None = None
    prefilled: int = 0  # prompt tokens in the KV cache
    cached_tokens: int = 0  # of those, read from the pool's prefix cache instead of computed
    passed_over: int = 0  # prompt chunks that went to other rows since this row's last one
    # The whole generation's counts: a resumed request's `sampling` counts only what is left.
    _earlier: int = field(init=False)  # tokens produced before a cut: the prompt's last ones
    _min_tokens: int = field(init=False)
    _max_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        request, resumed = self.request, self.request.resumed
        self.scaling = self.served.effective_scaling(request.scaling)
        self._earlier = resumed.tokens if resumed is not None else 0
        self._min_tokens = resumed.min_tokens if resumed is not None else request.sampling.min_tokens
        self._max_tokens = self._earlier + request.sampling.max_new_tokens
        self.sampler = Sampler(
            request.sampling,
            prompt=request.prompt_tokens,
            eos_ids=self.served.spec.config.eos_ids,
            resumed=self._earlier,
        )
        self.stream = TextStream(
            self.served.tokenizer.decode, request.sampling.stop, incremental=request.stream
        )
        earlier = request.prompt_tokens[len(request.prompt_tokens) - self._earlier :]
        for produced, token in enumerate(earlier, start=1):
            self._advance(token, produced)
            if self.finish_reason is not None:
                break

    @property
    def prompt_remaining(self) -> int:
        return len(self.request.prompt_tokens) - self.prefilled

    def next_prompt_chunk(self, width: int) -> tuple[int, ...]:
        return self.request.prompt_tokens[self.prefilled : self.prefilled + width]

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def accept(self, pick: Pick) -> TokenEvent:
        """Take the sampled token, note whether the request is done, and return its event."""
        token = pick.token
        if not self.tokens:
            self.first_token_at = time.perf_counter()
        self.tokens.append(token)
        self.logprobs.append(pick.logprob)
        if pick.top_logprobs is not None:
            self.top_logprobs.append(pick.top_logprobs)
        text = self._advance(token, self._earlier + len(self.tokens))
        return TokenEvent(
            token=token,
            text=text,
            logprob=pick.logprob if self._wants_logprobs else None,
            top_logprobs=pick.top_logprobs,
        )

    def result(self) -> GenerationResult:
        now = time.perf_counter()
        first = self.first_token_at or now
        prompt_tokens = len(self.request.prompt_tokens) - self._earlier
        return GenerationResult(
            tokens=tuple(self.tokens),
            text=self.stream.text,
            logprobs=tuple(self.logprobs) if self._wants_logprobs else None,
            top_logprobs=tuple(self.top_logprobs) if self.request.sampling.top_logprobs else None,
            finish_reason=self.finish_reason or "cancelled",
            prompt_tokens=prompt_tokens,
            cached_tokens=min(self.cached_tokens, prompt_tokens),
            resumed=self._earlier,
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

    def _advance(self, token: int, produced: int) -> str:
        """Take the generation's `produced`-th token into its text and note whether it ends it;
        returns the text now safe to release."""
        reason = self._finish_reason(token, produced)
        text = self.stream.push(token, final=reason is not None, may_stop=produced >= self._min_tokens)
        if self.stream.stopped:
            reason = "stop"
        self.finish_reason = reason
        return text

    def _finish_reason(self, token: int, produced: int) -> FinishReason | None:
        """EOS and stop tokens end it once min_tokens are out (the sampler blocks them before)."""
        sampling = self.request.sampling
        if produced >= self._min_tokens:
            if token in self.served.spec.config.eos_ids and not sampling.ignore_eos:
                return "eos"
            if token in sampling.stop_token_ids:
                return "stop"
        if produced >= self._max_tokens:
            return "length"
        return None


def _ms(seconds: float) -> float:
    return round(max(seconds, 0.0) * 1000.0, 3)
