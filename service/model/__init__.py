"""The model: config, transformer with a pluggable positional scheme, KV cache, checkpoints."""

from service.model.checkpoint import load_checkpoint, save_checkpoint
from service.model.config import SCHEMES, ModelConfig, Scheme
from service.model.kv_cache import KVCache
from service.model.positional import SUPPORTED_SCALINGS
from service.model.transformer import Transformer

__all__ = [
    "SCHEMES",
    "SUPPORTED_SCALINGS",
    "KVCache",
    "ModelConfig",
    "Scheme",
    "Transformer",
    "load_checkpoint",
    "save_checkpoint",
]
