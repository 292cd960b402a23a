"""What sampling reads of a step's logits, in one pass over them (`logit_rows.c`) where the
logits are float32 on a CPU, else in torch reductions that give the same."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from service.model.kernels.build import kernel_function, use_threads

_SOURCE = Path(__file__).with_name("logit_rows.c")


class LogitRows(NamedTuple):
    """Per row of logits [B, V]: whether all its entries are finite, its largest entry's first
    index, and its log-sum-exp (a float32 tensor [B] on the logits' device; a row that is not all
    finite has NaN and index 0)."""

    finite: list[bool]
    argmaxes: list[int]
    log_sums: Tensor

    def of(self, rows: Sequence[int]) -> LogitRows:
        """These rows only, in this order."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.log_sums.device)
        return LogitRows(
            [self.finite[row] for row in rows], [self.argmaxes[row] for row in rows], self.log_sums[index]
        )


def available() -> bool:
    """Whether the kernel is built and loaded in this process (built now if it was not)."""
    return kernel_function(_SOURCE, "logit_rows") is not None


def logit_rows(logits: Tensor) -> LogitRows:
    """The summary of float32 logits [B, V]."""
    kernel = kernel_function(_SOURCE, "logit_rows") if logits.device.type == "cpu" else None
    if kernel is None or logits.dtype != torch.float32:
        return _torch_rows(logits)
    logits = logits.contiguous()
    rows, vocab = logits.shape
    finite = torch.empty(rows, dtype=torch.int64)
    argmaxes = torch.empty(rows, dtype=torch.int64)
    log_sums = torch.empty(rows, dtype=torch.float32)
    use_threads(_SOURCE, torch.get_num_threads())
    kernel(logits.data_ptr(), rows, vocab, finite.data_ptr(), argmaxes.data_ptr(), log_sums.data_ptr())
    return LogitRows([bool(flag) for flag in finite.tolist()], argmaxes.tolist(), log_sums)


def _torch_rows(logits: Tensor) -> LogitRows:
    # A row's largest and smallest entries are finite exactly when all are (NaN reaches both).
    finite = torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))
    argmaxes = torch.where(finite, logits.argmax(dim=-1), 0)
    log_sums = torch.where(finite, torch.logsumexp(logits, dim=-1), float("nan"))
    flags, indices = torch.stack([finite.long(), argmaxes]).tolist()  # one sync with the device
    return LogitRows([bool(flag) for flag in flags], indices, log_sums)
