"""Quantized weights (`--weights int8|int4`): a model's linear layers swapped, once at load, for
modules that keep their weights packed and multiply through torch's own kernels.

Which kernel, and why:

- `int8` on a CPU: fbgemm's dynamic linear (`quantized::linear_dynamic`). Weights are int8 with
  one scale per output channel; each call quantizes its activations per row block to uint8 and
  accumulates in int32. It is torch's well-kept x86 path (AVX2 / AVX-512 VNNI). torch's
  weight-only `_weight_int8pack_mm` exists too, but on a CPU it is a reference loop, 10-20x slower
  than a float matmul on our hosts, where fbgemm is 4-18x faster (measured on SmolLM2's shapes).
- `int8` on CUDA: weight-only `_weight_int8pack_mm` (int8 weights, per-channel scales, float
  activations).
- `int4` on a CPU: `_weight_int4pack_mm_for_cpu`, 4-bit weights in groups of 32 along the input
  with a scale and zero point per group (asymmetric, as GGUF's Q4_1). Its activations go in as
  bfloat16: that is the kernel's vectorized path; with float32 it falls back to a scalar loop
  40-120x slower (2.5 ms against 0.06 ms for one 576x1536 row, 1.3 s against 11 ms for 512).
  On CUDA torch's tiled int4 layout needs its own packing; the server refuses `int4` there at
  start-up rather than serving untested numerics.

Embeddings, norms and the relative-attention projections stay float: they are a lookup or a small
share of the arithmetic. A tied output head gets its own packed copy (the embedding lookup keeps
the float table). What a format costs in quality is measured (bits per token on English text,
`bench/weight_formats.py`), not assumed.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from service.model.transformer import Transformer

INT4_GROUP = 32  # input channels sharing one scale and zero point, as in GGUF's Q4 blocks
INT4_OUTPUT_TILE = 16  # the int4 packing's unit along the outputs


class WeightsError(ValueError):
    """A weight format this model or device cannot use; raised at load, never at a request."""


class Int8Linear(nn.Module):
    """`F.linear` with int8 weights, one scale per output channel, packed once."""

    bias: Tensor | None
    sentinel: Tensor  # CPU: the row that pins fbgemm's activation range
    qweight: Tensor  # CUDA: [N, K] int8
    scales: Tensor  # CUDA: [N]

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        # Added after the matmul on both devices; on a CPU it must follow the per-row rescale.
        bias = linear.bias.detach().to(self.out_dtype) if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.on_cpu = weight.device.type == "cpu"
        if self.on_cpu:
            if "fbgemm" not in torch.backends.quantized.supported_engines:
                raise WeightsError("weights 'int8' on a CPU need torch's fbgemm kernels (x86), absent here")
            with warnings.catch_warnings():
                # Quantized tensors are deprecated upstream; fbgemm's prepack still takes one, and
                # torch is pinned (2.13), so the warning says nothing a user can act on.
                warnings.simplefilter("ignore", UserWarning)
                qweight = torch.quantize_per_channel(
                    weight, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8
                )
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
            sentinel = torch.zeros(1, self.in_features)
            sentinel[0, 0], sentinel[0, -1] = 1.0, -1.0
            self.register_buffer("sentinel", sentinel)
        else:
            quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
            self.register_buffer("qweight", quantized)
            self.register_buffer("scales", scales.to(self.out_dtype))

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        if self.on_cpu:
            # fbgemm quantizes its whole input on one range. Real models have rows (a BOS token,
            # a delimiter) whose activations are 100x the rest, which would crush every other row
            # to a few levels: on SmolLM2 that cost 0.75 bits per token, most of it in down_proj.
            # Each row is scaled to a peak of 1 and its output scaled back (the layer is linear),
            # and a sentinel row [1, -1, 0, ...] pins the range to [-1, 1]: every row is quantized
            # on the same grid whatever its batch, so batched equals alone.
            flat = x.reshape(-1, self.in_features).float()
            peaks = flat.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
            rows = torch.cat([flat / peaks, self.sentinel])
            out = torch.ops.quantized.linear_dynamic(rows, self._packed, False)[:-1] * peaks
        else:
            flat = x.reshape(-1, self.in_features).to(self.out_dtype)
            out = torch._weight_int8pack_mm(flat, self.qweight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        result: Tensor = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return result


class Int4Linear(nn.Module):
    """`F.linear` with 4-bit weights in groups of `INT4_GROUP` inputs (scale and zero per group)."""

    packed: Tensor
    scales_and_zeros: Tensor  # [K / G, N, 2] bfloat16
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The packing takes outputs in tiles of 16; a vocabulary such as 258 gets zero rows, cut off.
        padded = -(-self.out_features // INT4_OUTPUT_TILE) * INT4_OUTPUT_TILE
        weight = nn.functional.pad(linear.weight.detach().float(), (0, 0, 0, padded - self.out_features))
        groups = weight.view(padded, -1, INT4_GROUP)  # [N, K / G, G]
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15.0).clamp(min=1e-8)
        codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
        codes = codes.to(torch.int32).view(padded, self.in_features)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        # The kernel reads code c of a group as (c - 8) * scale + zero: zero = low + 8 * scale.
        scales_and_zeros = torch.stack([scales, low + 8 * scales], dim=-1).transpose(0, 1)  # [K / G, N, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", linear.bias.detach().float() if linear.bias is not None else None)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scales_and_zeros)
        out = out[:, : self.out_features].float()
        if self.bias is not None:
            out = out + self.bias
        result: Tensor = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return result


def quantize_weights(model: Transformer, weights: str) -> Transformer:
    """`model` with every block projection and the output head packed as `weights` says.

    Raises `WeightsError` when the format cannot run here: int4 off a CPU, or a layer whose input
    width is not a whole number of int4 groups.
    """
    if weights == "float":
        return model
    packer = _PACKERS.get(weights)
    if packer is None:
        raise WeightsError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
    device = model.embed_tokens.weight.device
    if packer is Int4Linear and device.type != "cpu":
        raise WeightsError(f"weights 'int4' run on a CPU only (the model is on {device.type}); use int8")
    targets = [(name, module) for name, module in model.named_modules() if _is_packed_target(name, module)]
    for name, module in targets:
        assert isinstance(module, nn.Linear)
        if weights == "int4" and module.in_features % INT4_GROUP:
            raise WeightsError(
                f"weights 'int4' need input widths divisible by {INT4_GROUP}; {name} has {module.in_features}"
            )
    with torch.no_grad():
        for name, module in targets:
            parent_name, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attribute, packer(module))
    return model


def weights_of(model: nn.Module) -> str:
    """The format `quantize_weights` left `model` in."""
    for module in model.modules():
        for name, packer in _PACKERS.items():
            if isinstance(module, packer):
                return name
    return "float"


_PACKERS: dict[str, type[Int8Linear] | type[Int4Linear]] = {"int8": Int8Linear, "int4": Int4Linear}
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
    "WEIGHT_FORMATS",
    "Int4Linear",
    "Int8Linear",
    "WeightsError",
    "quantize_weights",
    "weights_of",
]
