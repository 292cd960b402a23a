"""Texts the lab can sweep without a file: long English that every Python install already has."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pe_client.errors import PEServeError


def _pydoc_topics() -> str:
    """`pydoc_data/topics.py` of the running Python: about 750 kB of the language reference's prose."""
    import pydoc_data.topics

    return Path(pydoc_data.topics.__file__).read_text(encoding="utf-8")


CORPORA: dict[str, Callable[[], str]] = {"pydoc-topics": _pydoc_topics}


def corpus_text(name: str) -> str:
    try:
        read = CORPORA[name]
    except KeyError:
        raise PEServeError(f"unknown corpus {name!r} (known: {', '.join(CORPORA)})") from None
    return read()
