"""`python -m service`: the same as the `pe-serve` command."""

from service.cli import main

main()
