"""Decode attention over the paged KV pool as a C kernel for CPUs, and its torch reference.

A compiled decode pass has fixed shapes, so its attention reads every row's whole window (a
power of two of positions): a row 65 keys long reads 128, and a batch with one long row makes
every row read that row's window. Written as broadcast products, the reduction over a 32-wide
head also ends in a horizontal sum per key, and the compiler recomputes the query's rotation for
every key it fuses in. Profiled at a batch of 64 on two cores, that kernel was over half the
step. This one reads each row's own keys, once, with the dot products vectorized over the head.

The source (`paged_attention.c`) is built by `service.model.kernels.build`; where no compiler
works, `available()` is False and the step keeps its pure-torch attention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from service.model.kernels.build import kernel_function, use_threads

_SOURCE = Path(__file__).with_name("paged_attention.c")


def available() -> bool:
    """Whether the kernel is built and loaded in this process (built now if it was not)."""
    return _kernel() is not None


def _kernel() -> Any:
    return kernel_function(_SOURCE, "paged_decode_attention")


MAX_HEAD_DIM = 512  # `paged_attention.c` and `batch_pass.c` keep a head in a stack array this wide


def check_rows(window_blocks: Tensor, positions: Tensor, *, num_blocks: int, block_size: int) -> None:
    """Refuse, before any C runs, rows the kernels would read or write out of bounds with.

    The kernels trust their indices: a block id past the pool, or a position past its row's
    blocks, would be a read or a write in memory the pool does not own.
    """
    if window_blocks.dim() != 2 or positions.shape != (window_blocks.shape[0],):
        raise ValueError(
            f"window_blocks {tuple(window_blocks.shape)} and positions {tuple(positions.shape)} differ"
        )
    if window_blocks.numel() and not _within(window_blocks, num_blocks):
        raise ValueError(f"a block id is outside the pool's {num_blocks} blocks")
    window = window_blocks.shape[1] * block_size
    if positions.numel() and not _within(positions, window):
        raise ValueError(f"a position is outside its row's {window} positions")


def check_masked(masked: Tensor, positions: Tensor) -> Tensor:
    """Each row's masked slots `[first, last)` as the kernels read them (int64 [B, 2], contiguous),
    refused where a row would mask its own newest key (its softmax would have none left)."""
    masked = masked.to(torch.int64).contiguous()
    if masked.shape != (positions.shape[0], 2):
        raise ValueError(f"masked {tuple(masked.shape)} is not one [first, last) per row")
    hides_own = (masked[:, 0] <= positions) & (positions < masked[:, 1])
    if masked.numel() and bool(hides_own.any()):
        raise ValueError("a row's masked slots hide its own newest key")
    return masked


def _within(indices: Tensor, size: int) -> bool:
    """Whether every index lies in [0, size): one pass over them, on the step's path."""
    low, high = torch.aminmax(indices)
    return int(low) >= 0 and int(high) < size


