"""Incremental decoding with the KV cache equals a full recompute, for every scheme and scaling.

Lengths run from below the native context (16) to well past it, so the dynamic scalings switch
tables mid-generation: the cached keys must follow, or the logits drift.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pe_runtime import RopeScaling
from service.model.paged_cache import PagedKVCache, PagedRows
from service.model.refresh import recompute_row, stale_rows
from service.model.transformer import Transformer
from tests.conftest import TINY_CONFIG, cached_forward, rope_scalings, tiny_transformer

NATIVE = 16
PROMPT = 6
TOTAL = 40  # 2.5x the native context
TOLERANCE = 1e-4
SCALINGS = rope_scalings(NATIVE, rotary_dim=TINY_CONFIG["d_model"] // TINY_CONFIG["n_heads"])
LINEAR = RopeScaling(type="linear", factor=4.0)
# The schemes with their own attention path, with small tables so that the clipping shows.
RELATIVE: dict[str, dict[str, Any]] = {
    "shaw": {"pe": "shaw", "shaw_max_distance": 5},
    "transformer_xl": {"pe": "transformer_xl"},
    "cope": {"pe": "cope", "cope_npos_max": 6},
}

CASES = [
    *((f"rope-{name}", {"pe": "rope"}, scaling) for name, scaling in SCALINGS.items()),
    ("rope-gptj-partial-yarn", {"pe": "rope", "rope_layout": "gptj", "rotary_fraction": 0.5}, None),
    ("learned-linear", {"pe": "learned"}, LINEAR),
    ("sinusoidal", {"pe": "sinusoidal"}, RopeScaling()),
    ("sinusoidal-linear", {"pe": "sinusoidal"}, LINEAR),
    ("alibi", {"pe": "alibi"}, RopeScaling()),
    ("t5_bias", {"pe": "t5_bias", "t5_num_buckets": 8, "t5_max_distance": 20}, RopeScaling()),
    ("nope", {"pe": "nope"}, RopeScaling()),
    *((f"rope_alibi-{name}", {"pe": "rope_alibi"}, scaling) for name, scaling in SCALINGS.items()),
    *((name, overrides, RopeScaling()) for name, overrides in RELATIVE.items()),
    ("transformer_xl-linear", RELATIVE["transformer_xl"], LINEAR),
]


def tiny_model(**overrides: Any) -> Transformer:
    return tiny_transformer(native_context=NATIVE, **overrides)


def last_logits_of_full_forward(
    model: Transformer, tokens: torch.Tensor, scaling: RopeScaling | None
) -> torch.Tensor:
    logits: torch.Tensor = model(tokens, scaling=scaling)[:, -1]
    return logits


@pytest.mark.parametrize(
    ("overrides", "scaling"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
@torch.inference_mode()
def test_greedy_incremental_logits_equal_full_forward(
    overrides: dict[str, object], scaling: RopeScaling | None
) -> None:
    if overrides.get("rope_layout") == "gptj":
        scaling = rope_scalings(NATIVE, rotary_dim=4)["yarn"]
    model = tiny_model(**overrides)
    tokens = torch.randint(0, 258, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(1, capacity=8)  # small on purpose: growth is part of what is tested
    logits = cached_forward(model, tokens, scaling, cache)[:, -1]
    while tokens.shape[1] < TOTAL:
        expected = last_logits_of_full_forward(model, tokens, scaling)
        assert (logits - expected).abs().max().item() <= TOLERANCE, f"diverged at length {tokens.shape[1]}"
        greedy = logits.argmax(dim=-1, keepdim=True)  # [1, 1]
        tokens = torch.cat([tokens, greedy], dim=1)
        logits = cached_forward(model, greedy, scaling, cache)[:, -1]


@torch.inference_mode()
def test_rows_with_different_lengths_and_scalings_match_each_row_alone() -> None:
    """One batched step over rows of different lengths, each with its own scaling."""
    model = tiny_model(pe="rope")
    names = ["none", "dynamic", "yarn", "longrope"]
    lengths = [5, 14, 23, 31]  # rows straddle the native context
    generator = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 258, (1, length + 1), generator=generator) for length in lengths]
    pool = PagedKVCache(model.config, 16, device=torch.device("cpu"), dtype=torch.float32)
    slots = [pool.allocate(row.shape[1]) for row in rows]
    for row, name, slot in zip(rows, names, slots, strict=True):
        cached_forward(model, row[:, :-1], SCALINGS[name], PagedRows(pool, [slot]))
    batch_cache = PagedRows(pool, slots)
    next_tokens = torch.cat([row[:, -1:] for row in rows])  # [4, 1]
    batched = cached_forward(model, next_tokens, [SCALINGS[name] for name in names], batch_cache)[:, -1]
    for index, (row, name) in enumerate(zip(rows, names, strict=True)):
        alone = last_logits_of_full_forward(model, row, SCALINGS[name])[0]
        assert (batched[index] - alone).abs().max().item() <= TOLERANCE, name


MIXED_BATCHES = [
    ("rope_alibi", {"pe": "rope_alibi"}, ["none", "dynamic", "yarn", "longrope"]),
    ("shaw", RELATIVE["shaw"], ["none"] * 4),
    ("transformer_xl", RELATIVE["transformer_xl"], ["none", "linear", "none", "linear"]),
    ("cope", RELATIVE["cope"], ["none"] * 4),
]


@pytest.mark.parametrize(
    ("overrides", "names"), [case[1:] for case in MIXED_BATCHES], ids=[case[0] for case in MIXED_BATCHES]
)
@torch.inference_mode()
def test_new_schemes_decode_mixed_length_batches_like_each_row_alone(
    overrides: dict[str, Any], names: list[str]
) -> None:
    """Rows of different lengths (straddling the native context) and scalings: a padded chunk, then
    single-token steps, batched; every row's logits equal a full pass over that row alone."""
    model = tiny_model(**overrides)
    scalings = [SCALINGS[name] for name in names]
    lengths = [5, 14, 23, 31]
    chunk = [4, 1, 3, 2]  # a chunked prefill's real tokens per row, padded to the widest
    generator = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 258, (1, length + max(chunk) + 3), generator=generator) for length in lengths]
    pool = PagedKVCache(model.config, 32, device=torch.device("cpu"), dtype=torch.float32)
    slots = [pool.allocate(row.shape[1]) for row in rows]
    for row, length, scaling, slot in zip(rows, lengths, scalings, slots, strict=True):
        cached_forward(model, row[:, :length], scaling, PagedRows(pool, [slot]))
    cache = PagedRows(pool, slots)
    padded = torch.cat(
        [
            torch.cat([row[:, n : n + c], row[:, n + c - 1 :][:, :1].expand(1, max(chunk) - c)], 1)
            for row, n, c in zip(rows, lengths, chunk, strict=True)
        ]
    )
    after_chunk = [length + count for length, count in zip(lengths, chunk, strict=True)]
    for stale in stale_rows(model, cache, scalings, after_chunk):
        recompute_row(model, cache, stale, scalings[stale], after_chunk[stale])
    logits = model(padded, scaling=scalings, cache=cache, counts=chunk, table_lengths=after_chunk)[:, -1]
    for step in range(3):
        for index, (row, length, scaling) in enumerate(zip(rows, lengths, scalings, strict=True)):
            seen = length + chunk[index] + step
            alone = last_logits_of_full_forward(model, row[:, :seen], scaling)[0]
            assert (logits[index] - alone).abs().max().item() <= TOLERANCE, (names[index], step)
        following = torch.cat(
            [row[:, n + c + step :][:, :1] for row, n, c in zip(rows, lengths, chunk, strict=True)]
        )
        logits = cached_forward(model, following, scalings, cache)[:, -1]


