"""GGUF files (llama.cpp's format) read as a Hugging Face config, tensors and tokenizer.

A GGUF file carries everything a checkpoint directory does: hyper-parameters as metadata keys
(`<arch>.block_count`, ...), tensors under llama.cpp's names (`blk.N.attn_q.weight`, quantized
or not), and the tokenizer as `tokenizer.ggml.*` arrays. Reading one translates all three into
what `service.model.hf` already loads: a `config.json`-style dict, tensors under Hugging Face
names (dequantized to float32 with the `gguf` package's own kernels), and a `tokenizers`
tokenizer. So a GGUF model is served by exactly the code that serves its Hugging Face family.

llama.cpp's converter permutes the rows of the `llama` architecture's Q and K projections (its
rotation pairs adjacent channels, Hugging Face's pairs the two halves); reading undoes it.

Q8_0, Q4_0 and Q4_1 tensors are also kept as their codes and block scales (`blocks`), under the
same names: `--weights int8` serves a Q8_0 matrix, and `--weights int4` a Q4 one, from the file's
own codes rather than quantizing the dequantized floats again (`quantize_weights`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from service.engine.types import TokenizerInfo
from service.model.hf_families import UnsupportedCheckpointError
from service.model.quantized import PackedBlocks

# GGUF architecture -> Hugging Face model_type.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
# Metadata keys that change the math and that no supported model implements.
_REFUSED_SUFFIXES = ("attention.sliding_window", "final_logit_softcapping", "attn_logit_softcapping")
# `<arch>.rope.scaling.*` fields read into the scaling; the others change llama.cpp's YaRN in ways
# Hugging Face's has no field for, so a file setting one away from its neutral value is refused.
_SCALING_FIELDS = ("type", "factor", "original_context_length", "finetuned")
_NEUTRAL = {"attn_factor": 1.0, "yarn_log_multiplier": 0.0}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",  # phi3's is gate and up fused, renamed below
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class GGUFCheckpoint:
    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer_json: str
    tokenizer_info: TokenizerInfo
    blocks: dict[str, PackedBlocks]  # Hugging Face name -> the file's codes, for Q8_0 / Q4_0 / Q4_1


def gguf_path(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one `.gguf` in a directory without a config."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            names = ", ".join(file.name for file in found)
            raise UnsupportedCheckpointError(f"{path} holds several GGUF files ({names}); name one")
        return found[0] if found else None
    return None


def model_name(path: Path) -> str:
    """A GGUF file's model name is its file name without `.gguf`; a directory's, its basename."""
    return path.stem if path.is_file() else path.name


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def read_gguf(path: Path) -> GGUFCheckpoint:
    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedCheckpointError(
            f"GGUF field 'general.architecture' = {arch!r}: not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    for key in meta:
        if key.startswith(f"{arch}.") and key.endswith(_REFUSED_SUFFIXES):
            raise UnsupportedCheckpointError(f"GGUF field {key!r} = {meta[key]!r}: not implemented")
    raw = {tensor.name: _dequantized(tensor) for tensor in reader.tensors}
    config = _hf_config(str(arch), meta, raw)
    tensors = _hf_tensors(str(arch), config, raw)
    blocks: dict[str, PackedBlocks] = {}
    for tensor in reader.tensors:
        packed = _blocks(tensor)
        place = _hf_place(str(arch), config, tensor.name)
        if packed is not None and place is not None:
            hf_name, heads = place
            blocks[hf_name] = packed.map(functools.partial(_unpermute, heads=heads)) if heads else packed
    return GGUFCheckpoint(config, tensors, tokenizer_json(meta), _tokenizer_info(meta), blocks)


def _dequantized(tensor: Any) -> torch.Tensor:
    """float32 in the Hugging Face orientation (GGUF lists dimensions innermost first)."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(size) for size in reversed(tensor.shape))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


# Block layouts in bytes: (bytes per block of 32, offset of the codes, has a minimum).
_BLOCK_LAYOUTS = {
    gguf.GGMLQuantizationType.Q8_0: (34, 2, False),
    gguf.GGMLQuantizationType.Q4_0: (18, 2, False),
    gguf.GGMLQuantizationType.Q4_1: (20, 4, True),
}


