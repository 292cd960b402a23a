"""Learning-rate schedule: linear warm-up, then cosine decay to a floor.

Warm-up keeps AdamW's early, poorly estimated second moments from taking huge steps; the cosine
tail lets a short run settle instead of ending at its peak learning rate.
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, *, peak: float, warmup_steps: int, total_steps: int, floor: float) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return floor + (peak - floor) * cosine
