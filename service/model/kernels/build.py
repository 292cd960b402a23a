"""Compiling the kernels' C sources for this machine, once, and loading them.

Each source is compiled at first use with the machine's C compiler for this CPU
(`-march=native`) and cached under a key of the source, flags and CPU, so a cold start (an empty
inductor cache) rebuilds them and a warm one only loads them.

A kernel's signature is declared once, by its C definition: `kernel_function` reads the
parameters' names and types from it and sets the ctypes argument and result types from them, and
`ordered` puts arguments given by name in that order, so that a parameter added, removed or moved
in C cannot silently shift the others in a call.

`PE_SERVE_KERNEL_SANITIZE=address,undefined` builds (and caches apart) every kernel with those
sanitizers, for the test pass that runs them so (`tests/service/test_kernels_sanitized.py`); the
process must then have the ASan runtime preloaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger("service.model.kernels")

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")
SANITIZE_ENV = "PE_SERVE_KERNEL_SANITIZE"
# C types a kernel's parameters and result may have; every pointer passes as a void pointer.
_C_TYPES: dict[str, Any] = {
    "void": None,
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
_COMMENTS = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)


@functools.cache
def c_signature(source: Path, name: str) -> tuple[Any, tuple[tuple[str, Any], ...]]:
    """The ctypes result type and (name, ctypes type) parameters of the function `name` as
    `source` (or a header beside it) defines it."""
    texts = [path.read_text() for path in sorted(source.parent.iterdir()) if path.suffix in (".c", ".h")]
    pattern = re.compile(rf"^(\w+)\s+{re.escape(name)}\s*\(([^)]*)\)\s*\{{", re.MULTILINE)
    found = [match for text in texts for match in pattern.finditer(_COMMENTS.sub("", text))]
    if len(found) != 1:
        raise LookupError(f"{len(found)} definitions of {name} beside {source.name}, not one")
    result, parameters = found[0].groups()
    if parameters.strip() in ("", "void"):
        return _c_type(result), ()
    return _c_type(result), tuple(_parameter(text) for text in parameters.split(","))


def _parameter(declaration: str) -> tuple[str, Any]:
    words = declaration.replace("*", " * ").split()
    if "*" in words:
        return words[-1], ctypes.c_void_p
    return words[-1], _c_type(words[-2])


def _c_type(name: str) -> Any:
    if name not in _C_TYPES:
        raise TypeError(f"no ctypes type for the C type {name}")
    return _C_TYPES[name]


def ordered(source: Path, name: str, arguments: Mapping[str, Any]) -> list[Any]:
    """`arguments`, given by parameter name, in the order of `name`'s C definition; every
    parameter must be given, and nothing else."""
    names = [parameter for parameter, _ in c_signature(source, name)[1]]
    if set(arguments) != set(names):
        missing, unknown = set(names) - set(arguments), set(arguments) - set(names)
        raise TypeError(f"{name}: missing {sorted(missing)}, unknown {sorted(unknown)}")
    return [arguments[parameter] for parameter in names]


@functools.cache
def kernel_function(source: Path, name: str) -> Any:
    """The C function `name` of `source` with its C signature, built and loaded once per process;
    None (with a warning) where no compiler builds it, so that the caller keeps its torch path."""
    try:
        library = ctypes.CDLL(str(built_library(source)))
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("the %s kernel is unavailable, using the torch path: %s", source.stem, error)
        return None
    function = getattr(library, name)
    result, parameters = c_signature(source, name)
    function.restype = result
    function.argtypes = [ctype for _, ctype in parameters]
    return function


def use_threads(source: Path, threads: int) -> None:
    """Run `source`'s parallel loops on `threads` OpenMP threads from now on (`threads.h`)."""
    function = kernel_function(source, "kernel_threads")
    if function is not None:
        function(threads)


def flags() -> tuple[str, ...]:
    """`FLAGS`, or with the sanitizers `PE_SERVE_KERNEL_SANITIZE` names: then at -O1 with line
    tables and frame pointers, as ASan advises (and compiled in a third of -O3's time)."""
    sanitizers = os.environ.get(SANITIZE_ENV, "")
    if not sanitizers:
        return FLAGS
    base = tuple("-O1" if flag == "-O3" else flag for flag in FLAGS)
    return (*base, f"-fsanitize={sanitizers}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g1")


def built_library(source: Path) -> Path:
    """The shared library for this source, flags and CPU, compiled once per machine.

    The key covers every source and header beside it, since a source may include the others.
    """
    compiler = os.environ.get("CC", "gcc")
    fingerprint = hashlib.sha256()
    for path in sorted(path for path in source.parent.iterdir() if path.suffix in (".c", ".h")):
        fingerprint.update(path.read_bytes())  # the source itself among them
    fingerprint.update(" ".join((compiler, *flags())).encode())
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
            command = [compiler, *flags(), "-o", str(built), str(source)]
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