def paged_decode_attention(
    queries: Tensor,
    new_keys: Tensor,
    new_values: Tensor,
    key_pages: Tensor,
    value_pages: Tensor,
    window_blocks: Tensor,
    positions: Tensor,
    bias: Tensor | None,
    scale: float,
    masked: Tensor | None = None,
) -> Tensor:
    """float32 [B, H, hd]: each row's query over its keys 0..position, after writing its new key and
    value at position. `bias` [B, H, W] is added to the scaled scores (the causal mask needs none:
    later keys are never read); `masked` [B, 2] gives each row slots [first, last) it does not
    read (`masked_slots`). CPU only; `available()` says whether it can run. The batch step
    (`batch_pass.c`) calls the same C function; this binding is the kernel's own, for its tests."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the paged attention kernel is not available on this machine")
    batch, heads, head_dim = queries.shape
    kv_heads, num_blocks, block_size, _ = key_pages.shape
    for pages in (key_pages, value_pages):
        if pages.dtype != torch.float32 or not pages.is_contiguous():
            raise ValueError("the KV pages must be contiguous float32: the kernel writes them in place")
    if head_dim > MAX_HEAD_DIM or heads % kv_heads or key_pages.shape[3] != head_dim:
        raise ValueError(f"heads of {head_dim} (at most {MAX_HEAD_DIM}), {heads} over {kv_heads} KV heads")
    queries, new_keys, new_values = (_rows_of_heads(t) for t in (queries, new_keys, new_values))
    window_blocks, positions = (t.to(torch.int64).contiguous() for t in (window_blocks, positions))
    check_rows(window_blocks, positions, num_blocks=num_blocks, block_size=block_size)
    bias = bias.float().contiguous() if bias is not None else None
    masked = check_masked(masked, positions) if masked is not None else None
    out = torch.empty((batch, heads, head_dim), dtype=torch.float32)
    threads = torch.get_num_threads()
    use_threads(_SOURCE, threads)
    scores = torch.empty(threads * window_blocks.shape[1] * block_size, dtype=torch.float32)  # one each
    kernel(
        queries.data_ptr(),
        new_keys.data_ptr(),
        new_values.data_ptr(),
        key_pages.data_ptr(),
        value_pages.data_ptr(),
        window_blocks.data_ptr(),
        positions.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        masked.data_ptr() if masked is not None else None,
        out.data_ptr(),
        scores.data_ptr(),
        queries.stride(0),
        new_keys.stride(0),
        new_values.stride(0),
        batch,
        heads,
        kv_heads,
        head_dim,
        num_blocks,
        block_size,
        window_blocks.shape[1],
        scale,
    )
    return out


def _rows_of_heads(tensor: Tensor) -> Tensor:
    """float32 [B, heads, hd] with packed heads; rows may be strided (slices of the fused projection)."""
    tensor = tensor.float()
    if tensor.stride(2) != 1 or tensor.stride(1) != tensor.shape[2]:
        tensor = tensor.contiguous()
    return tensor


def reference_paged_decode_attention(
    queries: Tensor,
    new_keys: Tensor,
    new_values: Tensor,
    key_pages: Tensor,
    value_pages: Tensor,
    window_blocks: Tensor,
    positions: Tensor,
    bias: Tensor | None,
    scale: float,
) -> Tensor:
    """`paged_decode_attention` in torch, over each row's whole window with the causal mask: the
    path for GPUs, other dtypes and machines without the kernel, and what the compiler fuses.

    Attention is written as products and sums over the gathered blocks rather than through
    `scaled_dot_product_attention`: for one query per row that is what the compiler fuses best
    (the block gather folds into the reductions), and SDPA's CPU kernel is slow for one query.
    """
    batch, heads, head_dim = queries.shape
    block_size = key_pages.shape[2]
    write_blocks = window_blocks.gather(1, (positions // block_size)[:, None])[:, 0]
    write_offsets = positions % block_size
    key_pages[:, write_blocks, write_offsets] = new_keys.transpose(0, 1)  # [Hkv, B, hd]
    value_pages[:, write_blocks, write_offsets] = new_values.transpose(0, 1)
    keys, values = _window(key_pages, window_blocks), _window(value_pages, window_blocks)
    _, kv_heads, window, _ = keys.shape
    group = heads // kv_heads
    grouped = queries.float().view(batch, kv_heads, group, 1, head_dim)
    scores = (grouped * keys.float()[:, :, None]).sum(-1) * scale  # [B, Hkv, G, W]
    distance = torch.arange(window, device=positions.device)[None, :] - positions[:, None]  # [B, W], k - q
    scores = scores + torch.where(distance <= 0, 0.0, float("-inf"))[:, None, None]
    if bias is not None:
        scores = scores + bias.view(batch, kv_heads, group, window)
    weights = torch.softmax(scores, dim=-1)
    attended = (weights[..., None] * values.float()[:, :, None]).sum(-2)  # [B, Hkv, G, hd]
    return attended.reshape(batch, heads, head_dim)


def _window(pages: Tensor, window_blocks: Tensor) -> Tensor:
    """[B, Hkv, W, hd]: each row's blocks side by side."""
    batch, count = window_blocks.shape
    gathered = pages[:, window_blocks]  # [Hkv, B, nb, block, hd]
    return gathered.view(pages.shape[0], batch, count * pages.shape[2], -1).transpose(0, 1)
