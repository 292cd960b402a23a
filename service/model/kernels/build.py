"""Compiling the kernels' C sources for this machine, once, and loading them.

Each source is compiled at first use with the machine's C compiler for this CPU
(`-march=native`) and cached under a key of the source, flags and CPU, so a cold start (an empty
inductor cache) rebuilds them and a warm one only loads them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger("service.model.kernels")

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")


@functools.cache
def kernel_function(source: Path, name: str, argtypes: tuple[Any, ...]) -> Any:
    """The C function `name` of `source` (returning void), built and loaded once per process; None
    (with a warning) where no compiler builds it, so that the caller keeps its pure-torch path."""
    try:
        library = ctypes.CDLL(str(built_library(source)))
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("the %s kernel is unavailable, using the torch path: %s", source.stem, error)
        return None
    function = getattr(library, name)
    function.restype = None
    function.argtypes = list(argtypes)
    return function


def use_threads(source: Path, threads: int) -> None:
    """Run `source`'s parallel loops on `threads` OpenMP threads from now on (`threads.h`)."""
    function = kernel_function(source, "kernel_threads", (ctypes.c_int64,))
    if function is not None:
        function(threads)


def built_library(source: Path) -> Path:
    """The shared library for this source, flags and CPU, compiled once per machine.

    The key covers every source and header beside it, since a source may include the others.
    """
    compiler = os.environ.get("CC", "gcc")
    fingerprint = hashlib.sha256()
    for path in sorted(path for path in source.parent.iterdir() if path.suffix in (".c", ".h")):
        fingerprint.update(path.read_bytes())  # the source itself among them
    fingerprint.update(" ".join((compiler, *FLAGS)).encode())
    fingerprint.update(_cpu_description().encode())
    directory = _cache_directory()
    target = directory / f"{source.stem}-{fingerprint.hexdigest()[:16]}.so"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if directory.stat().st_uid != os.getuid():  # a library planted by another user would run as us
        raise OSError(f"{directory} belongs to another user; not loading a kernel from it")
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / target.name
        try:
            command = [compiler, *FLAGS, "-o", str(built), str(source)]
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        except subprocess.CalledProcessError as error:
            raise subprocess.SubprocessError(error.stderr.decode(errors="replace").strip()) from error
        os.replace(built, target)  # atomic: processes building at once each install a whole file
    return target


def _cache_directory() -> Path:
    """Beside inductor's cache, so that a cold start (an empty inductor cache) rebuilds this too."""
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor:
        return Path(inductor) / "pe_serve_kernels"
    return Path(tempfile.gettempdir()) / f"pe_serve_kernels_{os.getuid()}"


def _cpu_description() -> str:
    """The CPU's feature flags: a library built for one CPU's `-march=native` may fault on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return next((line for line in lines if line.startswith(("flags", "Features"))), os.uname().machine)