@torch.inference_mode()
def test_a_request_scaling_replaces_the_model_default() -> None:
    tokens = torch.randint(0, 258, (1, 30), generator=torch.Generator().manual_seed(3))
    scaled_by_default = tiny_model(pe="rope", rope_scaling={"rope_type": "linear", "factor": 4.0})
    unscaled = scaled_by_default(tokens, scaling=RopeScaling())
    assert torch.allclose(scaled_by_default(tokens), scaled_by_default(tokens, scaling=LINEAR))
    assert not torch.allclose(scaled_by_default(tokens), unscaled)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_same_code_runs_on_cuda(dtype: torch.dtype) -> None:
    """CUDA agrees with CPU (float32 tightly; bfloat16 runs and stays close), incremental included."""
    cpu = tiny_model(pe="rope")
    cuda = tiny_model(pe="rope").to(device="cuda", dtype=dtype)
    tokens = torch.randint(0, 258, (2, TOTAL), generator=torch.Generator().manual_seed(4))
    scaling = SCALINGS["dynamic"]
    expected = cpu(tokens, scaling=scaling)[:, -1]
    cache = cuda.new_cache(2, capacity=TOTAL)
    cached_forward(cuda, tokens[:, :-1].cuda(), scaling, cache)
    logits = cached_forward(cuda, tokens[:, -1:].cuda(), scaling, cache)[:, -1].float().cpu()
    tolerance = TOLERANCE if dtype == torch.float32 else 0.1
    assert (logits - expected).abs().max().item() <= tolerance


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "overrides", [{"pe": "rope_alibi"}, *RELATIVE.values()], ids=["rope_alibi", *RELATIVE]
)
@torch.inference_mode()
def test_the_new_schemes_run_on_cuda_as_on_cpu(overrides: dict[str, Any]) -> None:
    """float32 on CUDA, incremental over rows of different lengths, equals CPU's full pass."""
    cpu = tiny_model(**overrides)
    cuda = tiny_model(**overrides).to(device="cuda")
    tokens = torch.randint(0, 258, (2, TOTAL), generator=torch.Generator().manual_seed(4))
    rows = [tokens[:1], tokens[1:, 9:]]  # 40 and 31 tokens: rows of different lengths
    pool = PagedKVCache(cuda.config, 16, device=torch.device("cuda"), dtype=torch.float32)
    slots = [pool.allocate(TOTAL) for _ in rows]
    for row, slot in zip(rows, slots, strict=True):
        cached_forward(cuda, row[:, :-1].cuda(), None, PagedRows(pool, [slot]))
    batch = PagedRows(pool, slots)
    logits = cached_forward(cuda, tokens[:, -1:].cuda(), None, batch)[:, -1].cpu()
    for index, row in enumerate(rows):
        assert (logits[index] - cpu(row)[0, -1]).abs().max().item() <= TOLERANCE
