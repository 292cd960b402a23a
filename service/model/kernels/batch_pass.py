"""A batch's whole pass on a CPU as one C call (`batch_pass.c`), set up once per model: a decode
pass (one token per row) or a prompt chunk (each of its tokens a row).

Run as torch ops inside a compiled graph, the step's 21 kernel calls (17 products, 4 attentions)
each paid a dispatch, and the graph its guards and wrappers: at 16 rows of a zoo model, 0.4-0.5 ms
of a 1.8 ms step went there (a /tmp probe timing the compiled call against the time inside the
kernels). Here the pointers to the packed weights and the pool are gathered once, and a step
passes only the per-row tensors.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from service.model.config import ModelConfig
from service.model.kernels.build import kernel_function, ordered, use_threads
from service.model.kernels.packed_linear import Panels, check_panels, packed_linear
from service.model.kernels.paged_attention import MAX_HEAD_DIM, check_masked, check_rows
from service.model.spec import C_SUPPORT, BlockSpec

_SOURCE = Path(__file__).with_name("batch_pass.c")


def available() -> bool:
    """Whether the kernel is built and loaded in this process (built now if it was not)."""
    return _pass() is not None


def _pass() -> Any:
    return kernel_function(_SOURCE, "batch_pass")


def _workspace_floats() -> Any:
    return kernel_function(_SOURCE, "batch_pass_workspace")


def _tiles_fit() -> Any:
    return kernel_function(_SOURCE, "chunk_tiles_fit")


def run_tiled(rows: int, heads: int, kv_heads: int) -> bool:
    """Whether a prompt chunk's run of `rows` tokens attends in tiles (`chunk_run_tiled`)."""
    function = kernel_function(_SOURCE, "chunk_run_tiled")
    if function is None:
        raise RuntimeError("the batch step kernel is not available on this machine")
    return bool(function(rows, heads, kv_heads))


class CLayer(NamedTuple):
    """One layer's weights for the C step; matrices as `packed_linear.pack_weight`, `pack_int8` or
    `pack_int4` laid them out, each in its own format. None is a block without that tensor."""

    attn_norm: Tensor  # [D]
    attn_norm_bias: Tensor | None  # [D], LayerNorm's
    qkv: Panels  # N = (H + 2 Hkv) hd
    qkv_bias: Tensor | None  # [N]
    q_norm: Tensor | None  # [hd], Qwen3's per-head norms (both or neither)
    k_norm: Tensor | None
    o_proj: Panels  # N = D
    o_bias: Tensor | None
    mlp_norm: Tensor | None  # [D]; None where the MLP reads the attention's norm (parallel)
    mlp_norm_bias: Tensor | None
    up: Panels  # N = 2 F, gate then up, for a gated MLP; else F
    up_bias: Tensor | None
    down: Panels  # N = D
    down_bias: Tensor | None

    def matrices(self) -> tuple[Panels, ...]:
        return self.qkv, self.o_proj, self.up, self.down

    def vectors(self) -> list[Tensor | None]:
        """Norm weights and biases, which the kernel reads as float32 as they are."""
        return [field for field in self if not isinstance(field, Panels)]

    def pointers(self) -> list[Tensor | None]:
        """The layer's entry in the C step's table, in `batch_pass.c`'s order (the fields' order,
        each matrix as its values and scales)."""
        return [
            tensor
            for field in self
            for tensor in (field.tensors() if isinstance(field, Panels) else (field,))
        ]


class CHead(NamedTuple):
    """The final norm and the output layer."""

    norm: Tensor  # [D]
    norm_bias: Tensor | None
    lm_head: Panels  # N = V
    lm_head_bias: Tensor | None  # [V]


# `batch_pass.c`'s codes for the block's features (`BLOCK_*`, `ACTIVATION_*`, `RESIDUAL_*`).
_ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_RESIDUALS = {"sequential": 0, "parallel": 1, "parallel_two_norms": 2}


