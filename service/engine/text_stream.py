"""Incremental detokenization with stop strings, for streaming text that never has to be taken back.

A token's text is released only once it can no longer turn out to be part of a stop string or of
an unfinished multi-byte character; what is held back is released with a later token, or with the
last one when the sequence ends.
"""

from __future__ import annotations

from collections.abc import Callable

_INCOMPLETE = "\ufffd"  # what a decoder yields for bytes that do not form a character yet


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._tokens: list[int] = []
        self._released = 0
        self.text = ""
        self.stopped = False

    def push(self, token: int, *, final: bool = False) -> str:
        """Add a token; return the text that is now safe to release (everything if `final`).

        Sets `stopped` and truncates `text` before the stop string when one appears.
        """
        self._tokens.append(token)
        text = self._decode(self._tokens)
        stop_at = self._first_stop(text)
        if stop_at is not None:
            self.stopped = True
            text, safe = text[:stop_at], stop_at
        elif final:
            safe = len(text)
        else:
            safe = self._safe_length(text)
        self.text = text
        released, self._released = text[self._released : safe], max(self._released, safe)
        return released

    def _first_stop(self, text: str) -> int | None:
        # A stop string may only start in text not yet released (released text contains none).
        search_from = max(0, self._released - max((len(s) for s in self._stop), default=0))
        hits = [index for s in self._stop if (index := text.find(s, search_from)) >= 0]
        return min(hits) if hits else None

    def _safe_length(self, text: str) -> int:
        """Length of the prefix that neither ends mid-character nor in the beginning of a stop string."""
        end = len(text.rstrip(_INCOMPLETE))
        held = max(
            (n for s in self._stop for n in range(1, min(len(s), end) + 1) if text[end - n : end] == s[:n]),
            default=0,
        )
        return end - held
