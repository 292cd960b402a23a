"""A learned table stretched for linear scaling is built once per factor, not once per decode pass,
and never outlives the weights it was built from."""

from __future__ import annotations

import pytest
import torch

from pe_runtime import RopeScaling, interpolate_learned
from service.model.positional import STRETCHED_TABLES_KEPT
from service.model.transformer import Transformer
from tests.conftest import tiny_transformer

NATIVE = 16
LINEAR = RopeScaling(type="linear", factor=4.0)


@pytest.fixture
def model() -> Transformer:
    return tiny_transformer(pe="learned", native_context=NATIVE)


def learned_weight(model: Transformer) -> torch.Tensor:
    table = model.positions.learned_table
    assert table is not None
    return table.weight


@torch.inference_mode()
def test_the_same_factor_and_weights_reuse_one_table(model: Transformer) -> None:
    weight = learned_weight(model)
    first = model.positions._stretched_learned(weight, 4.0)
    assert model.positions._stretched_learned(weight, 4.0) is first
    assert model.positions._stretched_learned(weight, 2.0) is not first
    assert torch.equal(first, interpolate_learned(weight, 4.0))


def test_weights_changed_in_place_rebuild_the_table(model: Transformer) -> None:
    tokens = torch.randint(0, 258, (1, 3 * NATIVE), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(tokens, scaling=LINEAR)  # fills the cache from the original weights
    with torch.no_grad():
        learned_weight(model).mul_(3.0)
    fresh = tiny_transformer(pe="learned", native_context=NATIVE)
    fresh.load_state_dict(model.state_dict())
    with torch.inference_mode():
        assert torch.equal(model(tokens, scaling=LINEAR), fresh(tokens, scaling=LINEAR))


def test_training_through_a_stretched_table_reaches_the_learned_weights(model: Transformer) -> None:
    tokens = torch.randint(0, 258, (1, 3 * NATIVE), generator=torch.Generator().manual_seed(0))
    model(tokens, scaling=LINEAR).logsumexp(-1).mean().backward()
    grad = learned_weight(model).grad
    assert grad is not None and grad.abs().sum() > 0
    assert not model.positions._stretched  # nothing cached that holds an autograd graph


@torch.inference_mode()
def test_only_a_bounded_number_of_factors_is_kept(model: Transformer) -> None:
    weight = learned_weight(model)
    factors = [1.0 + 0.5 * i for i in range(1, STRETCHED_TABLES_KEPT + 4)]
    for factor in factors:
        model.positions._stretched_learned(weight, factor)
    assert list(model.positions._stretched) == factors[-STRETCHED_TABLES_KEPT:]
