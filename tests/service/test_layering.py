"""The package boundaries the request core promises, checked on the source.

Transports are thin over `service.requests`: neither REST nor gRPC imports
the other, only `service.server` composes them, and one builder constructs
every engine generation request. These are facts about the import graph, so
the test reads the modules' syntax trees rather than trusting a docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parents[2] / "service"


def _modules(package: str) -> list[Path]:
    return sorted((SERVICE / package).rglob("*.py"))


def _imported(path: Path) -> set[str]:
    """Absolute module names a file imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(SERVICE.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("grpc_api", "service.api"),
        ("api", "service.grpc_api"),
        ("requests", "service.api"),
        ("requests", "service.grpc_api"),
    ],
)
def test_transport_does_not_import_the_other(package: str, forbidden: str) -> None:
    offenders = {
        f"{path.relative_to(SERVICE)} imports {name}"
        for path in _modules(package)
        for name in _imported(path)
        if name == forbidden or name.startswith(forbidden + ".")
    }
    assert not offenders, sorted(offenders)


def test_only_the_builder_constructs_generation_requests() -> None:
    constructors = [
        f"{path.relative_to(SERVICE)}:{node.lineno}"
        for path in sorted(SERVICE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "GenerationRequest"
    ]
    assert len(constructors) == 1, constructors
    assert constructors[0].startswith("requests/build.py:"), constructors


def test_the_grpc_server_is_imported_by_the_composer_only() -> None:
    importers = {
        str(path.relative_to(SERVICE))
        for path in sorted(SERVICE.rglob("*.py"))
        if not path.is_relative_to(SERVICE / "grpc_api")
        and any(name.startswith("service.grpc_api") for name in _imported(path))
    }
    assert importers == {"server.py"}, importers
