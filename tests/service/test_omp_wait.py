"""The OpenMP spin bound (`service.omp_wait`): set for a process that imports `service`, before
torch, unless its environment chose a wait policy of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.omp_wait import SPIN_ROUNDS, WAIT_VARIABLES, bound_spin_wait

PROBE = "import service, os, sys; print(os.environ.get('GOMP_SPINCOUNT')); print('torch' in sys.modules)"


def spin_count_seen(extra: dict[str, str]) -> tuple[str, str]:
    """What a fresh interpreter that imports `service` has as GOMP_SPINCOUNT, and whether torch was
    already loaded when it was set."""
    environ = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    run = subprocess.run(
        [sys.executable, "-c", PROBE], env={**environ, **extra}, capture_output=True, text=True, check=True
    )
    count, torch_loaded = run.stdout.split()
    return count, torch_loaded


def test_a_process_importing_service_bounds_the_spin_before_torch_loads() -> None:
    assert spin_count_seen({}) == (str(SPIN_ROUNDS), "False")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [({"GOMP_SPINCOUNT": "5"}, "5"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "None")],
    ids=["own-spin-count", "own-wait-policy"],
)
def test_a_wait_policy_the_environment_chose_is_kept(extra: dict[str, str], expected: str) -> None:
    assert spin_count_seen(extra)[0] == expected


def test_bound_spin_wait_writes_only_an_environment_without_a_policy() -> None:
    empty: dict[str, str] = {}
    bound_spin_wait(empty)
    assert empty == {"GOMP_SPINCOUNT": str(SPIN_ROUNDS)}
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    bound_spin_wait(passive)
    assert passive == {"OMP_WAIT_POLICY": "PASSIVE"}
