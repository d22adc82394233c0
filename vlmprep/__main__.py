"""`python -m vlmprep`: the same command line as the installed `vlmprep` (vlmprep/cli.py)."""

from vlmprep.cli import main

main()
