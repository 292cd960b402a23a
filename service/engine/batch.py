"""The running batch of one model: its sequences and their shared, right-padded KV cache.

Sequences are prefilled alone (so a prompt's logits never depend on its neighbours) and then
join the batch; each decode step runs all of them in one forward pass, every row with its own
RoPE scaling, and finished rows leave before the next step.
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
        self._joining: list[tuple[RunningSequence, KVCache]] = []

    def __len__(self) -> int:
        return len(self.sequences) + len(self._joining)

    def prefill(self, sequence: RunningSequence) -> Tensor:
        """Run the prompt alone into a fresh cache sized for the whole request; float32 logits [V]."""
        prompt = sequence.request.prompt_tokens
        cache = self.model.new_cache(1, len(prompt) + sequence.request.sampling.max_new_tokens)
        tokens = torch.tensor([prompt], dtype=torch.long, device=self._device)  # [1, T]
        with torch.inference_mode():
            logits: Tensor = self.model(tokens, scaling=[sequence.scaling], cache=cache, last_n=1)[0, -1]
        self._joining.append((sequence, cache))
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
        rows = [index for index, sequence in enumerate(self.sequences) if keep(sequence)]
        dropped = [sequence for sequence in self.sequences if not keep(sequence)]
        joining_dropped = [sequence for sequence, _ in self._joining if not keep(sequence)]
        self._joining = [(sequence, cache) for sequence, cache in self._joining if keep(sequence)]
        if len(rows) != len(self.sequences):
            self.sequences = [self.sequences[index] for index in rows]
            self._cache = self._cache.select(rows) if rows and self._cache is not None else None
        return dropped + joining_dropped

    @property
    def _device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _admit_joining(self) -> None:
        if not self._joining:
            return
        caches = ([self._cache] if self._cache is not None else []) + [cache for _, cache in self._joining]
        self._cache = KVCache.concat(caches)
        self.sequences += [sequence for sequence, _ in self._joining]
        self._joining = []

    def _forward(self, cache: KVCache, sequences: list[RunningSequence]) -> Tensor:
        tokens = torch.tensor([[s.last_token] for s in sequences], dtype=torch.long, device=self._device)
        with torch.inference_mode():
            scalings = [sequence.scaling for sequence in sequences]
            logits: Tensor = self.model(tokens, scaling=scalings, cache=cache, last_n=1)[:, -1]  # [B, V]
        return logits.float().cpu()
