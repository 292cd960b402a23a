"""RopeScaling: Hugging Face dicts in, canonical hashable configs out, precise errors otherwise."""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any

import pytest

from pe_runtime import SCALING_TYPES, PEConfigError, RopeScaling, rope_inv_freq


def test_absent_and_default_mean_no_scaling() -> None:
    for config in (None, {}, {"rope_type": "default"}, {"type": "default", "rope_theta": 500000.0}):
        assert RopeScaling.from_hf(config, max_position_embeddings=2048) == RopeScaling()
    assert RopeScaling().to_dict() == {"type": "none"}


def test_legacy_type_key_and_aliases() -> None:
    assert RopeScaling.from_hf({"type": "linear", "factor": 2}, max_position_embeddings=8) == RopeScaling(
        type="linear", factor=2.0
    )
    phi3 = {"type": "su", "short_factor": [1.0, 1.0], "long_factor": [2.0, 4.0]}
    assert RopeScaling.from_hf(phi3, max_position_embeddings=4096).type == "longrope"


def test_yarn_gets_transformers_defaults() -> None:
    scaling = RopeScaling.from_hf({"rope_type": "yarn", "factor": 4.0}, max_position_embeddings=4096)
    assert scaling.to_dict() == {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": True,
    }


def test_missing_factor_is_derived_from_the_lengths_for_yarn_and_longrope() -> None:
    yarn = RopeScaling.from_hf(
        {"rope_type": "yarn", "original_max_position_embeddings": 4096}, max_position_embeddings=163840
    )
    assert yarn.factor == 40.0
    longrope = RopeScaling.from_hf(
        {
            "type": "longrope",
            "short_factor": [1.0],
            "long_factor": [2.0],
            "original_max_position_embeddings": 4096,
        },
        max_position_embeddings=131072,
    )
    assert longrope.factor == 32.0


def test_top_level_original_length_wins_only_where_transformers_lets_it() -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 2048}
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    lengths = {"max_position_embeddings": 131072, "original_max_position_embeddings": 8192}
    assert RopeScaling.from_hf(llama3, **lengths).original_max_position_embeddings == 8192
    assert RopeScaling.from_hf(dynamic, **lengths).original_max_position_embeddings == 131072


def test_model_keys_and_none_values_are_ignored() -> None:
    config = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "partial_rotary_factor": 0.5,
        "attention_factor": None,
    }
    scaling = RopeScaling.from_hf(config, max_position_embeddings=131072)
    assert scaling == RopeScaling(
        type="llama3", factor=8, original_max_position_embeddings=8192, low_freq_factor=1, high_freq_factor=4
    )


def test_equal_configs_are_equal_and_hash_alike() -> None:
    from_lists = RopeScaling.from_hf(
        {"rope_type": "longrope", "factor": 4, "short_factor": [1, 2], "long_factor": [3, 4]},
        max_position_embeddings=1024,
    )
    direct = RopeScaling(
        type="longrope",
        factor=4.0,
        original_max_position_embeddings=1024,
        short_factor=(1.0, 2.0),
        long_factor=(3.0, 4.0),
    )
    assert from_lists == direct and hash(from_lists) == hash(direct)
    assert {from_lists: "table"}[direct] == "table"
    assert from_lists != dataclasses.replace(direct, factor=5.0)


def test_pickling_rebuilds_an_equal_scaling() -> None:
    scaling = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=256, mscale=0.5)
    restored = pickle.loads(pickle.dumps(scaling))
    assert restored == scaling and hash(restored) == hash(scaling) and restored.to_dict() == scaling.to_dict()


@pytest.mark.parametrize(
    "config",
    [
        {"rope_type": "linear", "factor": 3.5},
        {"rope_type": "ntk", "factor": 8.0},
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 512},
        {"rope_type": "yarn", "factor": 16.0, "mscale": 0.707, "mscale_all_dim": 0.707, "truncate": False},
        {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
        {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.5],
            "long_factor": [2.0, 3.0],
            "attention_factor": 1.2,
        },
    ],
)
def test_to_dict_round_trips(config: dict[str, Any]) -> None:
    scaling = RopeScaling.from_hf(config, max_position_embeddings=16384)
    assert RopeScaling.from_hf(scaling.to_dict(), max_position_embeddings=1) == scaling
    assert scaling.to_dict()["type"] in SCALING_TYPES


