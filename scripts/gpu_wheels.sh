#!/usr/bin/env bash
# The service's runtime packages that the lent GPU machine's image lacks (it has torch, transformers,
# pytest, httpx, numpy, jinja2, tokenizers, safetensors, prometheus-client), as Python 3.12 wheels
# in .gpu_wheels/ (git-ignored; not .whl/, the image build's wheelhouse), at this checkout's .venv
# versions. Run here, where the package registry answers; `scripts/gpu_check.sh` installs them
# there. About 12 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(
    fastapi starlette pydantic pydantic_core pydantic-settings annotated-types annotated-doc
    typing-inspection typing_extensions uvicorn httptools python-dotenv
    grpcio grpcio-health-checking grpcio-reflection protobuf
)
pinned=()
for package in "${packages[@]}"; do
    version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$package")
    pinned+=("$package==$version")
done
rm -rf .gpu_wheels
platforms=()
for platform in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$platform")
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .gpu_wheels "${pinned[@]}"
ls .gpu_wheels
