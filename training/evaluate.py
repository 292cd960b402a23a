"""Held-out bits per byte straight from the model's forward pass (used during training).

Tokens are bytes (plus one BOS and one EOS per file), so the mean next-token loss in bits is the
corpus' bits per byte up to those two framing tokens per file.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pe_runtime import RopeScaling

EVAL_BATCH = 16


def mean_nll_bits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood in bits; `logits` `[B, T, V]`, `targets` `[B, T]`."""
    nats = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return nats / math.log(2.0)


@torch.no_grad()
def windows_bits_per_byte(
    model: nn.Module, windows: torch.Tensor, scaling: RopeScaling | None = None
) -> float:
    """Score each window `[N, L]` in one forward pass: positions 1..L-1 given their prefix.

    This is what `/score` computes for one window, so the numbers match the benchmark's column
    at the trained context. `scaling` replaces the model's default one (None keeps it).
    """
    was_training = model.training
    model.eval()
    total_bits = 0.0
    for batch in torch.split(windows, EVAL_BATCH):
        logits = model(batch[:, :-1], scaling=scaling)  # [B, L - 1, V]
        total_bits += mean_nll_bits(logits, batch[:, 1:]).item() * batch[:, 1:].numel()
    model.train(was_training)
    return total_bits / windows[:, 1:].numel()
