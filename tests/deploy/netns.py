"""Run part of a test inside a private network namespace that has only a loopback interface.

Ray Serve (2.60) starts each replica's inter-deployment gRPC server on `[::]:0`, with no setting
to change it, so a local Ray would otherwise listen on every interface of the machine. Inside a
namespace of its own with nothing but `lo`, whatever Ray binds is reachable from this machine's
loopback only. The calling thread (pytest's main thread) enters the namespace; processes and
threads it starts inherit it; on exit the thread returns to its original namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

_CLONE_NEWNET = 0x40000000


def available() -> bool:
    """Root (CAP_SYS_ADMIN) and iproute2 are needed to make the namespace and bring `lo` up."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def interfaces() -> set[str]:
    """The network interfaces the calling process sees."""
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return {line.split(":", 1)[0].strip() for line in lines}


def _call(function: str, *args: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, function)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{function}: {os.strerror(errno)}")


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _call("unshare", _CLONE_NEWNET)
        try:
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
            yield
        finally:
            _call("setns", original, _CLONE_NEWNET)
    finally:
        os.close(original)