def _blocks(tensor: Any) -> PackedBlocks | None:
    """A Q8_0 / Q4_0 / Q4_1 matrix's codes [N, K] and float16 block scales (and minimums) as
    float32 [N, K / 32]; None for other types. Q8_0: W = code * d (codes int8). Q4_1: W = code * d
    + m; Q4_0: W = (code - 8) * d, i.e. a minimum of -8 d (codes 0..15; byte j of a block holds
    element j in its low nibble and element j + 16 in its high one)."""
    layout = _BLOCK_LAYOUTS.get(tensor.tensor_type)
    if layout is None or len(tensor.shape) != 2:
        return None
    size, codes_at, has_minimum = layout
    data = np.asarray(tensor.data, dtype=np.uint8)
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, size)  # [N, K / 32, size]
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    payload = blocks[..., codes_at:]
    if tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        codes = torch.from_numpy(payload.copy().view(np.int8).reshape(rows, -1))
        return PackedBlocks("int8", codes, scales, None)
    nibbles = np.concatenate([payload & 15, payload >> 4], axis=-1)  # [N, K / 32, 32]
    codes = torch.from_numpy(nibbles.reshape(rows, -1).astype(np.uint8))
    if has_minimum:
        minimums = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    else:
        minimums = -8.0 * scales
    return PackedBlocks("int4", codes, scales, minimums)


