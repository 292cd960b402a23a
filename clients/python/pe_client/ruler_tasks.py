"""RULER's synthetic task families (Hsieh et al. 2024, NVIDIA/RULER), generated offline by our own code.

Each sample is a recipe: everything random is drawn once from the sample's seed, and `build(size)`
returns the prompt with `size` units of filler (haystack words, rare words, coded words). Building
is pure, so a sample is fitted to a length in the model's tokens by trying sizes (`fit`) and the
same seed gives the same prompts again. No word list, corpus or tokenizer is downloaded: keys and
words are pronounceable pseudo-words drawn from the seed.

- `niah_single`: one needle "One of the special magic numbers for KEY is: VALUE." in the haystack;
  asked for KEY's value.
- `niah_multikey`: four needles with distinct keys; asked for one key's value.
- `niah_multivalue`: four needles with one key and distinct values; asked for all the values.
- `vt`: a chain "VAR A = 12345.", "VAR B = VAR A.", ... (five variables) hidden in the haystack;
  asked which variables hold 12345.
- `cwe`: a numbered list in which ten words appear many times and the rest rarely; asked for the
  ten most common.
- `fwe`: coded words with Zipf-like counts (the k-th most frequent appears about N / (k² ζ(2))
  times, the first being dots to ignore); asked for the three most frequent.

A prompt ends with a question; a completion prompt then opens the answer (`answer_prefix`), a chat
prompt leaves that to the model. Answers are scored by `string_match_all`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import string
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final

from pe_client.grid import GridError
from pe_client.haystack import Haystack

NIAH_INTRO = (
    "Some special magic numbers are hidden in the text below. Memorize them: "
    "you will be asked about one of them afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
VT_INTRO = "Keep track of the chain of variable assignments hidden in the text below.\n\n"
CWE_INTRO = "Below is a numbered list of words. Some of them appear more often than the others.\n"
FWE_INTRO = (
    "Below is a coded text. Keep count of how often each coded word appears; the dots '...' are not a word.\n"
)
FWE_DOTS = "..."
CWE_COMMON = 10
# cwe's repeats (common, rare) by length, as RULER: a short prompt cannot hold 30 of each.
CWE_REPEATS_SHORT = (6, 1)
CWE_REPEATS_LONG = (30, 3)
CWE_LONG_FROM = 4096
NIAH_NEEDLES = 4  # needles in niah_multikey, values in niah_multivalue
VT_VARIABLES = 5  # one chain of four hops
FWE_ANSWERS = 3
_ZETA_2 = math.pi**2 / 6
# fwe: from this many words on, the third answer always outnumbers the next word (its expected
# count exceeds the next one's by at least 1), so the three answers are the three most frequent.
FWE_MIN_WORDS = math.ceil(_ZETA_2 / (1 / (FWE_ANSWERS + 1) ** 2 - 1 / (FWE_ANSWERS + 2) ** 2))


@dataclass(frozen=True)
class TaskPrompt:
    """One sample's prompt in parts, and what a correct answer must contain.

    `shared_words`: for a task that hides items in the haystack, the haystack words before the
    first item; every prompt of the task opens with its intro and the same stream of words, so
    two of them share their text up to the lesser of their `shared_words`. None for a task whose
    whole text is drawn per sample (it shares only its intro)."""

    text: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    shared_words: int | None = None

    @property
    def completion_text(self) -> str:
        """The prompt for a base model: the answer is opened for it."""
        return f"{self.text}\n{self.question}\n{self.answer_prefix}"

    @property
    def chat_text(self) -> str:
        """The user's message for a chat model, which writes its own preamble."""
        return f"{self.text}\n{self.question}"


@dataclass(frozen=True)
class Recipe:
    """A sample whose random parts are drawn: `build(size)` for any size from `min_size` up."""

    min_size: int
    build: Callable[[int], TaskPrompt]


def check_tasks(tasks: Sequence[str]) -> list[str]:
    """The tasks in order, each once; GridError names an unknown one."""
    if not tasks:
        raise GridError("no task given")
    for task in tasks:
        if task not in TASKS:
            raise GridError(f"unknown task {task!r} (known: {', '.join(TASKS)})")
    return list(dict.fromkeys(tasks))


def recipe(task: str, *, seed: int, length: int, index: int, haystack: Haystack) -> Recipe:
    """Sample `index` of `task` (one of `TASKS`) at `length`: its own seed, so adding tasks or
    lengths to a grid leaves the other samples as they were."""
    return _FAMILIES[task].recipe(f"{seed}:{task}:{length}:{index}", length, haystack)


