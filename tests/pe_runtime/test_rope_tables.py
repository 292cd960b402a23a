"""cos/sin tables and apply_rope: agreement with Llama's rotary embedding, the relative-position
property, layout equivalence, partial rotary, and the float32-then-cast precision contract."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pe_runtime import PEConfigError, RopeLayout, RopeScaling, apply_rope, rope_cos_sin, rope_inv_freq
from tests.pe_runtime.hf_oracle import hf_cos_sin

LAYOUTS: tuple[RopeLayout, ...] = get_args(RopeLayout)
SCALINGS = (
    None,
    RopeScaling(type="yarn", factor=8.0, original_max_position_embeddings=64),
    RopeScaling(type="ntk", factor=4.0),
)


def _tables(
    head_dim: int, scaling: RopeScaling | None, length: int, layout: RopeLayout
) -> tuple[torch.Tensor, ...]:
    inv_freq, attention_factor = rope_inv_freq(head_dim, 10000.0, scaling)
    return rope_cos_sin(inv_freq, attention_factor, length, layout=layout)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default"},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ],
)
def test_neox_tables_match_llamas_rotary_embedding(params: dict[str, object]) -> None:
    expected_cos, expected_sin = hf_cos_sin(32, 10000.0, params, 512, 300)
    scaling = RopeScaling.from_hf(params, max_position_embeddings=512)
    cos, sin = _tables(32, scaling, 300, "neox")
    torch.testing.assert_close(cos, expected_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, expected_sin, rtol=0, atol=1e-6)


def test_apply_rope_matches_llamas_apply_rotary_pos_emb() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 4, 10, 32, generator=generator)  # [batch, heads, seq, head_dim] each
    cos, sin = _tables(32, SCALINGS[1], 10, "neox")
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    torch.testing.assert_close(apply_rope(q, cos, sin), expected_q)
    torch.testing.assert_close(apply_rope(k, cos, sin), expected_k)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_scores_depend_only_on_the_relative_position(layout: RopeLayout, scaling: RopeScaling | None) -> None:
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 64, dtype=torch.float64, generator=generator)
    cos, sin = (table.double() for table in _tables(64, scaling, 2048, layout))

    def score(m: int, n: int) -> float:
        rotated_q = apply_rope(q, cos[m], sin[m], layout=layout)
        rotated_k = apply_rope(k, cos[n], sin[n], layout=layout)
        return float(rotated_q @ rotated_k)

    # Tables hold float32 angles, whose error grows as position * 2^-24: a few 1e-5 at 2k.
    assert score(300, 0) != pytest.approx(score(0, 0), rel=1e-2)  # the score does see the offset
    for offset in (0, 1, 7, 300):
        reference = score(offset, 0)
        for shift in (1, 50, 1000, 2047 - offset):
            assert score(offset + shift, shift) == pytest.approx(reference, rel=2e-4, abs=1e-3)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_gptj_and_neox_agree_under_the_pairing_permutation(scaling: RopeScaling | None) -> None:
    head_dim = 16
    # gptj channel 2i holds neox channel i, gptj 2i+1 holds neox i + d/2
    to_gptj = torch.stack(
        (torch.arange(head_dim // 2), torch.arange(head_dim // 2) + head_dim // 2), dim=1
    ).flatten()
    x = torch.randn(5, 3, head_dim, generator=torch.Generator().manual_seed(2))  # [seq, heads, head_dim]
    neox_cos, neox_sin = _tables(head_dim, scaling, 5, "neox")
    gptj_cos, gptj_sin = _tables(head_dim, scaling, 5, "gptj")
    torch.testing.assert_close(gptj_cos, neox_cos[:, to_gptj], rtol=0, atol=0)
    neox = apply_rope(x, neox_cos[:, None], neox_sin[:, None], layout="neox")
    gptj = apply_rope(x[..., to_gptj], gptj_cos[:, None], gptj_sin[:, None], layout="gptj")
    torch.testing.assert_close(gptj, neox[..., to_gptj])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_rotary_leaves_the_remaining_channels_alone(layout: RopeLayout) -> None:
    x = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(3))  # [seq, heads, head_dim]
    cos, sin = _tables(16, None, 6, layout)  # rotary_dim 16 of 64
    out = apply_rope(x, cos[:, None], sin[:, None], layout=layout)
    assert torch.equal(out[..., 16:], x[..., 16:])
    torch.testing.assert_close(
        out[..., :16], apply_rope(x[..., :16], cos[:, None], sin[:, None], layout=layout)
    )
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


def test_attention_factor_multiplies_both_tables() -> None:
    scaling = SCALINGS[1]
    inv_freq, attention_factor = rope_inv_freq(32, 10000.0, scaling)
    assert attention_factor > 1.0
    cos, sin = rope_cos_sin(inv_freq, attention_factor, 100)
    plain_cos, plain_sin = rope_cos_sin(inv_freq, 1.0, 100)
    torch.testing.assert_close(cos, plain_cos * attention_factor)
    torch.testing.assert_close(sin, plain_sin * attention_factor)


def test_bfloat16_table_has_float32_angle_error_at_position_60000() -> None:
    """Angles formed in float32 and cast once keep bfloat16's rounding as the only error; forming them
    in bfloat16 would round position 60000 to a multiple of 256 and destroy the high frequencies."""
    length, head_dim = 60001, 64
    inv_freq, _ = rope_inv_freq(head_dim, 10000.0, None)
    cos, sin = rope_cos_sin(inv_freq, 1.0, length, dtype=torch.bfloat16)
    float32_cos, float32_sin = rope_cos_sin(inv_freq, 1.0, length)
    assert torch.equal(cos, float32_cos.to(torch.bfloat16)) and torch.equal(
        sin, float32_sin.to(torch.bfloat16)
    )

    exact_angle = 60000 * inv_freq.double()
    exact = torch.cat((exact_angle.cos(), exact_angle.cos()))
    ours_error = (cos[60000].double() - exact).abs().max().item()
    bf16_angle = torch.tensor(60000.0, dtype=torch.bfloat16) * inv_freq.to(torch.bfloat16)
    bf16_error = (torch.cat((bf16_angle.cos(), bf16_angle.cos())).double() - exact).abs().max().item()
    assert ours_error <= 2**-8 + 5e-3  # one bfloat16 rounding plus float32 angle error
    assert bf16_error > 20 * ours_error


def test_unknown_layout_is_a_config_error() -> None:
    inv_freq, _ = rope_inv_freq(8, 10000.0, None)
    with pytest.raises(PEConfigError) as raised:
        rope_cos_sin(inv_freq, 1.0, 4, layout="rotate")  # type: ignore[arg-type]
    assert raised.value.field == "layout"
