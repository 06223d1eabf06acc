"""`python -m forerun ...`: the `forerun` command, where the console script is not on the PATH."""

from forerun.cli import main

main()
