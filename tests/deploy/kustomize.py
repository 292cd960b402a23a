"""Build a kustomization the way `kubectl kustomize` does, for the few features deploy/k8s uses.

CI machines of this project carry kubectl (its kustomize builds the manifests for real, and a test
checks this builder gives the same objects); this builder keeps the static checks running where
kubectl is missing. It knows exactly `resources` (files and directories), `images` and `patches`
whose patch is a JSON patch (RFC 6902) aimed at one kind and name, and refuses any other field,
so a manifest change that needs more fails loudly here instead of being built differently.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

Manifest = dict[str, Any]

_KNOWN_FIELDS = {"apiVersion", "kind", "resources", "images", "patches"}


def kubectl() -> str | None:
    """The kubectl binary on PATH, if any."""
    return shutil.which("kubectl")


def build_with_kubectl(directory: Path) -> list[Manifest]:
    """`kubectl kustomize DIR`, parsed."""
    binary = kubectl()
    if binary is None:
        raise FileNotFoundError("kubectl is not on PATH")
    output = subprocess.run([binary, "kustomize", str(directory)], check=True, capture_output=True, text=True)
    return [document for document in yaml.safe_load_all(output.stdout) if document]


def build(directory: Path) -> list[Manifest]:
    """The objects of the kustomization in `directory`: its resources, then images, then patches."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - _KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{directory}: kustomization fields this builder does not know: {sorted(unknown)}")
    resources = spec.get("resources", [])
    objects = [copy.deepcopy(item) for resource in resources for item in _load(directory / resource)]
    for image in spec.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    for patch in spec.get("patches", []):
        operations = yaml.safe_load((directory / patch["path"]).read_text()) if "path" in patch else None
        operations = operations if operations is not None else yaml.safe_load(patch["patch"])
        targets = [obj for obj in objects if _matches(obj, patch["target"])]
        if not targets:
            raise ValueError(f"{directory}: patch target {patch['target']} matches nothing")
        for obj in targets:
            for operation in operations:
                _apply(obj, operation)
    return objects


def build_overlay(directory: Path) -> list[Manifest]:
    """kubectl's build where kubectl exists (the real thing), else this module's."""
    return build_with_kubectl(directory) if kubectl() else build(directory)


def _load(path: Path) -> Iterator[Manifest]:
    if path.is_dir():
        yield from build(path)
        return
    yield from (document for document in yaml.safe_load_all(path.read_text()) if document)


def _matches(obj: Manifest, target: dict[str, str]) -> bool:
    return obj.get("kind") == target.get("kind", obj.get("kind")) and obj["metadata"]["name"] == target.get(
        "name", obj["metadata"]["name"]
    )


def _containers(obj: Manifest) -> Iterator[dict[str, Any]]:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    for key in ("initContainers", "containers"):
        yield from pod.get(key, [])


def _set_image(obj: Manifest, image: dict[str, str]) -> None:
    for container in _containers(obj):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            tag = image.get("newTag", tag)
            container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")


def _apply(obj: Manifest, operation: dict[str, Any]) -> None:
    """One RFC 6902 add, replace or remove (the ops the overlays use)."""
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    op = operation["op"]
    if op not in ("add", "replace", "remove"):
        raise ValueError(f"unsupported JSON patch op {op!r}")
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op == "add":
            node.insert(index, operation["value"])
        elif op == "replace":
            node[index] = operation["value"]
        else:
            del node[index]
    elif op == "remove":
        del node[last]
    else:
        if op == "replace" and last not in node:
            raise KeyError(f"replace of a missing member {operation['path']}")
        node[last] = operation["value"]
