"""Tokenizers behind one small interface: our byte-level one and Hugging Face `tokenizer.json`.

`encode(text)` returns the text's tokens only; `add_special_tokens=True` adds what the model expects
at the start of a document (BOS for our byte models, whatever `tokenizer.json` prescribes for
Hugging Face ones). Prompts are encoded that way, token lists sent by clients are used as given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as _HFTokenizer


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

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

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Training frames every file as BOS bytes EOS, so a prompt starts like a file does."""
        prefix = [self.bos_id] if add_special_tokens else []
        return prefix + list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(token for token in tokens if 0 <= token < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` library (no `transformers` at run time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tokenizer = _HFTokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, tokens: list[int]) -> str:
        return str(self._tokenizer.decode(tokens, skip_special_tokens=True))

    def __reduce__(self) -> tuple[type[HFTokenizer], tuple[Path]]:
        """Sent to another process as its file, which that process reads again."""
        return HFTokenizer, (self.path,)
