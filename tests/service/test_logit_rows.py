"""The logits summary sampling reads (`logit_rows.c`) against its torch reductions: finiteness,
the first index of the largest entry, and the log-sum-exp, on one or two threads."""

from __future__ import annotations

import pytest
import torch

from service.model.kernels import logit_rows as module
from service.model.kernels.logit_rows import LogitRows, logit_rows
from tests.kernels import require_kernel, torch_threads


@pytest.fixture(autouse=True)
def _kernel() -> None:
    require_kernel(module.available, "logit rows")


def rows_with_every_case(vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(9, vocab, generator=generator) * 8.0
    logits[1, vocab // 2] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, vocab - 1] = float("-inf")
    logits[4, [5, vocab - 3]] = 1e4  # a tie far above the rest: the first index, exp underflowing
    logits[5] = -3.0  # all equal
    logits[6, -1] = logits[6].max() + 1.0  # the largest last
    logits[7] *= 1e-3
    logits[8] = torch.linspace(-2000.0, 50.0, vocab)
    return logits


def reference(logits: torch.Tensor) -> LogitRows:
    finite = torch.isfinite(logits).all(dim=-1)
    flags = finite.tolist()
    argmaxes = [r.tolist().index(r.max().item()) if ok else 0 for r, ok in zip(logits, flags, strict=True)]
    log_sums = torch.where(finite, torch.logsumexp(logits.double(), dim=-1).float(), float("nan"))
    return LogitRows(finite.tolist(), argmaxes, log_sums)


@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
@pytest.mark.parametrize("vocab", [1, 17, 49152], ids=["1", "17", "49152"])
def test_the_kernel_gives_the_reductions_torch_gives(vocab: int, threads: int) -> None:
    logits = rows_with_every_case(vocab) if vocab > 8 else torch.randn(3, vocab)
    expected = reference(logits)
    with torch_threads(threads):
        ours = logit_rows(logits)
    fallback = module._torch_rows(logits)
    for summary in (ours, fallback):
        assert summary.finite == expected.finite and summary.argmaxes == expected.argmaxes
        torch.testing.assert_close(summary.log_sums, expected.log_sums, rtol=2e-6, atol=1e-5, equal_nan=True)
    if vocab > 8:
        assert ours.finite == [True, False, False, False, True, True, True, True, True]
        assert ours.argmaxes[4] == 5 and ours.argmaxes[5] == 0 and ours.argmaxes[6] == vocab - 1


def test_a_subset_of_rows_keeps_their_order() -> None:
    logits = rows_with_every_case(64)
    summary = logit_rows(logits).of([8, 0, 4])
    whole = reference(logits)
    assert summary.argmaxes == [whole.argmaxes[8], whole.argmaxes[0], whole.argmaxes[4]]
    torch.testing.assert_close(summary.log_sums, whole.log_sums[[8, 0, 4]], rtol=2e-6, atol=1e-5)