def _hf_config(arch: str, meta: Mapping[str, Any], raw: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedCheckpointError(f"GGUF field '{arch}.{name}' is missing")
        return value

    heads = int(key("attention.head_count"))
    width = int(key("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or width // heads)
    context = int(key("context_length"))
    vocab = int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": vocab,
        "hidden_size": width,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": context,
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in raw,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in raw and arch == "llama",
    }
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        config["partial_rotary_factor"] = int(rotary) / head_dim
    scaling = _rope_scaling(arch, meta, raw, context)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(
    arch: str, meta: Mapping[str, Any], raw: Mapping[str, torch.Tensor], context: int
) -> dict[str, Any] | None:
    """`<arch>.rope.scaling.*` (and phi3's factor tensors) as a Hugging Face `rope_scaling`."""
    prefix = f"{arch}.rope.scaling."
    for key, value in meta.items():
        field = key.removeprefix(prefix)
        if key.startswith(prefix) and field not in _SCALING_FIELDS and _NEUTRAL.get(field) != value:
            raise UnsupportedCheckpointError(f"GGUF field {key!r} = {value!r}: not implemented")
    kind = meta.get(prefix + "type", "none")
    original = meta.get(prefix + "original_context_length")
    if "rope_factors_long.weight" in raw:
        return {
            "rope_type": "longrope",
            "short_factor": raw["rope_factors_short.weight"].tolist(),
            "long_factor": raw["rope_factors_long.weight"].tolist(),
            "original_max_position_embeddings": int(original or context),
        }
    if kind in ("none", None):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedCheckpointError(f"GGUF field '{prefix}type' = {kind!r}: not supported")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(meta[prefix + "factor"])}
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _hf_tensors(
    arch: str, config: Mapping[str, Any], raw: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        place = _hf_place(arch, config, name)
        if place is not None:
            hf_name, heads = place
            tensors[hf_name] = _unpermute(tensor, heads) if heads else tensor
    return tensors


def _hf_place(arch: str, config: Mapping[str, Any], name: str) -> tuple[str, int | None] | None:
    """The Hugging Face name of GGUF tensor `name`, with the head count whose rows llama.cpp
    permuted (None where it did not); None for tensors read into the config instead."""
    if name.startswith("rope_factors_"):
        return None
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}", None
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise UnsupportedCheckpointError(f"GGUF tensor {name!r} is not one this loader maps")
    ours = _LAYER_NAMES[parts[2]]
    if arch == "phi3" and parts[2] == "ffn_up":
        ours = "mlp.gate_up_proj"
    heads = None
    if arch == "llama" and parts[2] in ("attn_q", "attn_k"):
        heads = int(config["num_attention_heads" if parts[2] == "attn_q" else "num_key_value_heads"])
    return f"model.layers.{parts[1]}.{ours}.{kind}", heads


def _unpermute(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute`: rows of each head from (pairs, 2) order back to (2, halves)."""
    rows = tensor.shape[0]
    rest = tensor.shape[1:]
    return (
        tensor.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()
    )


# --- the tokenizer --------------------------------------------------------------------------------


def _modern_split(digits: str) -> str:
    """Llama 3's and Qwen2's split regex, which differ only in how many digits stay together."""
    words = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
    return words + digits + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


_LLAMA3_SPLIT = _modern_split(r"\p{N}{1,3}")
_QWEN2_SPLIT = _modern_split(r"\p{N}")
# `tokenizer.ggml.pre` -> how llama.cpp splits text before BPE (its `llama-vocab.cpp` table).
_PRE_TOKENIZERS: dict[str, list[dict[str, Any]]] = {
    "default": [],
    "gpt-2": [],
    "smollm": [{"type": "Digits", "individual_digits": True}],
    "llama-bpe": [
        {"type": "Split", "pattern": {"Regex": _LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False}
    ],
    "qwen2": [{"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False}],
}
_CONTROL, _USER_DEFINED = 3, 4


def tokenizer_json(meta: Mapping[str, Any]) -> str:
    """A `tokenizer.json` for the `tokenizers` library built from the `tokenizer.ggml.*` fields."""
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    added = [
        {"id": index, "content": token, "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": kind == _CONTROL}
        for index, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    vocab = {token: index for index, token in enumerate(tokens)}
    if model == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise UnsupportedCheckpointError(f"GGUF field 'tokenizer.ggml.pre' = {pre!r}: not supported")
        own_split = bool(_PRE_TOKENIZERS[pre]) and _PRE_TOKENIZERS[pre][0]["type"] == "Split"
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
        byte_level["use_regex"] = not own_split
        body: dict[str, Any] = {
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*_PRE_TOKENIZERS[pre], byte_level]},
            "decoder": {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": True,
                "use_regex": True,
            },
            "model": {
                "type": "BPE",
                "vocab": vocab,
                "merges": [merge.split(" ", 1) for merge in meta.get("tokenizer.ggml.merges", [])],
                "ignore_merges": pre == "llama-bpe",
            },
        }
    elif model == "llama":
        body = _sentencepiece(meta, tokens, vocab)
    else:
        raise UnsupportedCheckpointError(f"GGUF field 'tokenizer.ggml.model' = {model!r}: not supported")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", model == "llama") and bos is not None:
        body["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": tokens[bos], "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}},
        }
    else:
        body["post_processor"] = None
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, **body})


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str], vocab: dict[str, int]) -> dict[str, Any]:
    """A SentencePiece BPE vocabulary as `tokenizers` BPE: merges ranked by the merged piece's score,
    spaces as `▁`, bytes past the vocabulary through the `<0xNN>` tokens."""
    scores: list[float] = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    merges: list[tuple[float, int, str, str]] = []
    for piece, index in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[index], index, left, right))
    merges.sort()
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    normalizers: list[dict[str, Any]] = [{"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]
    if prefix:
        normalizers.insert(0, {"type": "Prepend", "prepend": "▁"})
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "vocab": vocab,
            "merges": [[left, right] for *_, left, right in merges],
            "unk_token": tokens[unk] if unk is not None else None,
            "fuse_unk": True,
            "byte_fallback": True,
        },
    }


def _tokenizer_info(meta: Mapping[str, Any]) -> TokenizerInfo:
    tokens = meta["tokenizer.ggml.tokens"]
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return TokenizerInfo(
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos] if eos is not None else None,
        bos_token_id=bos,
        eos_token_id=eos,
        chat_template=meta.get("tokenizer.chat_template"),
    )
