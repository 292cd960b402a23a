"""Filler for the lab's retrieval tests: the classic noise, and any text cut to a number of words
with items hidden in it at chosen depths.

The noise (Mohtashami and Jaggi's passkey filler, which RULER reuses) is sentences with nothing to
learn from, so only attention to what is hidden can find it. A prompt is fitted to a length in the
model's own tokens by trying sizes, so a haystack of n words must be the first n words of the
same stream whatever n is: growing a prompt only appends filler.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from pe_client.grid import GridError

NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
NOISE = " ".join(NOISE_SENTENCES) + "\n"
_SENTENCE_ENDS = (".", "!", "?", '."', '!"', '?"')


def noise_lines(seed: int, count: int) -> list[str]:
    """`count` lines of the noise, each with its sentences in an order drawn from `seed`.

    Trials with different seeds get different filler (a model cannot learn one fixed text), and
    the first n lines are the same for every count above n.
    """
    draw = random.Random(seed)
    return [" ".join(draw.sample(NOISE_SENTENCES, len(NOISE_SENTENCES))) + "\n" for _ in range(count)]


class Haystack:
    """A text as a stream of words (each with the whitespace after it), repeated as often as a
    prompt needs, into which items are inserted at sentence boundaries."""

    def __init__(self, text: str) -> None:
        pieces = re.findall(r"\S+\s*", text)
        if not pieces:
            raise GridError("the haystack text has no words")
        if not pieces[-1][-1].isspace():
            pieces[-1] += "\n"  # the text's end and its repeated start stay apart
        ends = [piece.rstrip().endswith(_SENTENCE_ENDS) or "\n" in piece for piece in pieces]
        self._pieces = pieces
        # A text without a sentence end (a list, code) takes items between any two words.
        self._ends = ends if any(ends) else [True] * len(pieces)

    def hide(self, size: int, items: Sequence[tuple[float, str]]) -> str:
        """The first `size` words with each `(depth, item)` inserted at the last sentence boundary
        at or before that depth (0: the start, 1: the end, which is a boundary however the words
        are cut); items at one place keep their order."""
        count = len(self._pieces)
        places = sorted(
            ((self._boundary(size, depth), order, item) for order, (depth, item) in enumerate(items)),
        )
        parts: list[str] = []
        start = 0
        for place, _, item in places:
            parts.extend(self._pieces[index % count] for index in range(start, place))
            parts.append(item + " ")
            start = place
        parts.extend(self._pieces[index % count] for index in range(start, size))
        return "".join(parts)

    def words_before(self, size: int, depths: Sequence[float]) -> int:
        """How many words of the stream `hide(size, items)` puts before its first item (items at
        these depths): the part of the text it shares with any other text hidden in this haystack."""
        return min((self._boundary(size, depth) for depth in depths), default=size)

    def _boundary(self, size: int, depth: float) -> int:
        place = min(size, max(0, round(depth * size)))
        while 0 < place < size and not self._ends[(place - 1) % len(self._pieces)]:
            place -= 1
        return place