YARN = {"rope_type": "yarn", "factor": 4.0}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"rope_type": "linear", "factor": 0.5}, "factor"),
        ({"rope_type": "linear", "factor": math.nan}, "factor"),
        ({"rope_type": "dynamic", "factor": math.inf}, "factor"),
        ({"rope_type": "ntk", "factor": "4"}, "factor"),
        ({"rope_type": "ntk", "factor": True}, "factor"),
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "rotary"}, "rope_type"),
        ({"type": "xpos", "factor": 2.0}, "type"),
        ({"rope_type": 7}, "rope_type"),
        ({"rope_type": "linear", "factor": 2.0, "fatcor": 2.0}, "fatcor"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 32}, "beta_fast"),
        ({"rope_type": "default", "factor": 2.0}, "factor"),
        (YARN | {"beta_fast": 1.0, "beta_slow": 1.0}, "beta_fast"),
        (YARN | {"beta_fast": 4.0, "beta_slow": 8.0}, "beta_fast"),
        (YARN | {"beta_slow": -1.0}, "beta_slow"),
        (YARN | {"mscale": math.nan}, "mscale"),
        (YARN | {"attention_factor": 0.0}, "attention_factor"),
        (YARN | {"truncate": "yes"}, "truncate"),
        (YARN | {"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
        (YARN | {"original_max_position_embeddings": 1.5}, "original_max_position_embeddings"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 8192}, "original_max_position_embeddings"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
            "high_freq_factor",
        ),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0}, "low_freq_factor"),
        ({"rope_type": "longrope", "long_factor": [2.0]}, "short_factor"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, "long_factor"),
        (LONGROPE | {"long_factor": [2.0]}, "long_factor"),
        (LONGROPE | {"short_factor": "1,1"}, "short_factor"),
        (LONGROPE | {"short_factor": []}, "short_factor"),
        (LONGROPE | {"long_factor": [2.0, -1.0]}, "long_factor"),
    ],
)
def test_bad_configs_name_the_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(PEConfigError) as raised:
        RopeScaling.from_hf(config, max_position_embeddings=4096)
    assert raised.value.field == field
    assert field in str(raised.value)


def test_max_position_embeddings_is_validated() -> None:
    with pytest.raises(PEConfigError) as raised:
        RopeScaling.from_hf(None, max_position_embeddings=0)
    assert raised.value.field == "max_position_embeddings"


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(PEConfigError, match="type") as raised:
        RopeScaling(type="bogus")
    assert raised.value.field == "type"
    with pytest.raises(PEConfigError) as raised:
        RopeScaling(type="dynamic", factor=2.0)
    assert raised.value.field == "original_max_position_embeddings"


@pytest.mark.parametrize(
    ("head_dim", "base", "field"), [(15, 10000.0, "head_dim"), (0, 10000.0, "head_dim"), (16, 1.0, "base")]
)
def test_bad_rope_shapes_name_the_field(head_dim: int, base: float, field: str) -> None:
    with pytest.raises(PEConfigError) as raised:
        rope_inv_freq(head_dim, base, None)
    assert raised.value.field == field


def test_longrope_factor_lists_must_match_the_rotary_dimension() -> None:
    scaling = RopeScaling.from_hf(LONGROPE, max_position_embeddings=4096)
    rope_inv_freq(4, 10000.0, scaling, seq_len=8192)
    for seq_len, field in ((None, "short_factor"), (8192, "long_factor")):
        with pytest.raises(PEConfigError) as raised:
            rope_inv_freq(16, 10000.0, scaling, seq_len)
        assert raised.value.field == field
