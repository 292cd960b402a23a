"""What the lab's long benchmarks say about a run as it goes: timestamped progress on stderr, and
the revision of the checkout they measure (for the report's "Run at" line)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    """One progress line, stamped with the UTC time (a run takes minutes to hours)."""
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def revision() -> str:
    """The checkout's short revision; `BENCH_COMMIT` names it for a copy outside git (`git archive`)."""
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return run.stdout.strip() or os.environ.get("BENCH_COMMIT", "unknown")


def command_block(*commands: str, title: str = "Command:") -> list[str]:
    """A report's closing lines: the commands that made it, as one bash block to copy."""
    return [title, "", "```bash", *commands, "```", ""]
