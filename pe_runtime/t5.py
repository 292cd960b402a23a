"""T5 relative-position buckets: exact buckets for short distances, logarithmic ones up to max_distance."""

from __future__ import annotations

import math

import torch

from pe_runtime.errors import PEConfigError


def t5_relative_position_bucket(
    relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket index (long, same shape) for each relative position k - q.

    Bidirectional: half the buckets for keys after the query, half before. Causal: keys after the
    query share bucket 0 with the query itself (they are masked anyway). Within a direction the
    first half of the buckets are exact distances, the rest grow logarithmically up to max_distance,
    beyond which everything shares the last bucket. The log is taken in float32, as in T5, so the
    bucket edges match trained checkpoints exactly.
    """
    buckets_per_side = num_buckets // 2 if bidirectional else num_buckets
    exact = buckets_per_side // 2
    if exact < 1 or max_distance <= exact:
        raise PEConfigError(
            f"t5 buckets need num_buckets >= {4 if bidirectional else 2} and max_distance > the exact range, "
            f"got num_buckets={num_buckets}, max_distance={max_distance}",
            field="num_buckets" if exact < 1 else "max_distance",
        )
    relative_position = relative_position.to(torch.long)
    if bidirectional:
        side_offset = (relative_position > 0).to(torch.long) * buckets_per_side
        distance = relative_position.abs()
    else:
        side_offset = torch.zeros_like(relative_position)
        distance = (-relative_position).clamp(min=0)
    log_ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (buckets_per_side - exact)).to(torch.long)).clamp(max=buckets_per_side - 1)
    return side_offset + torch.where(distance < exact, distance, far)
