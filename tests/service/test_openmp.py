"""Releasing a thread's OpenMP workers: the ones it started go, and parallel work still runs."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from service.model.kernels.openmp import release_thread_pool
from tests.kernels import torch_threads

TASKS = Path("/proc/self/task")


def thread_count() -> int:
    return len(list(TASKS.iterdir()))


@pytest.mark.skipif(not TASKS.exists(), reason="counts threads in /proc")
def test_a_thread_s_idle_openmp_workers_go_when_it_releases_them() -> None:
    counts: dict[str, int] = {}

    def work() -> None:
        torch.set_num_threads(2)  # this thread's: a pool of one worker besides itself
        torch.ones(10_000_000).exp_().sum()  # parallel: this thread's own pool of workers
        counts["with pool"] = thread_count()
        counts["released"] = int(release_thread_pool())
        deadline = time.monotonic() + 5.0
        while thread_count() >= counts["with pool"] and time.monotonic() < deadline:
            time.sleep(0.01)  # the workers leave on their own time
        counts["after"] = thread_count()
        counts["sum"] = int(torch.ones(10_000_000).sum())  # a pool again, on demand

    with torch_threads(torch.get_num_threads()):  # MKL's count is global: the helper's 2 is undone
        helper = threading.Thread(target=work)
        helper.start()
        helper.join()
    assert counts["released"] == 1
    assert counts["after"] <= counts["with pool"] - 1
    assert counts["sum"] == 10_000_000