def answer_tokens(task: str) -> int:
    """Greedy tokens allowed for `task`'s answer."""
    return _FAMILIES[task].answer_tokens


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """RULER's metric for one sample: the share of the expected answers found in the output,
    ignoring case (1.0 when every answer is there, in any order and among any other text)."""
    found = output.lower()
    return sum(answer.lower() in found for answer in answers) / len(answers)


class _Words:
    """Distinct words drawn one by one from a seed, so the first n are the same for any later n."""

    def __init__(self, seed: str, make: Callable[[random.Random], str]) -> None:
        self._draw = random.Random(seed)
        self._make = make
        self._words: list[str] = []
        self._seen: set[str] = set()

    def first(self, count: int) -> list[str]:
        while len(self._words) < count:
            word = self._make(self._draw)
            if word not in self._seen:
                self._seen.add(word)
                self._words.append(word)
        return self._words[:count]


def _pseudo_word(draw: random.Random) -> str:
    """Three consonant-vowel syllables ("kotami"): pronounceable, about 340,000 of them, and none
    a substring of another, so finding one in an answer never counts another."""
    return "".join(draw.choice("bdfgklmnprstvz") + draw.choice("aeiou") for _ in range(3))


def _coded_word(draw: random.Random) -> str:
    return "".join(draw.choices(string.ascii_lowercase, k=6))


def _variable_name(draw: random.Random) -> str:
    return "".join(draw.choices(string.ascii_uppercase, k=5))


