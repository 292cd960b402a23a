"""Tokenizers behind one small interface: our byte-level one and Hugging Face `tokenizer.json`.

`encode` never adds special tokens: whether a prompt starts with BOS is a model convention that the
engine applies, so scoring exact token lists and encoding text stay the same operation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as _HFTokenizer


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS (256) and EOS (257).

    Byte-level means every string round-trips and no vocabulary file is needed; special ids are
    dropped on decode, and bytes that do not form complete UTF-8 yet decode to U+FFFD, which the
    engine uses to hold back a partial character while streaming.
    """

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(token for token in tokens if 0 <= token < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` library (no `transformers` at run time)."""

    def __init__(self, path: Path) -> None:
        self._tokenizer = _HFTokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, tokens: list[int]) -> str:
        return str(self._tokenizer.decode(tokens, skip_special_tokens=True))
