"""The SDK stays a light client: httpx and pydantic only, never torch or the server's code."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement


def test_distribution_depends_on_httpx_and_pydantic_only() -> None:
    assert {Requirement(spec).name for spec in requires("pe-client") or []} == {"httpx", "pydantic"}


def test_importing_the_sdk_and_its_cli_loads_neither_torch_nor_the_service() -> None:
    probe = "import sys, pe_client, pe_client.cli; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "'torch'" not in loaded
    assert "'service'" not in loaded and "'pe_runtime'" not in loaded
