"""`bench.ruler`'s checks on a dump: they must catch what they claim to check."""

from __future__ import annotations

from typing import Any

from pe_client.ruler import RulerSample

from bench.ruler import check_dump


def sample(prompt: str, answers: list[str], output: str, tokens: int = 950) -> RulerSample:
    return RulerSample.model_validate(
        {
            "task": "niah_single",
            "length": 1000,
            "scaling": {"type": "none"},
            "prompt": prompt,
            "prompt_tokens": tokens,
            "answers": answers,
            "output": output,
        }
    )


def result(score: float, samples: int = 2) -> dict[str, Any]:
    cell = {"task": "niah_single", "length": 1000, "scaling": {"type": "none"}, "samples": samples}
    return {"cells": [{**cell, "score": score}]}


def test_a_faithful_dump_passes() -> None:
    samples = [sample("the key is 123", ["123"], "123"), sample("the key is 456", ["456"], "789")]
    checks = check_dump(result(0.5), samples)
    assert checks["answers_not_in_prompt"] == []
    assert checks["prompts_off_size"] == []
    assert checks["cells_not_matching_dump"] == []
    assert (checks["fill_min"], checks["fill_max"]) == (0.95, 0.95)


def test_each_check_catches_its_fault() -> None:
    samples = [
        sample("the key is 123", ["999"], "999"),
        sample("the key is 456", ["456"], "456", tokens=1001),
    ]
    checks = check_dump(result(0.5), samples)
    assert checks["answers_not_in_prompt"] == [0]
    assert checks["prompts_off_size"] == [1]
    assert len(checks["cells_not_matching_dump"]) == 1  # both answered: the mean is 1.0, not 0.5
    assert len(check_dump(result(1.0, samples=3), samples)["cells_not_matching_dump"]) == 1
