"""Building the C kernels: the compiler's errors surface, a built library is reused, and a cache
directory owned by someone else is never loaded from."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from service.model.kernels import build

SOURCES = sorted(Path(build.__file__).parent.glob("*.c"))


def test_every_kernel_source_is_found() -> None:
    stems = {source.stem for source in SOURCES}
    assert stems == {"batch_pass", "logit_rows", "packed_linear", "paged_attention"}


def test_a_compiler_that_fails_is_reported_with_its_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'no such target' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(subprocess.SubprocessError, match="no such target"):
        build.built_library(SOURCES[0])
    build.kernel_function.cache_clear()
    try:  # the caller falls back to its torch path
        assert build.kernel_function(SOURCES[0], "packed_linear") is None
    finally:
        build.kernel_function.cache_clear()


@pytest.mark.parametrize("source", SOURCES, ids=[source.stem for source in SOURCES])
def test_the_built_library_is_reused(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    first = build.built_library(source)
    built = first.stat().st_mtime_ns
    assert build.built_library(source) == first and first.stat().st_mtime_ns == built
    assert first.parent == tmp_path / "pe_serve_kernels" and first.name.startswith(source.stem)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_cache_directory_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    (tmp_path / "pe_serve_kernels").mkdir()
    os.chown(tmp_path / "pe_serve_kernels", 12345, 12345)
    with pytest.raises(OSError, match="another user"):
        build.built_library(SOURCES[0])


def test_an_edited_neighbour_builds_a_new_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sources and headers a source may include are part of its key: a stale library is never
    loaded."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    sources = tmp_path / "src"
    sources.mkdir()
    for path in Path(build.__file__).parent.glob("*.[ch]"):
        (sources / path.name).write_bytes(path.read_bytes())
    built = [build.built_library(sources / "batch_pass.c")]
    for neighbour in ("vec16.h", "paged_attention.c"):
        (sources / neighbour).write_text((sources / neighbour).read_text() + "\n/* edited */\n")
        built.append(build.built_library(sources / "batch_pass.c"))
    assert len(set(built)) == 3 and all(library.exists() for library in built)


def test_a_signature_is_read_from_its_c_definition() -> None:
    """The bindings take their ctypes types from C: pointers, int64_t and float, by name."""
    source = Path(build.__file__).with_name("batch_pass.c")
    result, parameters = build.c_signature(source, "batch_pass")
    names = [name for name, _ in parameters]
    assert result is None and len(names) == len(set(names))
    assert dict(parameters)["layers"] is ctypes.c_void_p
    assert dict(parameters)["blocks_per_row"] is ctypes.c_int64
    assert dict(parameters)["eps"] is ctypes.c_float
    assert build.c_signature(source, "batch_pass_workspace")[0] is ctypes.c_int64
    shuffled = {name: position for position, name in reversed(list(enumerate(names)))}
    assert build.ordered(source, "batch_pass", shuffled) == list(range(len(names)))


def test_arguments_by_name_must_be_exactly_the_parameters() -> None:
    source = Path(build.__file__).with_name("batch_pass.c")
    names = [name for name, _ in build.c_signature(source, "batch_pass")[1]]
    arguments = dict.fromkeys(names, 0)
    with pytest.raises(TypeError, match="missing \\['eps'\\]"):
        build.ordered(source, "batch_pass", {name: 0 for name in names if name != "eps"})
    with pytest.raises(TypeError, match="unknown \\['epsilon'\\]"):
        build.ordered(source, "batch_pass", {**arguments, "epsilon": 0})
    with pytest.raises(LookupError):
        build.c_signature(source, "no_such_kernel")
