"""Scoring: the log-probability of every token given its prefix, from one full forward pass.

This is the code path behind `/score`, exposed as a plain function so the extrapolation benchmark
measures exactly what the service reports. With a length-dependent scaling (dynamic NTK, LongRoPE)
every position uses the table for the whole sequence, as a full forward does; generation instead
uses, at each step, the table for the length so far, so the two agree only for static scalings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pe_runtime import RopeScaling
from service.engine.errors import RequestFailedError
from service.model.transformer import Transformer


def score_tokens(
    model: Transformer, tokens: Sequence[int], scaling: RopeScaling | None = None
) -> list[float | None]:
    """`[None, log p(t1 | t0), log p(t2 | t0 t1), ...]`; `scaling=None` is the model's default.

    Raises RequestFailedError when the model produces non-finite logits for this input.
    """
    device = model.embed_tokens.weight.device
    with torch.inference_mode():
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)  # [1, T]
        logits = model(ids, scaling=scaling)[0, :-1].float()  # [T-1, V]
        if not bool(torch.isfinite(logits).all()):
            raise RequestFailedError("the model produced non-finite logits for this input")
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]  # [T-1]
    return [None, *logprobs.cpu().tolist()]
