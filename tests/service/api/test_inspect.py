"""POST /inspect on a live server: its numbers are pe_runtime's, and bad input is a 422 naming the field.

The expected values are computed here with pe_runtime's pure functions (not its cache), so the
route's use of `PECache`, its slicing of the neox table and its T5 indexing are all checked.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from pe_runtime import (
    RopeScaling,
    alibi_bias,
    alibi_slopes,
    rope_cos_sin,
    rope_inv_freq,
    rope_seq_len_key,
    sinusoidal_table,
    t5_relative_position_bucket,
)
from service.api.schemas.inspect import MAX_CELLS, MAX_HEADS, MAX_LENGTH
from service.requests.scaling import SCALING_EXAMPLES
from tests.service.api.helpers import assert_error_shape

NATIVE = 128
LENGTH = 300
HEAD_DIM = 16
BASE = 500.0


def inspect(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/inspect", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def assert_equal(actual: list[Any], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(actual, dtype=expected.dtype), expected, rtol=0, atol=0)


@pytest.mark.parametrize("scaling_type", list(SCALING_EXAMPLES))
def test_rope_tables_are_pe_runtime_s(client: httpx.Client, scaling_type: str) -> None:
    requested = {**SCALING_EXAMPLES[scaling_type], "original_max_position_embeddings": NATIVE}
    if scaling_type in ("none", "linear", "ntk"):
        requested.pop("original_max_position_embeddings")
    if scaling_type == "dynamic":
        requested["dynamic_mode"] = "bucketed"  # the API's default, unlike from_hf's
    result = inspect(
        client,
        pe="rope",
        pe_scaling=requested,
        length=LENGTH,
        native_context=NATIVE,
        head_dim=HEAD_DIM,
        rope_base=BASE,
    )
    scaling = RopeScaling.from_hf(requested, max_position_embeddings=NATIVE)
    inv_freq, attention_factor = rope_inv_freq(HEAD_DIM, BASE, scaling, rope_seq_len_key(scaling, LENGTH))
    cos, sin = rope_cos_sin(
        inv_freq, attention_factor, LENGTH, layout="neox", dtype=torch.float32, device="cpu"
    )
    assert result["scaling"] == scaling.to_dict()
    assert result["attention_factor"] == attention_factor
    rope = result["rope"]
    assert_equal(rope["inv_freq"], inv_freq)
    assert_equal(rope["inv_freq_unscaled"], rope_inv_freq(HEAD_DIM, BASE, None)[0])
    assert_equal(rope["cos"], cos[:, : HEAD_DIM // 2])
    assert_equal(rope["sin"], sin[:, : HEAD_DIM // 2])
    assert result["alibi"] is None and result["t5_bias"] is None and result["sinusoidal"] is None


def test_dynamic_ntk_follows_the_sequence_length(client: httpx.Client) -> None:
    scaling = {"type": "dynamic", "factor": 4.0, "dynamic_mode": "hf"}
    short = inspect(client, pe_scaling=scaling, length=64, native_context=NATIVE, seq_len=NATIVE)
    long = inspect(client, pe_scaling=scaling, length=64, native_context=NATIVE, seq_len=4 * NATIVE)
    assert short["rope"]["inv_freq"] == short["rope"]["inv_freq_unscaled"]
    resolved = RopeScaling.from_hf(scaling, max_position_embeddings=NATIVE)
    assert_equal(long["rope"]["inv_freq"], rope_inv_freq(32, 10000.0, resolved, 4 * NATIVE)[0])
    assert long["rope"]["seq_len"] == 4 * NATIVE


def test_alibi_slopes_and_bias_are_pe_runtime_s(client: httpx.Client) -> None:
    result = inspect(client, pe="alibi", length=24, num_heads=12)
    positions = torch.arange(24)
    assert_equal(result["alibi"]["slopes"], alibi_slopes(12))
    assert_equal(result["alibi"]["bias"], alibi_bias(alibi_slopes(12), positions, positions))
    assert result["attention_factor"] == 1.0 and result["scaling"] is None


@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_buckets_are_pe_runtime_s(client: httpx.Client, bidirectional: bool) -> None:
    result = inspect(
        client, pe="t5_bias", length=40, t5_num_buckets=8, t5_max_distance=20, t5_bidirectional=bidirectional
    )
    positions = torch.arange(40)
    relative = positions[None, :] - positions[:, None]
    expected = t5_relative_position_bucket(
        relative, bidirectional=bidirectional, num_buckets=8, max_distance=20
    )
    assert_equal(result["t5_bias"]["buckets"], expected)


def test_sinusoidal_table_is_pe_runtime_s_and_stretches_linearly(client: httpx.Client) -> None:
    result = inspect(
        client, pe="sinusoidal", length=50, head_dim=12, pe_scaling={"type": "linear", "factor": 2.0}
    )
    assert_equal(result["sinusoidal"]["table"], sinusoidal_table(50, 12, factor=2.0))
    assert result["sinusoidal"]["factor"] == 2.0


def test_the_largest_rope_answer_is_served(client: httpx.Client) -> None:
    """Cos and sin together hold at most MAX_CELLS numbers: 4096 positions x 32 frequencies."""
    result = inspect(client, length=MAX_LENGTH, head_dim=MAX_CELLS // MAX_LENGTH)
    assert (
        len(result["rope"]["cos"]) == MAX_LENGTH
        and len(result["rope"]["sin"][0]) == MAX_CELLS // MAX_LENGTH // 2
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"pe": "bogus"}, "pe"),
        ({"pe": "learned"}, "pe"),
        ({"pe": "nope"}, "pe"),
        ({"length": MAX_LENGTH + 1}, "length"),
        ({"length": 0}, "length"),
        ({"length": MAX_LENGTH, "head_dim": MAX_CELLS // MAX_LENGTH + 2}, "length"),
        ({"pe": "alibi", "length": 512, "num_heads": 8}, "length"),
        ({"pe": "t5_bias", "length": 1024}, "length"),
        ({"pe": "alibi", "num_heads": MAX_HEADS + 1}, "num_heads"),
        ({"head_dim": 33}, "head_dim"),
        ({"rope_base": 1.0}, "rope_base"),
        ({"seq_len": MAX_LENGTH + 1}, "seq_len"),
        ({"pe_scaling": {"type": "warp"}}, "pe_scaling.type"),
        ({"pe_scaling": {"type": "linear", "factor": 0.5}}, "pe_scaling.factor"),
        (
            {"pe_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 2.0}},
            "pe_scaling.beta_fast",
        ),
        (
            {"pe_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
            "pe_scaling.short_factor",
        ),
        ({"pe": "alibi", "pe_scaling": {"type": "yarn", "factor": 2.0}}, "pe_scaling.type"),
        ({"pe": "sinusoidal", "pe_scaling": {"type": "ntk", "factor": 2.0}}, "pe_scaling.type"),
        ({"length": "64"}, "length"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_input_is_a_422_naming_the_field(client: httpx.Client, body: dict[str, Any], param: str) -> None:
    error = assert_error_shape(client.post("/inspect", json=body), 422, param)
    assert error["type"] == "invalid_request_error"


def test_a_body_that_is_not_json_is_refused(client: httpx.Client) -> None:
    assert_error_shape(
        client.post("/inspect", content=b"pe=rope", headers={"Content-Type": "text/plain"}), 415
    )
