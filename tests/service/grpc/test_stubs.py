"""The committed message modules are what the pinned grpcio-tools generates from the proto today."""

from __future__ import annotations

import subprocess
import sys

from tests.live_server import REPO_ROOT


def test_generated_modules_match_the_proto() -> None:
    check = [sys.executable, "scripts/generate_proto.py", "--check"]
    finished = subprocess.run(check, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stdout + finished.stderr
