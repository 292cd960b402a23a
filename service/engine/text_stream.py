"""Incremental detokenization with stop strings, for streaming text that never has to be taken back.

A token's text is released only once it can no longer turn out to be part of a stop string or of
an unfinished multi-byte character; what is held back is released with a later token, or with the
last one when the sequence ends.
"""

from __future__ import annotations

from collections.abc import Callable

_INCOMPLETE = "\ufffd"  # what a decoder yields for bytes that do not form a character yet


class IncrementalDecoder:
    """`decode(tokens)` of a growing token list at a cost that does not grow with the list.

    The text of committed tokens is kept; each step decodes only the newer tokens plus a few
    before them (tokenizers such as SentencePiece render a token differently at the start of a
    text, and the same context before both decodes cancels that) and appends what follows the
    context. If the context's text is not a prefix of the window's, for instance because a
    character spans the boundary, the step falls back to decoding everything.
    """

    _CONTEXT = 4
    _COMMIT_EVERY = 8

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._committed = 0
        self._committed_text = ""

    def append(self, token: int) -> str:
        """Add a token; return the decoded text of all tokens so far."""
        self._tokens.append(token)
        start = max(0, self._committed - self._CONTEXT)
        context = self._decode(self._tokens[start : self._committed])
        window = self._decode(self._tokens[start:])
        if window.startswith(context):
            text = self._committed_text + window[len(context) :]
        else:
            text = self._decode(self._tokens)
        if len(self._tokens) - self._committed >= self._COMMIT_EVERY and not text.endswith(_INCOMPLETE):
            self._committed, self._committed_text = len(self._tokens), text
        return text


class TextStream:
    """A generation's text as its tokens arrive.

    With `incremental=False` (a request that neither streams nor has stop strings: nobody reads
    its text before the end) tokens are only collected, and the text is decoded once, with the
    last one; a batch of such requests then spends no time detokenizing between steps.
    """

    def __init__(
        self, decode: Callable[[list[int]], str], stop: tuple[str, ...], *, incremental: bool = True
    ) -> None:
        self._decoder = IncrementalDecoder(decode)
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._incremental = incremental or bool(self._stop)
        self._tokens: list[int] = []
        self._released = 0
        self._floor = 0  # stops must end past this: text up to it came while stops were suppressed
        self._text = ""
        self._decoded = 0  # tokens behind `_text` when it is decoded at once
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything generated so far (before a stop string, if one was hit)."""
        if not self._incremental and self._decoded != len(self._tokens):
            self._text, self._decoded = self._decode(self._tokens), len(self._tokens)
        return self._text

    def push(self, token: int, *, final: bool = False, may_stop: bool = True) -> str:
        """Add a token; return the text that is now safe to release (everything if `final`).

        Sets `stopped` and truncates `text` before the stop string when one appears, unless
        `may_stop` is False (a request's min_tokens not reached yet): text that could start a
        stop string is still held back then, so a stop string completed later is still caught.
        """
        if not self._incremental:
            self._tokens.append(token)
            return self.text if final else ""
        text = self._decoder.append(token)
        if not may_stop:
            self._floor = len(text)
        stop_at = self._first_stop(text)
        if stop_at is not None:
            self.stopped = True
            text, safe = text[:stop_at], stop_at
        elif final:
            safe = len(text)
        else:
            safe = self._safe_length(text)
        self._text = text
        released, self._released = text[self._released : safe], max(self._released, safe)
        return released

    def _first_stop(self, text: str) -> int | None:
        # A stop string must end in text not yet released, and past what came while stops were
        # suppressed (min_tokens): one completed then was let through and is not a stop any more.
        end_after = max(self._released, self._floor)
        hits = [index for s in self._stop if (index := text.find(s, max(0, end_after - len(s) + 1))) >= 0]
        return min(hits) if hits else None

    def _safe_length(self, text: str) -> int:
        """Length of the prefix that neither ends mid-character nor in the beginning of a stop string."""
        end = len(text.rstrip(_INCOMPLETE))
        held = max(
            (n for s in self._stop for n in range(1, min(len(s), end) + 1) if text[end - n : end] == s[:n]),
            default=0,
        )
        return end - held
