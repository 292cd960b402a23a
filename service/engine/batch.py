"""The running batch of one model: its sequences and their shared, right-padded KV cache.

Requests admitted together are prefilled together when their prompts have the same length (rows
never interact, so that changes no result) and then join the batch; each decode step runs all
sequences in one forward pass, every row with its own RoPE scaling, and finished rows leave
before the next step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from service.engine.sequence import RunningSequence
from service.model.kv_cache import KVCache
from service.model.transformer import Transformer


class RunningBatch:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.sequences: list[RunningSequence] = []
        self._cache: KVCache | None = None
        self._joining: list[tuple[list[RunningSequence], KVCache]] = []

    def __len__(self) -> int:
        return len(self.sequences) + sum(len(group) for group, _ in self._joining)

    def prefill(self, sequences: list[RunningSequence]) -> Tensor:
        """Run prompts of one length into a fresh cache sized for the whole requests.

        Returns float32 logits [N, V] on CPU; the sequences join the batch at the next decode step.
        """
        requests = [sequence.request for sequence in sequences]
        capacity = max(len(request.prompt_tokens) + request.sampling.max_new_tokens for request in requests)
        cache = self.model.new_cache(len(sequences), capacity)
        tokens = torch.tensor([request.prompt_tokens for request in requests], device=self._device)  # [N, T]
        scalings = [sequence.scaling for sequence in sequences]
        with torch.inference_mode():
            logits: Tensor = self.model(tokens, scaling=scalings, cache=cache, last_n=1)[:, -1]  # [N, V]
        self._joining.append((sequences, cache))
        return logits.float().cpu()

    def decode(self) -> Tensor:
        """One token for every sequence in one forward pass; float32 logits [B, V] on CPU."""
        self._admit_joining()
        assert self._cache is not None
        return self._forward(self._cache, self.sequences)

    def decode_rows_alone(self) -> list[Tensor | Exception]:
        """The same step row by row, after a batched step raised: each row's logits or its error.

        Only the failing rows see an exception; the batch cache is rebuilt from the rows' own.
        """
        assert self._cache is not None
        outcomes: list[Tensor | Exception] = []
        caches = []
        for row, sequence in enumerate(self.sequences):
            cache = self._cache.select([row])
            try:
                outcomes.append(self._forward(cache, [sequence])[0])
            except Exception as error:
                outcomes.append(error)
            caches.append(cache)
        self._cache = KVCache.concat(caches)
        return outcomes

    def retain(self, keep: Callable[[RunningSequence], bool]) -> list[RunningSequence]:
        """Drop sequences for which `keep` is false (their cache rows too); return the dropped ones."""
        dropped = [sequence for sequence in self.sequences if not keep(sequence)]
        if dropped:
            rows = [index for index, sequence in enumerate(self.sequences) if keep(sequence)]
            self.sequences = [self.sequences[index] for index in rows]
            self._cache = self._cache.select(rows) if rows and self._cache is not None else None
        joining = []
        for group, cache in self._joining:
            rows = [index for index, sequence in enumerate(group) if keep(sequence)]
            dropped += [sequence for sequence in group if not keep(sequence)]
            if rows:
                joining.append(
                    (
                        [group[index] for index in rows],
                        cache if len(rows) == len(group) else cache.select(rows),
                    )
                )
        self._joining = joining
        return dropped

    @property
    def _device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _admit_joining(self) -> None:
        if not self._joining:
            return
        caches = ([self._cache] if self._cache is not None else []) + [cache for _, cache in self._joining]
        self._cache = KVCache.concat(caches)
        self.sequences += [sequence for group, _ in self._joining for sequence in group]
        self._joining = []

    def _forward(self, cache: KVCache, sequences: list[RunningSequence]) -> Tensor:
        tokens = torch.tensor([[s.last_token] for s in sequences], dtype=torch.long, device=self._device)
        with torch.inference_mode():
            scalings = [sequence.scaling for sequence in sequences]
            logits: Tensor = self.model(tokens, scaling=scalings, cache=cache, last_n=1)[:, -1]  # [B, V]
        return logits.float().cpu()
