"""Train the whole zoo, one scheme after another: `python -m training.train_zoo`.

Sequential on purpose: the schemes share the same CPU cores, and running them side by side would
only make each slower and their timings incomparable.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from service.model.config import SCHEMES
from training.corpus import load_corpus
from training.recipe import ZOO_SCHEMES
from training.train import add_recipe_overrides, configure_torch, hyperparameters_from, train


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    # Any scheme may be trained into the zoo's layout; the default is the bundled members.
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(ZOO_SCHEMES))
    add_recipe_overrides(parser)
    args = parser.parse_args(argv)
    configure_torch(args.threads)
    corpus = load_corpus()
    for scheme in args.schemes:
        out_dir = args.models_dir / f"zoo-{scheme}"
        record = train(scheme, out_dir, hyperparameters_from(args), corpus)
        print(json.dumps(asdict(record)), flush=True)


if __name__ == "__main__":
    main()
