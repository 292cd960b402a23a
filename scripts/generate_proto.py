"""Regenerate the protobuf message modules from `proto/`, or check that the committed ones match.

    python scripts/generate_proto.py           # rewrite the committed modules
    python scripts/generate_proto.py --check   # exit 1 if any differs from a fresh generation

The messages are generated twice from the one proto file, once for the server and once for the
SDK, because the SDK is its own distribution and must not import the server. Only the message
modules (`*_pb2.py` and their `.pyi` stubs) are generated: the service's method table is read
from the file's descriptor at run time, so no `*_pb2_grpc.py` (whose absolute imports would need
a top-level `pe_serve` package) is needed. The generator is the pinned `grpcio-tools` of the dev
extra, so the output is byte-for-byte reproducible.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO = Path("pe_serve/v1/pe_serve.proto")
TARGETS = (REPO_ROOT / "service/grpc_api", REPO_ROOT / "clients/python/pe_client/grpc")
SUFFIXES = ("_pb2.py", "_pb2.pyi")


def generate(out_dir: Path) -> dict[str, bytes]:
    """The generated files' names and contents, written under `out_dir` first."""
    status = protoc.main(
        [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            str(PROTO_ROOT / PROTO),
        ]
    )
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status}")
    stem = PROTO.with_suffix("").name
    return {stem + suffix: (out_dir / PROTO.parent / (stem + suffix)).read_bytes() for suffix in SUFFIXES}


def stale_files() -> list[Path]:
    """Committed modules that differ from a fresh generation (or are missing)."""
    with tempfile.TemporaryDirectory() as scratch:
        fresh = generate(Path(scratch))
    return [
        target / name
        for target in TARGETS
        for name, content in fresh.items()
        if not (target / name).is_file() or (target / name).read_bytes() != content
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"stale: {path.relative_to(REPO_ROOT)} (run python scripts/generate_proto.py)")
        return 1 if stale else 0
    with tempfile.TemporaryDirectory() as scratch:
        fresh = generate(Path(scratch))
    for target in TARGETS:
        for name, content in fresh.items():
            (target / name).write_bytes(content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
