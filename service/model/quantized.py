"""Quantized weights (`--weights int8|int4`): a model's linear layers swapped, once at load, for
modules that keep their weights packed.

Which kernel, and why:

- `int8` on a CPU: int8 codes with one scale per output and group of `INT8_GROUP` inputs (GGUF's
  Q8_0 block), times activations rounded to int8 per group of 32 inputs (`quantized_activations`,
  llama.cpp's Q8 activations). Passes run in C (`kernels/batch_pass.c`), which reads the codes
  packed in panels: with AVX-512 VNNI the codes meet as integers, 64 products an instruction
  (a float32 kernel does 16), else they are widened in registers. At one row a pass reads every
  weight once and is bound by the bytes it reads (codes are a quarter of float32's); at 16 rows
  it was bound by its arithmetic, which the integer products cut 3-4x. Where the eager pass runs
  (chunks under a score bias, models the C step cannot express) the layer widens its codes to a
  float matrix per call and multiplies the same rounded activations with BLAS.
  Rounding per group of 32 costs far less than per row: fbgemm's dynamic linear (one scale a
  row, the first int8 path here) cost 0.057 bits per token on SmolLM2 and needed per-row
  rescaling against its outlier rows; `bench/weight_formats.py` measures what this costs.
- `int8` on CUDA: weight-only `_weight_int8pack_mm` (int8 weights, per-channel scales, float
  activations): one group spanning the whole input.
- `int4` on a CPU: 4-bit codes in groups of 32 inputs with a scale and a minimum per group
  (asymmetric, GGUF's Q4_1 block), over the same rounded activations, read by the same C step
  and widened per call elsewhere, as int8. torch's own `_weight_int4pack_mm_for_cpu` was the
  first int4 path here: it takes its activations in bfloat16 (with float32 it is a scalar loop
  40-120x slower), so its outputs carried bfloat16 rounding, and it ran only eager. On CUDA no
  int4 kernel is wired; the server refuses `int4` there at start-up rather than serving untested
  numerics.

Embeddings, norms and the relative-attention projections stay float: they are a lookup or a small
share of the arithmetic. A tied output head gets its own packed copy (the embedding lookup keeps
the float table). What a format costs in quality is measured (bits per token on English text,
`bench/weight_formats.py`), not assumed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.model.transformer import Transformer

INT8_GROUP = 32  # input channels sharing one int8 scale on a CPU, as in GGUF's Q8_0 blocks
INT4_GROUP = 32  # input channels sharing one scale and zero point, as in GGUF's Q4 blocks


def quantized_activations(x: Tensor) -> Tensor:
    """`x` [..., K] as the packed formats multiply it on a CPU: each group of `INT8_GROUP` inputs
    rounded to int8 steps of its largest magnitude / 127 (half to even; zero stays zero). The C
    kernel (`packed_linear.c`, `quantize_rows_shared`) rounds with the same float32 operations."""
    width = x.shape[-1]
    padded = F.pad(x.float(), (0, -width % INT8_GROUP))
    groups = padded.view(*padded.shape[:-1], -1, INT8_GROUP)
    step = groups.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    rounded = torch.round(groups * inverse).clamp(-127, 127) * step
    out: Tensor = rounded.view(padded.shape)[..., :width].to(x.dtype)
    return out


class WeightsError(ValueError):
    """A weight format this model or device cannot use; raised at load, never at a request."""


@dataclass(frozen=True)
class PackedBlocks:
    """A matrix as a checkpoint stores it packed (a GGUF Q8_0 or Q4 tensor): codes [N, K] with
    one scale (and minimum) per output and group of 32 inputs. `weights` is the format that
    serves these codes as they are: `int8` (codes int8, W = code * scale) or `int4` (codes 0..15,
    W = code * scale + minimum)."""

    weights: str
    codes: Tensor
    scales: Tensor  # [N, K / 32] float32
    minimums: Tensor | None  # [N, K / 32] float32 (int4)

    def map(self, function: Callable[[Tensor], Tensor]) -> PackedBlocks:
        """The same blocks with `function` applied to each part (a row permutation, a split)."""
        minimums = function(self.minimums) if self.minimums is not None else None
        return PackedBlocks(self.weights, function(self.codes), function(self.scales), minimums)

    def layer(self, bias: Tensor | None, dtype: torch.dtype) -> nn.Module:
        """The packed layer serving these codes."""
        if self.weights == "int8":
            return Int8Linear(self.codes, self.scales, bias, group=INT8_GROUP, dtype=dtype)
        assert self.minimums is not None
        return Int4Linear(self.codes, self.scales, self.minimums, bias)


class Int8Linear(nn.Module):
    """`F.linear` with int8 weights: codes [N, K] and one scale per output and group of inputs
    ([N, ceil(K / group)]; W[n, k] = code * scale). The group is `INT8_GROUP` on a CPU (what the
    C step reads) and the whole input on CUDA (what `_weight_int8pack_mm` takes)."""

    codes: Tensor  # [N, K] int8
    scales: Tensor  # [N, ceil(K / group)] float32
    bias: Tensor | None

    def __init__(
        self, codes: Tensor, scales: Tensor, bias: Tensor | None, *, group: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if codes.dtype != torch.int8 or scales.shape != (self.out_features, -(-self.in_features // group)):
            raise WeightsError(f"int8 codes {tuple(codes.shape)} need scales per group of {group} inputs")
        self.group, self.out_dtype = group, dtype
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("bias", bias.detach().to(dtype) if bias is not None else None)

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Int8Linear:
        """Symmetric codes: each group's largest magnitude maps to 127."""
        weight = linear.weight.detach().float()
        group = INT8_GROUP if weight.device.type == "cpu" else linear.in_features
        groups = _grouped(weight, group)  # [N, G, group], zero-padded
        scales = (groups.abs().amax(dim=-1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round(groups / scales[..., None]).clamp(-127, 127).to(torch.int8)
        codes = codes.view(weight.shape[0], -1)[:, : linear.in_features]
        return cls(codes, scales, linear.bias, group=group, dtype=linear.weight.dtype)

    def dequantized(self) -> Tensor:
        """The float weight [N, K] the codes stand for."""
        groups = _grouped(self.codes.float(), self.group) * self.scales[..., None]
        return groups.view(self.out_features, -1)[:, : self.in_features]

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        if self.codes.device.type == "cuda":
            flat = x.reshape(-1, self.in_features).to(self.out_dtype)
            out = torch._weight_int8pack_mm(flat, self.codes, self.scales[:, 0].to(self.out_dtype))
            if self.bias is not None:
                out = out + self.bias
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(quantized_activations(x), self.dequantized().to(x.dtype), bias)


def _grouped(matrix: Tensor, group: int) -> Tensor:
    """[N, ceil(K / group), group] from [N, K], zero-padded along K."""
    padded = F.pad(matrix, (0, -matrix.shape[1] % group))
    return padded.view(matrix.shape[0], -1, group)


class Int4Linear(nn.Module):
    """`F.linear` with 4-bit weights: codes 0..15 with a scale and a minimum per output and group
    of `INT4_GROUP` inputs (GGUF's Q4_1 block): W[n, k] = code * scale + minimum. Codes are kept
    two to a byte ([N, K / 2], the even input in the low nibble)."""

    nibbles: Tensor  # [N, K / 2] uint8
    scales: Tensor  # [N, K / G] float32
    minimums: Tensor  # [N, K / G] float32
    bias: Tensor | None

    def __init__(self, codes: Tensor, scales: Tensor, minimums: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        groups = (self.out_features, self.in_features // INT4_GROUP)
        if self.in_features % INT4_GROUP or scales.shape != groups or minimums.shape != groups:
            raise WeightsError(
                f"4-bit codes {tuple(codes.shape)} need scales per group of {INT4_GROUP} inputs"
            )
        pairs = codes.to(torch.uint8).view(self.out_features, -1, 2)
        self.register_buffer("nibbles", (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("minimums", minimums.float().contiguous())
        self.register_buffer("bias", bias.detach().float() if bias is not None else None)

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Int4Linear:
        """Asymmetric codes: each group's range [min, max] in 15 steps."""
        weight = linear.weight.detach().float()
        groups = weight.view(weight.shape[0], -1, INT4_GROUP)  # [N, K / G, G]
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15.0).clamp(min=1e-8)
        codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
        return cls(codes.view_as(weight), scales, low, linear.bias)

    def codes(self) -> Tensor:
        """[N, K] uint8, 0..15."""
        return torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).view(self.out_features, -1)

    def dequantized(self) -> Tensor:
        """The float weight [N, K] the codes stand for."""
        groups = self.codes().float().view(self.out_features, -1, INT4_GROUP)
        return (groups * self.scales[..., None] + self.minimums[..., None]).view(self.out_features, -1)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(quantized_activations(x), self.dequantized().to(x.dtype), bias)


def quantize_weights(
    model: Transformer, weights: str, blocks: Mapping[str, PackedBlocks] | None = None
) -> Transformer:
    """`model` with every block projection and the output head packed as `weights` says.

    `blocks` are a checkpoint's own packed matrices under our names (`layers.0.attn.q_proj`): a
    layer whose blocks are in `weights`' format, or a finer one (int8 blocks under int4: a GGUF
    Q4 file's Q8_0 head), is served from those codes, and the others are quantized from their
    floats. Raises `WeightsError` when the format cannot run here: int4 off a
    CPU, or a layer whose input width is not a whole number of int4 groups.
    """
    if weights == "float":
        return model
    packer = _PACKERS.get(weights)
    if packer is None:
        raise WeightsError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
    device = model.embed_tokens.weight.device
    if weights == "int4" and device.type != "cpu":
        raise WeightsError(f"weights 'int4' run on a CPU only (the model is on {device.type}); use int8")
    targets = [(name, module) for name, module in model.named_modules() if _is_packed_target(name, module)]
    for name, module in targets:
        assert isinstance(module, nn.Linear)
        if weights == "int4" and module.in_features % INT4_GROUP:
            raise WeightsError(
                f"weights 'int4' need input widths divisible by {INT4_GROUP}; {name} has {module.in_features}"
            )
    own = {name: packed for name, packed in (blocks or {}).items() if packed.weights in _AS_FINE[weights]}
    with torch.no_grad():
        for name, module in targets:
            assert isinstance(module, nn.Linear)
            stored = own.get(name)
            layer = stored.layer(module.bias, module.weight.dtype) if stored is not None else packer(module)
            parent_name, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attribute, layer)
    return model


def weights_of(model: nn.Module) -> str:
    """The format `quantize_weights` left `model` in."""
    for module in model.modules():
        for name, packed in _CLASSES.items():
            if isinstance(module, packed):
                return name
    return "float"


_PACKERS: dict[str, Callable[[nn.Linear], nn.Module]] = {
    "int8": Int8Linear.quantize,
    "int4": Int4Linear.quantize,
}
_CLASSES: dict[str, type[nn.Module]] = {"int8": Int8Linear, "int4": Int4Linear}
# The stored formats a `--weights` format serves as they are: its own and the finer ones.
_AS_FINE: dict[str, tuple[str, ...]] = {"int8": ("int8",), "int4": ("int4", "int8")}
# What `--weights` accepts (`service.settings.Weights` spells the same names for the CLI).
WEIGHT_FORMATS: tuple[str, ...] = ("float", *_PACKERS)

_PACKED = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def _is_packed_target(name: str, module: nn.Module) -> bool:
    """The block projections (`layers.N.attn.q_proj`, `layers.N.mlp.down_proj`, ...) and `lm_head`."""
    if not isinstance(module, nn.Linear):
        return False
    parts = name.split(".")
    block_projection = len(parts) == 4 and parts[0] == "layers" and parts[3] in _PACKED.get(parts[2], ())
    return name == "lm_head" or block_projection


__all__ = [
    "INT4_GROUP",
    "INT8_GROUP",
    "WEIGHT_FORMATS",
    "Int4Linear",
    "Int8Linear",
    "PackedBlocks",
    "WeightsError",
    "quantize_weights",
    "quantized_activations",
    "weights_of",
]
