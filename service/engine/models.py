"""Resident models: loading a directory (ours or Hugging Face) and what a request may ask of it.

`ModelSpec` is a model without its weights: name, config, tokenizer and the rules a request must
meet. It is small and picklable, so the API process validates requests with exactly the code the
engine uses, even when the engine runs in a process of its own. `ModelSpec.resolve_pe` is the
single place that decides whether a scaling and a length can run on a model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pe_runtime import PECache, PEConfigError, RopeScaling, rope_inv_freq, rope_seq_len_key
from service.engine.errors import ContextLengthError, InvalidRequestError
from service.engine.types import SCALING_FIELD, ModelInfo, PEInfo, TokenizerInfo
from service.model.attention_rules import AttentionRule
from service.model.checkpoint import is_checkpoint, load_checkpoint, read_config, training_method
from service.model.config import ModelConfig
from service.model.gguf_file import gguf_path, model_name, read_gguf
from service.model.hf import build_hf_model, is_hf_checkpoint, load_hf_checkpoint, packed_blocks_by_layer
from service.model.positional import SUPPORTED_ATTENTION, SUPPORTED_SCALINGS, default_scaling
from service.model.quantized import PackedBlocks, quantize_weights
from service.model.transformer import Transformer
from service.tokenizers import ByteTokenizer, HFTokenizer, TextTokenizer, hf_tokenizer_info


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: ModelConfig
    tokenizer: TextTokenizer
    info: ModelInfo
    tokenizer_info: TokenizerInfo = field(default_factory=TokenizerInfo)

    @property
    def default_scaling(self) -> RopeScaling:
        return default_scaling(self.config)

    def effective_scaling(self, scaling: RopeScaling | None) -> RopeScaling:
        """A request's scaling replaces the model's own; None keeps the model's."""
        return scaling if scaling is not None else self.default_scaling

    def resolve_pe(
        self, scaling: RopeScaling | None, total_length: int, attention: AttentionRule | None = None
    ) -> PEInfo:
        """What `scaling` resolves to at `total_length` tokens (prompt + new tokens), or why it cannot.

        The catalog has checked the scheme and the context first; what is left depends on the
        model's tables (learned positions) and the scaling's own parameters.
        """
        config = self.config
        effective = self.effective_scaling(scaling)
        if config.pe == "learned":
            self._check_learned_table(effective, total_length)
        return PEInfo(
            scheme=config.pe,
            scaling=effective,
            attention_factor=self._attention_factor(effective, total_length),
            native_context=config.native_context,
            max_context=self.info.max_context,
            attention=attention,
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_learned_table(self, scaling: RopeScaling, total_length: int) -> None:
        """Learned positions exist only up to the table (stretched by a linear factor)."""
        native = self.config.native_context
        factor = scaling.factor if scaling.type == "linear" else 1.0
        if total_length > int(native * factor):
            needed = total_length / native
            raise ContextLengthError(
                f"{self.name!r} has learned positions for {int(native * factor)} tokens"
                f"{' at this factor' if factor > 1.0 else ''}; {total_length} need "
                f"pe_scaling {{'type': 'linear', 'factor': >= {needed:.3g}}}",
                param=f"{SCALING_FIELD}.factor" if factor > 1.0 else SCALING_FIELD,
            )

    def _attention_factor(self, scaling: RopeScaling, total_length: int) -> float:
        config = self.config
        if not config.has_rope:
            return 1.0
        try:
            return _rope_attention_factor(
                config.rotary_dim, config.rope_base, scaling, rope_seq_len_key(scaling, total_length)
            )
        except PEConfigError as error:
            raise InvalidRequestError(error.message, param=f"{SCALING_FIELD}.{error.field}") from error


@functools.lru_cache(maxsize=1024)
def _rope_attention_factor(
    rotary_dim: int, base: float, scaling: RopeScaling, seq_len_key: int | None
) -> float:
    """The factor a scaling multiplies cos/sin by, computed once per scaling and table.

    Every request is validated in the API process, whose one torch thread would otherwise build
    the inverse frequencies again for each request (a quarter of a small request's cost there).
    Static scalings key on no length at all, so the cache holds one entry per scaling in use.
    """
    return rope_inv_freq(rotary_dim, base, scaling, seq_len=seq_len_key)[1]


@dataclass(frozen=True)
class ServedModel:
    """A resident model: its spec and its weights on the engine's device."""

    spec: ModelSpec
    model: Transformer

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.spec.tokenizer

    def effective_scaling(self, scaling: RopeScaling | None) -> RopeScaling:
        return self.spec.effective_scaling(scaling)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto`/None: bfloat16 on CUDA, float32 on CPU (where bfloat16 matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    resolved = getattr(torch, dtype)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unsupported dtype {dtype!r}")
    return resolved


def load_served_model(
    directory: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_context: int,
    pe_cache: PECache,
    weights: str = "float",
    max_stream_tokens: int = 65536,
) -> ServedModel:
    """Load our checkpoint, a Hugging Face directory (`tokenizer.json` required) or a GGUF file,
    then pack its linear weights as `weights` says (a `WeightsError` if they cannot run here)."""
    tokenizer: TextTokenizer
    method = None
    blocks: dict[str, PackedBlocks] = {}  # a checkpoint's own packed matrices, by our layer name
    if is_checkpoint(directory):
        name, _ = read_config(directory)
        method = training_method(directory)
        model = load_checkpoint(directory, device=device, dtype=dtype, pe_cache=pe_cache)
        tokenizer = ByteTokenizer()
        tokenizer_info = TokenizerInfo(bos_token_id=model.config.bos_id, eos_token_id=model.config.eos_id)
    elif (gguf_file := gguf_path(directory)) is not None:
        name = model_name(directory)
        checkpoint = read_gguf(gguf_file)
        model = build_hf_model(
            checkpoint.hf_config, checkpoint.tensors, device=device, dtype=dtype, pe_cache=pe_cache
        )
        tokenizer = HFTokenizer(json_text=checkpoint.tokenizer_json)
        tokenizer_info = checkpoint.tokenizer_info
        tied = model.config.tie_embeddings
        blocks = packed_blocks_by_layer(checkpoint.hf_config, checkpoint.blocks, tied=tied)
    elif is_hf_checkpoint(directory):
        if not (directory / "tokenizer.json").is_file():
            raise ValueError(f"{directory} is a Hugging Face checkpoint without tokenizer.json")
        name = directory.name
        model = load_hf_checkpoint(directory, device=device, dtype=dtype, pe_cache=pe_cache)
        tokenizer = HFTokenizer(directory / "tokenizer.json")
        tokenizer_info = hf_tokenizer_info(directory, bos_id=model.config.bos_id, eos_id=model.config.eos_id)
    else:
        raise ValueError(f"{directory} holds neither a pe-serve, a Hugging Face nor a GGUF checkpoint")
    config = model.config
    info = ModelInfo(
        name=name,
        scheme=config.pe,
        native_context=config.native_context,
        max_context=min(max_context, config.sliding_window or max_context),
        max_stream_tokens=max_stream_tokens if "streaming" in SUPPORTED_ATTENTION[config.pe] else 0,
        supported_scalings=SUPPORTED_SCALINGS[config.pe],
        supported_attention=SUPPORTED_ATTENTION[config.pe],
        parameters=sum(parameter.numel() for parameter in model.parameters()),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        vocab_size=config.vocab_size,
        weights=weights,
        training_method=method,
    )
    model = quantize_weights(model, weights, blocks)  # after counting: packed layers hold no parameters
    spec = ModelSpec(name=name, config=config, tokenizer=tokenizer, info=info, tokenizer_info=tokenizer_info)
    return ServedModel(spec, model)
