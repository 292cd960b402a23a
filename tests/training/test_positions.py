"""The position samplers of PoSE and randomized positions: ordered, in range, and seeded."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training.positions import pose_positions, randomized_positions

SEEDS = st.integers(min_value=0, max_value=2**32 - 1)


@st.composite
def pose_shapes(draw: st.DrawFn) -> tuple[int, int, int, int]:
    """(batch, length, target, chunks) with 1 <= chunks <= length <= target."""
    length = draw(st.integers(1, 64))
    return (
        draw(st.integers(1, 4)),
        length,
        draw(st.integers(length, 4 * length + 8)),
        draw(st.integers(1, min(length, 4))),
    )


@st.composite
def randomized_shapes(draw: st.DrawFn) -> tuple[int, int, int]:
    """(batch, length, max_position) with 1 <= length <= max_position."""
    length = draw(st.integers(1, 64))
    return draw(st.integers(1, 4)), length, draw(st.integers(length, 512))


@settings(max_examples=60, deadline=None)
@given(shape=pose_shapes(), seed=SEEDS)
def test_pose_positions_increase_inside_the_target_and_repeat_with_the_seed(
    shape: tuple[int, int, int, int], seed: int
) -> None:
    batch, length, target, chunks = shape
    positions = pose_positions(batch, length, target, torch.Generator().manual_seed(seed), chunks=chunks)

    assert positions.shape == (batch, length) and positions.dtype == torch.int64
    assert bool((positions[:, 1:] > positions[:, :-1]).all())  # strictly increasing: order kept
    assert int(positions.min()) >= 0 and int(positions.max()) < target
    # At most `chunks` contiguous pieces: a skip is a step larger than one.
    assert bool(((positions[:, 1:] - positions[:, :-1] > 1).sum(dim=1) <= chunks - 1).all())
    again = pose_positions(batch, length, target, torch.Generator().manual_seed(seed), chunks=chunks)
    assert torch.equal(positions, again)


@settings(max_examples=60, deadline=None)
@given(shape=randomized_shapes(), seed=SEEDS)
def test_randomized_positions_are_an_ordered_subset_of_the_range_and_repeat_with_the_seed(
    shape: tuple[int, int, int], seed: int
) -> None:
    batch, length, max_position = shape
    positions = randomized_positions(batch, length, max_position, torch.Generator().manual_seed(seed))

    assert positions.shape == (batch, length) and positions.dtype == torch.int64
    assert bool((positions[:, 1:] > positions[:, :-1]).all())  # sorted and distinct
    assert int(positions.min()) >= 0 and int(positions.max()) < max_position
    again = randomized_positions(batch, length, max_position, torch.Generator().manual_seed(seed))
    assert torch.equal(positions, again)


def test_the_samplers_reach_past_the_window_and_differ_between_seeds() -> None:
    """What the methods are for: a 256-token window whose positions span the long range."""
    pose = pose_positions(64, 256, 1024, torch.Generator().manual_seed(0))
    randomized = randomized_positions(64, 256, 4096, torch.Generator().manual_seed(0))
    assert int(pose.max()) > 768 and int(randomized.max()) > 3500
    assert not torch.equal(pose, pose_positions(64, 256, 1024, torch.Generator().manual_seed(1)))
    assert not torch.equal(randomized, randomized_positions(64, 256, 4096, torch.Generator().manual_seed(1)))


@pytest.mark.parametrize(
    "call",
    [
        lambda: pose_positions(1, 8, 4, torch.Generator()),  # window longer than the target
        lambda: pose_positions(1, 2, 8, torch.Generator(), chunks=3),  # more chunks than tokens
        lambda: randomized_positions(1, 8, 4, torch.Generator()),  # more positions than the range
    ],
)
def test_impossible_shapes_are_refused(call: object) -> None:
    with pytest.raises(ValueError, match="need"):
        call()  # type: ignore[operator]
