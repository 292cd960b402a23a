"""`bench.ruler`'s checks on a dump: they must catch what they claim to check."""

from __future__ import annotations

from typing import Any

from pe_client.ruler import RulerSample

from bench.ruler import check_dump, group_lengths, render_report


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


def group(
    name: str, lengths: list[int], scores: dict[tuple[str, int], float], **extra: Any
) -> dict[str, Any]:
    cells = [
        {
            "task": task,
            "length": length,
            "scaling": {"type": name},
            "attention": None,
            "samples": 10,
            "score": score,
        }
        for (task, length), score in scores.items()
    ]
    checks = {"samples": 10 * len(cells), "answers_not_in_prompt": [], "fill_min": 0.99, "fill_max": 1.0}
    checks |= {"prompts_off_size": [], "cells": len(cells), "cells_not_matching_dump": []}
    return {
        "configurations": [name],
        "command": f"pe-client ruler --scaling {name}",
        "wall_s": 60.0,
        "result": {"model": "m", "cells": cells},
        "checks": checks,
        **({"lengths": lengths} if lengths else {}),
        **extra,
    }


def test_the_report_merges_a_configuration_s_lengths_from_every_call() -> None:
    """A configuration measured in two calls (4k, then 8k added by `--resume`) is one row; a cell
    measured again is the later call's; a call is known done by its configurations and lengths."""
    record: dict[str, Any] = {
        "run": {"machine": "x86_64, 2 cores", "server_flags": "--max-context 16384"},
        "groups": [
            group("none", [], {("vt", 4096): 0.1, ("cwe", 4096): 0.2}),  # a record without lengths
            group("none", [8192], {("vt", 8192): 0.3}, commit="abc1234", finished="2026-12-06 03:00 UTC"),
            group("yarn", [4096], {("vt", 4096): 0.5}),
            group("yarn", [4096], {("vt", 4096): 0.6}),
        ],
    }
    assert [group_lengths(g) for g in record["groups"]] == [[4096], [8192], [4096], [4096]]
    report = render_report(record)
    assert "| configuration | task | 4096 | 8192 |" in report
    assert "| none | vt | 10% (10) | 30% (10) |" in report
    assert "| none | cwe | 20% (10) | — |" in report
    assert "| yarn | vt | 60% (10) | — |" in report and "50%" not in report
    assert "**none** at 8192: 1.0 min, at `abc1234`, 2026-12-06 03:00 UTC" in report
    assert "**none** at 4096: 1.0 min, commit not recorded" in report
