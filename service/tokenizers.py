"""Tokenizers behind one small interface: our byte-level one and Hugging Face `tokenizer.json`.

`encode(text)` returns the text's tokens only; `add_special_tokens=True` adds what the model expects
at the start of a document (BOS for our byte models, whatever `tokenizer.json` prescribes for
Hugging Face ones). Prompts are encoded that way, token lists sent by clients are used as given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as _HFTokenizer

from service.engine.types import TokenizerInfo


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
    """A `tokenizer.json` loaded with the `tokenizers` library (no `transformers` at run time).

    From a file (a Hugging Face directory's) or from the JSON text itself (what a GGUF file's
    `tokenizer.ggml.*` fields are translated into, `service.model.gguf_file.tokenizer_json`).
    """

    def __init__(self, path: Path | None = None, *, json_text: str | None = None) -> None:
        if (path is None) == (json_text is None):
            raise ValueError("give exactly one of path and json_text")
        self.path = path
        self._json_text = json_text
        self._tokenizer = (
            _HFTokenizer.from_file(str(path)) if path is not None else _HFTokenizer.from_str(str(json_text))
        )
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, tokens: list[int]) -> str:
        return str(self._tokenizer.decode(tokens, skip_special_tokens=True))

    def __reduce__(self) -> tuple[Any, ...]:
        """Sent to another process as its file, which that process reads again, or as its JSON."""
        if self.path is not None:
            return HFTokenizer, (self.path,)
        return _from_json, (self._json_text,)


def _from_json(json_text: str) -> HFTokenizer:
    return HFTokenizer(json_text=json_text)


def hf_tokenizer_info(directory: Path, *, bos_id: int | None, eos_id: int | None) -> TokenizerInfo:
    """Special tokens and chat template from a Hugging Face directory, where transformers looks.

    `tokenizer_config.json` holds the special tokens (as text or as an AddedToken dict) and the
    chat template (one string, or a list of named templates whose "default" is the one used);
    a `chat_template.jinja` beside it takes precedence, as in recent transformers.
    """
    config_path = directory / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
    template_file = directory / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else _default_template(config)
    return TokenizerInfo(
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        pad_token=_token_text(config.get("pad_token")),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        chat_template=template,
    )


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _default_template(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
