from __future__ import annotations

from itertools import pairwise

import pytest

from training.schedule import warmup_cosine


def lr_at(step: int) -> float:
    return warmup_cosine(step, peak=1.0, warmup_steps=10, total_steps=110, floor=0.1)


def test_warmup_rises_linearly_to_the_peak() -> None:
    assert lr_at(0) == pytest.approx(0.1)
    assert lr_at(4) == pytest.approx(0.5)
    assert lr_at(10) == pytest.approx(1.0)


def test_cosine_decays_monotonically_to_the_floor() -> None:
    decay = [lr_at(step) for step in range(10, 111)]
    assert all(later <= earlier for earlier, later in pairwise(decay))
    assert lr_at(60) == pytest.approx(0.55)
    assert lr_at(110) == pytest.approx(0.1)
    assert lr_at(500) == pytest.approx(0.1)
