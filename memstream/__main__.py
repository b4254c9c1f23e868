"""`python -m memstream` is the `memstream` command."""

from memstream.cli import main

main()
