"""The C kernels' tests a second time, with the kernels built under AddressSanitizer and UBSan.

ASan's runtime must be the first library a process loads, so the pass runs as a pytest of its
own, with the compiler's `libasan` preloaded and `PE_SERVE_KERNEL_SANITIZE` telling the kernel
loader to build (and cache apart) sanitized libraries. Any out-of-bounds access or undefined
behaviour aborts that process with the sanitizer's report, which the assertion shows. The pass
includes the cases that feed block ids past the pool, which must be refused with a Python error
before C runs; and, run only inside it, the checks that the sanitizers are really loaded and
that they do catch the C kernel reading past its pool when called without the binding's checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.model.kernels import build, paged_attention
from tests.kernels import require_kernel

REPO_ROOT = Path(__file__).resolve().parents[2]
SANITIZERS = "address,undefined"
# The kernels' own tests, and the C step's (the batch pass) beside the eager pass.
SANITIZED_TESTS = (
    "tests/service/test_packed_linear_kernel.py",
    "tests/service/test_paged_attention_kernel.py",
    "tests/service/test_logit_rows.py",
    "tests/service/test_kernels_sanitized.py",
    "tests/service/test_fast_decode.py::test_the_c_step_refuses_a_block_id_past_its_pool_before_running",
    "tests/service/test_fast_decode.py::test_prompt_chunks_in_c_equal_the_eager_pass",
    "tests/service/test_fast_decode.py::test_long_prompt_chunks_attend_in_tiles_as_the_eager_pass",
    # The block's other ops in C: LayerNorm, GELU, parallel residuals, biases, q/k and embedding norms.
    *(
        f"tests/service/test_block_spec.py::test_the_fast_steps_run_every_block_as_the_eager_model[{case}-c-2-threads]"
        for case in (
            "neox-parallel-two-norms",
            "gptj-parallel-interleaved",
            "bloom-alibi-embedding-norm",
            "qwen3-qk-norm",
        )
    ),
    "tests/service/test_block_spec.py::test_the_c_step_runs_packed_blocks_as_the_eager_model[neox-parallel-two-norms-int4]",
)
# Every test of those files but a quarter of the products' grid (with a bias, on two threads: every
# format, shape and row count still), to keep the pass to a minute or two.
SUBSET = "not equals_f_linear or (bias and 2-threads)"
PASS_TIMEOUT_S = 900
in_sanitized_pass = pytest.mark.skipif(
    os.environ.get(build.SANITIZE_ENV) != SANITIZERS, reason="runs inside the sanitized pass only"
)


def asan_runtime() -> str | None:
    """The compiler's shared ASan runtime, if it is installed."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        return None
    found = subprocess.run(
        [compiler, "-print-file-name=libasan.so"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


@pytest.mark.slow
def test_the_kernel_tests_pass_with_address_and_undefined_sanitizers() -> None:
    if os.environ.get(build.SANITIZE_ENV):
        pytest.skip("this is the sanitized pass")
    runtime = asan_runtime()
    if runtime is None:
        pytest.skip("the compiler's ASan runtime (libasan) is not installed")
    env = {
        **os.environ,
        build.SANITIZE_ENV: SANITIZERS,
        "LD_PRELOAD": runtime,
        # Python itself leaks by design at exit; the kernels allocate nothing.
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }
    spawner = test_the_kernel_tests_pass_with_address_and_undefined_sanitizers.__name__
    this = f"{Path(__file__).relative_to(REPO_ROOT)}::{spawner}"
    command = [
        *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--deselect", this),
        *("-k", SUBSET, *SANITIZED_TESTS),
    ]
    finished = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=PASS_TIMEOUT_S, check=False
    )
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0, output[-6000:]
    assert "AddressSanitizer" not in output and "runtime error:" not in output, output[-6000:]
    assert " skipped" not in output.splitlines()[-1], output[-3000:]


@in_sanitized_pass
def test_the_sanitizers_are_loaded() -> None:
    require_kernel(paged_attention.available, "paged attention")
    maps = Path("/proc/self/maps").read_text()
    assert "libasan" in maps and "libubsan" in maps
    assert f"-fsanitize={SANITIZERS}" in build.flags()


@in_sanitized_pass
def test_the_sanitizer_catches_the_kernel_reading_past_its_pool_without_the_bindings_checks() -> None:
    """What the binding's checks prevent: the raw C call with a block id past the pool is an
    out-of-bounds read, and ASan stops that process with its report."""
    require_kernel(paged_attention.available, "paged attention")
    finished = subprocess.run(
        [sys.executable, "-c", f"from {__name__} import read_past_the_pool; read_past_the_pool()"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert finished.returncode != 0
    assert "AddressSanitizer" in finished.stderr, finished.stderr[-3000:]


def read_past_the_pool() -> None:
    """One row whose only block id is one past a pool of two blocks, straight into C."""
    heads, head_dim, num_blocks, block_size = 1, 16, 2, 4
    queries, new_keys, new_values = (torch.randn(1, heads, head_dim) for _ in range(3))
    key_pages, value_pages = (torch.zeros(heads, num_blocks, block_size, head_dim) for _ in range(2))
    block_table = torch.tensor([[num_blocks]], dtype=torch.int64)
    positions = torch.tensor([1], dtype=torch.int64)
    out, scores = torch.empty(1, heads, head_dim), torch.empty(block_size)
    arguments = {
        "queries": queries.data_ptr(),
        "new_keys": new_keys.data_ptr(),
        "new_values": new_values.data_ptr(),
        "key_pages": key_pages.data_ptr(),
        "value_pages": value_pages.data_ptr(),
        "block_table": block_table.data_ptr(),
        "positions": positions.data_ptr(),
        "bias": None,
        "masked": None,
        "out": out.data_ptr(),
        "scores": scores.data_ptr(),
        "query_row_stride": heads * head_dim,
        "key_row_stride": heads * head_dim,
        "value_row_stride": heads * head_dim,
        "batch": 1,
        "heads": heads,
        "kv_heads": heads,
        "head_dim": head_dim,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "blocks_per_row": 1,
        "scale": 1.0,
    }
    source = Path(paged_attention.__file__).with_name("paged_attention.c")
    build.use_threads(source, 1)
    build.kernel_function(source, "paged_decode_attention")(
        *build.ordered(source, "paged_decode_attention", arguments)
    )
