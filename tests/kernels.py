"""Skipping a kernel test only where the kernels truly cannot build.

A kernel that fails to build is a warning at run time (the service keeps its torch path), so a
test that skipped on it would hide a broken C source. Without a compiler the tests skip; in CI
(`CI` set, as `.ci/run` does) with a compiler present they fail, naming the compiler.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator

import pytest
import torch


def require_kernel(available: Callable[[], bool], name: str) -> None:
    """Return if the kernel is loaded; else skip, or fail in CI where a C compiler is present."""
    if available():
        return
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if os.environ.get("CI") and compiler:
        pytest.fail(f"the {name} kernel did not build although {compiler} is here (the log says why)")
    pytest.skip(f"no C compiler builds the {name} kernel here")


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch (and so the C kernels, which follow it) on `threads` intra-op threads for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