def block_features(spec: BlockSpec) -> Tensor:
    """The `block` array of `batch_pass.c`: norm kind, activation, gated or not, residual shape."""
    features = [int(spec.norm == "layer"), _ACTIVATIONS[spec.activation], int(spec.gated_mlp)]
    return torch.tensor([*features, _RESIDUALS[spec.residual]], dtype=torch.int64)


class BatchPass:
    """One model's step over its pool."""

    def __init__(
        self,
        config: ModelConfig,
        layers: Sequence[CLayer],
        head: CHead,
        key_pages: Sequence[Tensor],
        value_pages: Sequence[Tensor],
    ) -> None:
        spec = BlockSpec.of(config)
        refused = C_SUPPORT.refuses(spec)
        if refused is not None:
            raise ValueError(refused)
        for index, layer in enumerate(layers):
            for name, matrix in zip(("qkv", "o_proj", "up", "down"), layer.matrices(), strict=True):
                check_panels(matrix, f"layers[{index}].{name}")
            _check_layer(spec, layer, index)
        check_panels(head.lm_head, "lm_head")
        matrices = [matrix for layer in layers for matrix in layer.matrices()] + [head.lm_head]
        formats = [int(matrix.format) for matrix in matrices]
        self._formats = torch.tensor(formats, dtype=torch.int64)  # `batch_pass.c`'s order
        self._block = block_features(spec)
        floats = [tensor for layer in layers for tensor in layer.vectors()]
        floats += [head.norm, head.norm_bias, head.lm_head_bias, *key_pages, *value_pages]
        for tensor in floats:
            if tensor is not None and (tensor.dtype != torch.float32 or not tensor.is_contiguous()):
                raise ValueError("the step's norms, biases and pages must be contiguous float32 tensors")
        if config.head_dim > MAX_HEAD_DIM or config.rotary_dim > config.head_dim:
            raise ValueError(
                f"heads of {config.head_dim} (at most {MAX_HEAD_DIM}) rotating {config.rotary_dim}"
            )
        self.config = config
        # The pointers below point into these: keep them alive.
        self._tensors = (layers, head, key_pages, value_pages, self._formats, self._block)
        self._layers = _pointers([tensor for layer in layers for tensor in layer.pointers()])
        self._key_pages, self._value_pages = _pointers(key_pages), _pointers(value_pages)
        self._head = head
        self._head_pointers = _pointers(
            [head.norm, head.norm_bias, *head.lm_head.tensors(), head.lm_head_bias]
        )
        self._n_layers = len(layers)
        self._num_blocks, self._block_size = key_pages[0].shape[1], key_pages[0].shape[2]
        tiles_fit = _tiles_fit()
        # Whether a prompt chunk's attention (without a bias on its scores) reads blocks once per
        # tile of rows (`chunk_attention.h`), at the speed of the products around it.
        self.tiles_chunks = tiles_fit is not None and bool(
            tiles_fit(config.n_heads, config.n_kv_heads, config.head_dim, self._block_size)
        )

    def __call__(
        self,
        hidden: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        bias: Tensor | None,
        window_blocks: Tensor,
        positions: Tensor,
        *,
        logits: bool = True,
        runs: Sequence[int] = (),
        masked: Tensor | None = None,
        sinks: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Logits float32 [B, V] from the embedded rows `hidden` [B, D], each row's rotary tables
        at its position ([B, rotary_dim] each) and the scores' bias [B, H, W]. `masked` [B, 2]:
        each row's slots [first, last) that it does not attend to (a streaming row's entries
        between its sinks and its window), for a pass without `runs`. `sinks`: how many of each
        row's first slots [B] its query reads turned back by a turn [B, 2, rotary_dim] (unit cos,
        then sin): where a streaming row's rule puts its query for its sinks. With `logits=False`
        the pass stops before the output layer (a vocabulary of no entries) and returns the final
        residual [B, D], the layers' output the kernel leaves in the rows it was given.

        `runs`, for a prompt chunk: how many rows each sequence has, in row order, each run at
        consecutive positions over the same blocks (`check_runs`); its attention then reads each
        block once per tile of rows (`chunk_attention.h`) rather than once per row, in the runs
        where that is faster (`run_tiled`)."""
        step, workspace_floats = _pass(), _workspace_floats()
        if step is None or workspace_floats is None:
            raise RuntimeError("the batch step kernel is not available on this machine")
        config = self.config
        batch, blocks_per_row = window_blocks.shape
        window = blocks_per_row * self._block_size
        hidden = _floats(hidden)  # bound here: the C call reads its memory
        cos, sin = (_floats(table) for table in rope) if rope is not None else (None, None)
        bias = _floats(bias) if bias is not None else None
        window_blocks, positions = (t.to(torch.int64).contiguous() for t in (window_blocks, positions))
        check_rows(window_blocks, positions, num_blocks=self._num_blocks, block_size=self._block_size)
        run_ends = check_runs(runs, window_blocks, positions)
        if masked is not None and runs:
            raise ValueError("masked slots are for passes attended row by row, not prompt chunks in runs")
        masked = check_masked(masked, positions) if masked is not None else None
        if sinks is not None and (rope is None or runs):
            raise ValueError("sinks turn a rotated query, one per row: a pass with rotary tables and no runs")
        sink_counts, sink_turn = (
            (None, None) if sinks is None else _sink_inputs(sinks, positions, config.rotary_dim)
        )
        if hidden.shape != (batch, config.d_model):
            raise ValueError(f"hidden is {tuple(hidden.shape)}, not ({batch}, {config.d_model})")
        if rope is not None and any(table.shape != (batch, config.rotary_dim) for table in rope):
            raise ValueError(f"the rotary tables must be ({batch}, {config.rotary_dim})")
        if bias is not None and bias.shape != (batch, config.n_heads, window):
            raise ValueError(f"the bias must be ({batch}, {config.n_heads}, {window})")
        heads = config.n_heads, config.n_kv_heads, config.head_dim
        use_threads(_SOURCE, torch.get_num_threads())  # before sizing: each thread has its scores
        floats = workspace_floats(batch, config.d_model, *heads, config.ffn_hidden, window)
        workspace = torch.empty(floats, dtype=torch.float32)
        vocab = config.vocab_size if logits else 0
        out = torch.empty((batch, vocab), dtype=torch.float32)
        arguments = {
            "hidden": hidden.data_ptr(),
            "rope_cos": cos.data_ptr() if cos is not None else None,
            "rope_sin": sin.data_ptr() if sin is not None else None,
            "bias": bias.data_ptr() if bias is not None else None,
            "masked": masked.data_ptr() if masked is not None else None,
            "sinks": sink_counts.data_ptr() if sink_counts is not None else None,
            "sink_turn": sink_turn.data_ptr() if sink_turn is not None else None,
            "layers": self._layers,
            "key_pages": self._key_pages,
            "value_pages": self._value_pages,
            "window_blocks": window_blocks.data_ptr(),
            "positions": positions.data_ptr(),
            "final_norm": self._head_pointers[0],
            "final_norm_bias": self._head_pointers[1],
            "lm_head": self._head_pointers[2],
            "lm_head_scales": self._head_pointers[3],
            "lm_head_bias": self._head_pointers[4],
            "logits": out.data_ptr(),
            "workspace": workspace.data_ptr(),
            "batch": batch,
            "n_layers": self._n_layers,
            "d_model": config.d_model,
            "heads": config.n_heads,
            "kv_heads": config.n_kv_heads,
            "head_dim": config.head_dim,
            "ffn": config.ffn_hidden,
            "vocab": vocab,
            "rotary_dim": config.rotary_dim if rope is not None else 0,
            "interleaved": int(config.rope_layout == "gptj"),  # pairs (2i, 2i + 1), not (c, c + R / 2)
            "num_blocks": self._num_blocks,
            "block_size": self._block_size,
            "blocks_per_row": blocks_per_row,
            "run_ends": run_ends.data_ptr() if runs else None,
            "runs": len(runs),
            "formats": self._formats.data_ptr(),
            "block": self._block.data_ptr(),
            "eps": config.norm_eps,
        }
        step(*ordered(_SOURCE, "batch_pass", arguments))
        return out if logits else hidden

    def output_layer(self, normed: Tensor) -> Tensor:
        """Logits float32 [N, V] of rows already through the model's last norm [N, D], over the
        pass's packed output layer: for a prompt chunk's last tokens, which the pass itself stops
        before (one row of SmolLM2: 6 ms here against 11 through `F.linear` on the layer's own
        weight)."""
        return packed_linear(normed, self._head.lm_head, self._head.lm_head_bias, self.config.vocab_size)


def _check_layer(spec: BlockSpec, layer: CLayer, index: int) -> None:
    """Refuse a layer whose tensors do not match its block: the kernel reads a NULL as "none"."""
    expected = {
        "attn_norm_bias": spec.norm_bias,
        "qkv_bias": spec.qkv_bias,
        "q_norm": spec.qk_norm,
        "k_norm": spec.qk_norm,
        "o_bias": spec.attn_out_bias,
        "mlp_norm": spec.residual != "parallel",
        "mlp_norm_bias": spec.norm_bias and spec.residual != "parallel",
        "up_bias": spec.mlp_bias,
        "down_bias": spec.mlp_bias,
    }
    for name, present in expected.items():
        if (getattr(layer, name) is not None) != present:
            raise ValueError(
                f"layers[{index}].{name} is {'missing' if present else 'unexpected'} for this block"
            )


def check_runs(runs: Sequence[int], window_blocks: Tensor, positions: Tensor) -> Tensor:
    """Each run's end row as int64, after refusing runs the tiles would misread: a tile reads its
    first row's blocks up to its last row's position, so a run's rows must be consecutive
    positions of one block table."""
    ends = torch.tensor(list(itertools.accumulate(runs)), dtype=torch.int64)
    if not runs:
        return ends
    if min(runs) < 1 or int(ends[-1]) != positions.shape[0]:
        raise ValueError(f"runs {list(runs)} do not cover the {positions.shape[0]} rows")
    inside = torch.ones(positions.shape[0], dtype=torch.bool)  # whether a row continues the one before
    inside[0] = False
    inside[ends[:-1]] = False
    steps = positions[1:] - positions[:-1]
    same_blocks = (window_blocks[1:] == window_blocks[:-1]).all(dim=1)
    if not bool(((steps == 1) & same_blocks)[inside[1:]].all()):
        raise ValueError("a run's rows are not consecutive positions over the same blocks")
    return ends


def _sink_inputs(sinks: tuple[Tensor, Tensor], positions: Tensor, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """The sink counts (int64 [B]) and turns (float32 [B, 2, R]) as the kernel reads them: no row
    has more sinks than keys (its entries and the one it writes)."""
    batch = positions.shape[0]
    counts, turn = sinks[0].to(torch.int64).contiguous(), _floats(sinks[1])
    if counts.shape != (batch,) or turn.shape != (batch, 2, rotary_dim):
        raise ValueError(f"sinks must be ({batch},) counts and a ({batch}, 2, {rotary_dim}) turn")
    if batch and not bool(((counts >= 0) & (counts <= positions + 1)).all()):
        raise ValueError("a row has more sinks than keys")
    return counts, turn


def _pointers(tensors: Sequence[Tensor | None]) -> ctypes.Array[ctypes.c_void_p]:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() if t is not None else None for t in tensors))


def _floats(tensor: Tensor) -> Tensor:
    return tensor if tensor.dtype == torch.float32 and tensor.is_contiguous() else tensor.float().contiguous()
