"""Scoring: the log-probability of every token given its prefix, from one full forward pass.

This is the code path behind `/score`, exposed as a plain function so the extrapolation benchmark
measures exactly what the service reports. With a length-dependent scaling (dynamic NTK, LongRoPE)
every position uses the table for the whole sequence, as a full forward does; generation instead
uses, at each step, the table for the length so far, so the two agree only for static scalings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pe_runtime import RopeScaling
from service.engine.errors import RequestFailedError
from service.model.transformer import Transformer

# Positions projected to the vocabulary at once: bounds the [N, V] float32 logits to a few hundred
# MiB even for 150k-token vocabularies, whatever the input length.
_CHUNK = 512


def score_tokens(
    model: Transformer, tokens: Sequence[int], scaling: RopeScaling | None = None
) -> list[float | None]:
    """`[None, log p(t1 | t0), log p(t2 | t0 t1), ...]`; `scaling=None` is the model's default.

    Raises RequestFailedError when the model produces non-finite logits for this input.
    """
    device = model.embed_tokens.weight.device
    with torch.inference_mode():
        ids = torch.tensor(list(tokens), dtype=torch.long, device=device)  # [T]
        hidden = model.final_hidden(ids[None], scaling=scaling)[0, :-1]  # [T-1, D]
        chunks = [
            _chunk_logprobs(model, hidden[start : start + _CHUNK], ids[start + 1 : start + 1 + _CHUNK])
            for start in range(0, hidden.shape[0], _CHUNK)
        ]
    return [None, *torch.cat(chunks).cpu().tolist()]


def _chunk_logprobs(model: Transformer, hidden: Tensor, targets: Tensor) -> Tensor:
    """log p(target) for hidden states [N, D] and targets [N]; raises on non-finite logits."""
    logits = model.lm_head(hidden).float()  # [N, V]
    if not bool(torch.isfinite(logits).all()):
        raise RequestFailedError("the model produced non-finite logits for this input")
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
