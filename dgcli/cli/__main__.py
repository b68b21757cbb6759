"""`python -m dgcli.cli`: dg, as the console script runs it."""

from dgcli.cli import main

main()
