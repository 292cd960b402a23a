"""`make fuzz` runs schemathesis in rounds until a request count: the rounds add up to one result."""

from __future__ import annotations

from collections import Counter

from bench.fuzz import FuzzResult


def result(seconds: float, cases: int, statuses: dict[tuple[str, int], int], failures: int = 0) -> FuzzResult:
    return FuzzResult(
        command=["st", "run", f"--max-time={seconds:g}"],
        seconds=seconds,
        test_cases=cases,
        failures=[{"code": "ST000"}] * failures,
        errors=[],
        statuses=Counter(statuses),
    )


def test_rounds_add_their_counts_and_keep_every_failure() -> None:
    first = result(300, 100, {("/generate", 422): 90, ("/generate", 200): 10})
    second = result(120, 40, {("/generate", 422): 30, ("/score", 500): 1}, failures=1)
    total = first.then(second).then(result(5, 2, {("/models", 200): 2}))
    assert total.rounds == 3
    assert (total.seconds, total.test_cases, total.requests) == (425, 142, 133)
    assert total.statuses[("/generate", 422)] == 120
    assert total.server_errors == 1 and len(total.failures) == 1 and not total.clean
    assert total.command == first.command
    assert first.clean and first.rounds == 1
