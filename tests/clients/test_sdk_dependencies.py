"""The SDK stays a light client: httpx and pydantic only, never torch or the server's code."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement


def _requirements(extra: str | None) -> set[str]:
    """Names the distribution requires without extras (`extra=None`) or for one extra."""
    names = set()
    for spec in requires("pe-client") or []:
        requirement = Requirement(spec)
        marker = requirement.marker
        wanted = marker is None if extra is None else marker is not None and marker.evaluate({"extra": extra})
        if wanted:
            names.add(requirement.name)
    return names


def test_distribution_depends_on_httpx_and_pydantic_only() -> None:
    assert _requirements(None) == {"httpx", "pydantic"}


def test_the_grpc_extra_adds_grpc_and_protobuf_only() -> None:
    assert _requirements("grpc") == {"grpcio", "grpcio-health-checking", "protobuf"}


def test_the_plot_extra_adds_matplotlib_only() -> None:
    assert _requirements("plot") == {"matplotlib"}


def test_importing_the_sdk_its_cli_and_grpc_client_loads_neither_torch_nor_the_service() -> None:
    probe = (
        "import sys, pe_client, pe_client.cli, pe_client.grpc;"
        " print(sorted({m.split('.')[0] for m in sys.modules}))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "'torch'" not in loaded
    assert "'service'" not in loaded and "'pe_runtime'" not in loaded
    assert "'matplotlib'" not in loaded  # only a plot imports it (pe-client[plot])
