"""RULER's task generators, its metric and the fitting of a prompt to a length, without a server.

A byte count stands in for the tokenizer here; the live tests fit with the server's own.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
from pe_client.grid import GridError
from pe_client.haystack import NOISE, NOISE_SENTENCES, Haystack, noise_lines
from pe_client.ruler_tasks import (
    CWE_COMMON,
    CWE_REPEATS_LONG,
    CWE_REPEATS_SHORT,
    FWE_DOTS,
    FWE_MIN_WORDS,
    NEEDLE,
    NIAH_INTRO,
    TASKS,
    VT_INTRO,
    TaskPrompt,
    check_tasks,
    fit,
    recipe,
    string_match_all,
)

ESSAY = (
    "It was a bright cold day in April. The clocks were striking thirteen! Who could say? "
    "Nobody in the square looked up from the long lines, and the wind kept on.\n"
)
HAYSTACKS = {"noise": Haystack(NOISE), "essay": Haystack(ESSAY)}


def byte_tokens(prompt: TaskPrompt) -> list[int]:
    return list(prompt.completion_text.encode())


async def measure(prompt: TaskPrompt) -> list[int]:
    return byte_tokens(prompt)


def build(task: str, size: int, *, seed: int = 0, length: int = 2048, index: int = 0) -> TaskPrompt:
    sample = recipe(task, seed=seed, length=length, index=index, haystack=HAYSTACKS["noise"])
    return sample.build(max(size, sample.min_size))


@pytest.mark.parametrize("haystack", sorted(HAYSTACKS))
@pytest.mark.parametrize("task", TASKS)
def test_every_answer_is_in_its_prompt(task: str, haystack: str) -> None:
    for index in range(5):
        sample = recipe(task, seed=7, length=4096, index=index, haystack=HAYSTACKS[haystack])
        for size in (sample.min_size, sample.min_size + 1, sample.min_size + 37, sample.min_size + 400):
            prompt = sample.build(size)
            assert prompt.answers
            assert len(set(prompt.answers)) == len(prompt.answers)
            for answer in prompt.answers:
                assert answer in prompt.text, (task, size, answer)


@pytest.mark.parametrize("haystack", sorted(HAYSTACKS))
@pytest.mark.parametrize("task", TASKS)
def test_shared_words_are_the_haystack_before_the_first_item(task: str, haystack: str) -> None:
    """What the client's chains rely on: a needle or variable prompt is its task's intro, then the
    haystack's first `shared_words` words, then an item, whatever the sample and size; a task
    drawn whole per sample says it shares nothing."""
    stream = HAYSTACKS[haystack]
    intro = {"vt": VT_INTRO}.get(task, NIAH_INTRO)
    item = "VAR " if task == "vt" else "One of the special magic numbers"
    for index in range(4):
        sample = recipe(task, seed=5, length=4096, index=index, haystack=stream)
        for size in (sample.min_size + 60, sample.min_size + 300):
            prompt = sample.build(size)
            if task in ("cwe", "fwe"):
                assert prompt.shared_words is None
                continue
            assert prompt.shared_words is not None and 0 <= prompt.shared_words <= size
            opening = intro + stream.hide(prompt.shared_words, [])
            assert prompt.text.startswith(opening + item), (task, prompt.text[len(opening) :][:40])


@pytest.mark.parametrize("task", TASKS)
def test_samples_are_fixed_by_the_seed_and_their_place(task: str) -> None:
    assert build(task, 300) == build(task, 300)
    assert build(task, 300).completion_text != build(task, 300, seed=1).completion_text
    assert build(task, 300).completion_text != build(task, 300, index=1).completion_text
    # A sample's seed is its own: drawing other tasks' samples first (a larger grid) changes nothing.
    alone = build(task, 400, index=3)
    for other in TASKS:
        build(other, 400, index=3)
    assert build(task, 400, index=3) == alone


def test_niah_needles_keys_and_values() -> None:
    def needles(prompt: TaskPrompt) -> list[tuple[str, str]]:
        pattern = re.escape(NEEDLE).replace(r"\{key\}", r"(\w+)").replace(r"\{value\}", r"(\d+)")
        return re.findall(pattern, prompt.text)

    single = build("niah_single", 500)
    assert needles(single) == [(re.findall(r"number for (\w+)", single.question)[0], single.answers[0])]
    multikey = build("niah_multikey", 500)
    found = needles(multikey)
    assert len(found) == 4 and len({key for key, _ in found}) == 4
    asked = re.findall(r"number for (\w+)", multikey.question)[0]
    assert multikey.answers == tuple(value for key, value in found if key == asked)
    multivalue = build("niah_multivalue", 500)
    found = needles(multivalue)
    assert len(found) == 4 and len({key for key, _ in found}) == 1
    assert sorted(multivalue.answers) == sorted(value for _, value in found)
    assert all(len(value) == 7 for value in multivalue.answers)


def test_vt_is_one_chain_in_order() -> None:
    prompt = build("vt", 800)
    assignments = re.findall(r"VAR ([A-Z]{5}) = (VAR ([A-Z]{5})|\d+)\.", prompt.text)
    assert [name for name, _, _ in assignments] == list(prompt.answers)
    value = assignments[0][1]
    assert value.isdigit() and value in prompt.question
    for (previous, _, _), (_, _, source) in itertools.pairwise(assignments):
        assert source == previous  # each variable copies the one assigned just before it


@pytest.mark.parametrize(("length", "repeats"), [(2048, CWE_REPEATS_SHORT), (8192, CWE_REPEATS_LONG)])
def test_cwe_common_words_outnumber_the_rest(length: int, repeats: tuple[int, int]) -> None:
    prompt = build("cwe", 120, length=length)
    entries = re.findall(r"^(\d+)\. (\w+)$", prompt.text, re.MULTILINE)
    assert [int(number) for number, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(word for _, word in entries)
    common, rare = repeats
    assert len(prompt.answers) == CWE_COMMON
    assert {word: counts[word] for word in prompt.answers} == dict.fromkeys(prompt.answers, common)
    assert len(counts) == CWE_COMMON + 120
    assert all(count == rare for word, count in counts.items() if word not in prompt.answers)


@pytest.mark.parametrize("size", [FWE_MIN_WORDS, FWE_MIN_WORDS + 1, 200, 1000, 5000])
def test_fwe_answers_are_the_three_most_frequent_words(size: int) -> None:
    prompt = build("fwe", size)
    counts = Counter(prompt.text.split("\n", 1)[1].split())
    dots = counts.pop(FWE_DOTS)
    ranked = counts.most_common()
    assert dots > ranked[0][1]  # the dots are the most frequent "word", and are to be ignored
    assert tuple(word for word, _ in ranked[:3]) == prompt.answers
    assert ranked[2][1] > ranked[3][1]  # no tie with the fourth
    assert 0.8 * size <= sum(counts.values()) + dots <= size  # the counts are rounded down


def test_haystack_places_items_at_sentence_boundaries() -> None:
    haystack = Haystack(ESSAY)
    text = haystack.hide(60, [(1.0, "LAST"), (0.0, "FIRST"), (0.5, "MIDDLE"), (0.5, "AFTER")])
    assert text.startswith("FIRST It was")
    assert text.rstrip().endswith("LAST")
    assert "MIDDLE AFTER" in text  # one place, in the given order
    before = text[: text.index("MIDDLE")].rstrip()
    assert before.endswith((".", "!", "?"))
    # The stream repeats past the end of the text, and grows only at its end.
    assert haystack.hide(60, []).startswith(haystack.hide(59, []))
    assert haystack.hide(60, []).count("April") == 2


def test_noise_lines_differ_by_seed_and_grow_by_appending() -> None:
    assert noise_lines(1, 40) != noise_lines(2, 40)
    assert noise_lines(1, 40)[:10] == noise_lines(1, 10)
    for line in noise_lines(3, 20):
        assert line.endswith("\n")
        assert sorted(sentence.strip() for sentence in re.findall(r"[^.]+\.", line)) == sorted(
            NOISE_SENTENCES
        )


def test_string_match_all_is_the_share_of_answers_found_ignoring_case() -> None:
    assert string_match_all("The numbers are 123 and 456.", ["456", "123"]) == 1.0
    assert string_match_all("THE VARIABLES ARE ABCDE, xyzzy", ["abcde", "XYZZY", "QWERT", "POIUY"]) == 0.5
    assert string_match_all("", ["a"]) == 0.0
    assert string_match_all("1234567", ["123"]) == 1.0  # a substring counts, as in RULER


def test_check_tasks() -> None:
    assert check_tasks(["vt", "cwe", "vt"]) == ["vt", "cwe"]
    with pytest.raises(GridError, match="unknown task 'niah'"):
        check_tasks(["niah"])
    with pytest.raises(GridError, match="no task"):
        check_tasks([])


def counting(calls: list[int]) -> Callable[[TaskPrompt], Awaitable[list[int]]]:
    async def count(prompt: TaskPrompt) -> list[int]:
        calls.append(1)
        return byte_tokens(prompt)

    return count


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("budget", [1500, 6000])
def test_fit_finds_the_largest_prompt_within_the_budget(task: str, budget: int) -> None:
    async def fit_three() -> list[int]:
        calls: list[int] = []
        previous = None
        sizes = []
        for index in range(3):
            sample = recipe(task, seed=0, length=budget, index=index, haystack=HAYSTACKS["noise"])
            fitted = await fit(
                sample,
                counting(calls),
                budget,
                start=0 if previous is None else previous.size,
                tokens_per_unit=1.0 if previous is None else previous.tokens_per_unit,
            )
            assert fitted.tokens == byte_tokens(fitted.prompt)
            assert 0.9 * budget <= len(fitted.tokens) <= budget
            assert len(byte_tokens(sample.build(fitted.size + 1))) > budget
            sizes.append(fitted.size)
            previous = fitted
        assert len(calls) <= 20  # an interpolation search, not a walk
        return sizes

    assert asyncio.run(fit_three())


def test_fit_refuses_a_budget_below_the_shortest_prompt() -> None:
    sample = recipe("fwe", seed=0, length=100, index=0, haystack=HAYSTACKS["noise"])
    with pytest.raises(GridError, match="shortest prompt has"):
        asyncio.run(fit(sample, measure, 100))