def _niah(seed: str, haystack: Haystack, *, keys: int, values_per_key: int) -> Recipe:
    draw = random.Random(seed)
    names = _Words(f"{seed}:keys", _pseudo_word).first(keys)
    values = draw.sample(range(1_000_000, 10_000_000), keys * values_per_key)
    needles = [(names[order // values_per_key], value) for order, value in enumerate(values)]
    hidden = [(draw.random(), NEEDLE.format(key=key, value=value)) for key, value in needles]
    asked = names[0]
    answers = tuple(str(value) for key, value in needles if key == asked)
    if len(answers) == 1:
        question = f"What is the special magic number for {asked} mentioned in the text above?"
        prefix = f"The special magic number for {asked} mentioned in the text is"
    else:
        question = f"What are all the special magic numbers for {asked} mentioned in the text above?"
        prefix = f"The special magic numbers for {asked} mentioned in the text are"
    return _hidden_in(haystack, NIAH_INTRO, hidden, question, prefix, answers)


def _variable_tracking(seed: str, haystack: Haystack) -> Recipe:
    draw = random.Random(seed)
    names = _Words(f"{seed}:variables", _variable_name).first(VT_VARIABLES)
    value = draw.randrange(10_000, 100_000)
    chain = [f"VAR {names[0]} = {value}."] + [
        f"VAR {name} = VAR {previous}." for previous, name in itertools.pairwise(names)
    ]
    # Sorted depths keep the chain in order: each assignment follows the one it copies.
    hidden = list(zip(sorted(draw.random() for _ in chain), chain, strict=True))
    question = f"Which variables are assigned the value {value} in the text above? Name all of them."
    prefix = f"The {len(names)} variables assigned the value {value} are:"
    return _hidden_in(haystack, VT_INTRO, hidden, question, prefix, tuple(names))


def _hidden_in(
    haystack: Haystack,
    intro: str,
    hidden: Sequence[tuple[float, str]],
    question: str,
    prefix: str,
    answers: tuple[str, ...],
) -> Recipe:
    """A recipe whose size is the haystack's words, `hidden` at their depths."""
    depths = [depth for depth, _ in hidden]

    def build(size: int) -> TaskPrompt:
        text = intro + haystack.hide(size, hidden)
        return TaskPrompt(text, question, prefix, answers, shared_words=haystack.words_before(size, depths))

    return Recipe(min_size=0, build=build)


def _common_words(seed: str, repeats: tuple[int, int]) -> Recipe:
    """Size: the number of rare words; the ten common ones are there from size 0."""
    words = _Words(f"{seed}:words", _pseudo_word)
    common_repeats, rare_repeats = repeats
    question = f"What are the {CWE_COMMON} most common words in the list above?"
    prefix = f"The {CWE_COMMON} most common words in the list are:"

    def build(size: int) -> TaskPrompt:
        drawn = words.first(CWE_COMMON + size)
        common, rare = drawn[:CWE_COMMON], drawn[CWE_COMMON:]
        entries = common * common_repeats + rare * rare_repeats
        random.Random(f"{seed}:{size}").shuffle(entries)
        listing = "\n".join(f"{number}. {word}" for number, word in enumerate(entries, 1))
        return TaskPrompt(CWE_INTRO + listing, question, prefix, tuple(common))

    return Recipe(min_size=0, build=build)


def _frequent_words(seed: str) -> Recipe:
    """Size: the number of words N the counts are drawn for (the text has about N words)."""
    words = _Words(f"{seed}:coded", _coded_word)
    question = (
        f"Ignoring the dots, which {FWE_ANSWERS} coded words appear most often in the coded text above?"
    )
    prefix = f"The {FWE_ANSWERS} most frequent coded words are:"

    def build(size: int) -> TaskPrompt:
        counts: list[int] = []
        while (count := int(size / ((len(counts) + 1) ** 2 * _ZETA_2))) > 0:
            counts.append(count)
        vocabulary = [FWE_DOTS, *words.first(len(counts) - 1)]
        text = [word for word, count in zip(vocabulary, counts, strict=True) for _ in range(count)]
        random.Random(f"{seed}:{size}").shuffle(text)
        return TaskPrompt(
            FWE_INTRO + " ".join(text), question, prefix, tuple(vocabulary[1 : FWE_ANSWERS + 1])
        )

    return Recipe(min_size=FWE_MIN_WORDS, build=build)


@dataclass(frozen=True)
class _Family:
    """How a task's samples are drawn, and the greedy tokens its answer may take: room for the
    answers and a short preamble in any tokenizer (a byte-level one spells ten pseudo-words in
    about 80)."""

    answer_tokens: int
    recipe: Callable[[str, int, Haystack], Recipe]


_FAMILIES: Final = {
    "niah_single": _Family(48, lambda seed, _, haystack: _niah(seed, haystack, keys=1, values_per_key=1)),
    "niah_multikey": _Family(
        48, lambda seed, _, haystack: _niah(seed, haystack, keys=NIAH_NEEDLES, values_per_key=1)
    ),
    "niah_multivalue": _Family(
        96, lambda seed, _, haystack: _niah(seed, haystack, keys=1, values_per_key=NIAH_NEEDLES)
    ),
    "vt": _Family(48, lambda seed, _, haystack: _variable_tracking(seed, haystack)),
    "cwe": _Family(
        128,
        lambda seed, length, _: _common_words(
            seed, CWE_REPEATS_LONG if length >= CWE_LONG_FROM else CWE_REPEATS_SHORT
        ),
    ),
    "fwe": _Family(64, lambda seed, _, __: _frequent_words(seed)),
}
TASKS: Final = tuple(_FAMILIES)


@dataclass(frozen=True)
class Fitted:
    """A sample at the size fitted to its length: the prompt, its token ids, and tokens per unit
    of size (where the next sample of the same task and length starts looking)."""

    size: int
    prompt: TaskPrompt
    tokens: list[int]
    tokens_per_unit: float


async def fit(
    recipe: Recipe,
    measure: Callable[[TaskPrompt], Awaitable[list[int]]],
    budget: int,
    *,
    start: int = 0,
    tokens_per_unit: float = 1.0,
) -> Fitted:
    """The largest size whose prompt has at most `budget` tokens, as `measure` counts them.

    An interpolation search: each try aims at the budget from the tokens-per-unit rate of the last
    two tries, always inside the bracket of sizes known to fit and known not to, which shrinks on
    every try. Started from a previous sample's size and rate, it usually takes two tries (that
    size fits, one more unit does not). GridError when even `min_size` is over the budget.
    """
    fitting: Fitted | None = None
    too_big: int | None = None
    rate = tokens_per_unit
    previous: tuple[int, int] | None = None
    size = max(recipe.min_size, start)
    while True:
        prompt = recipe.build(size)
        tokens = await measure(prompt)
        # Sizes never repeat (each lies inside the shrinking bracket), so the slope is defined.
        if previous is not None and len(tokens) != previous[1]:
            rate = max(1e-3, (len(tokens) - previous[1]) / (size - previous[0]))
        previous = (size, len(tokens))
        if len(tokens) <= budget:
            fitting = Fitted(size, prompt, tokens, rate)
        elif size == recipe.min_size:
            raise GridError(f"its shortest prompt has {len(tokens)} tokens, over the {budget} it may have")
        else:
            too_big = size
        low = recipe.min_size if fitting is None else fitting.size + 1
        high = None if too_big is None else too_big - 1
        if fitting is not None and high is not None and high < low:
            return dataclasses.replace(fitting, tokens_per_unit=rate)
        aim = size + math.floor((budget - len(tokens)) / rate)
        size = max(low, aim if high is None else min(high, aim))
