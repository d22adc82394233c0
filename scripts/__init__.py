"""Developer scripts the Makefile runs (not part of the installed package): the demo trace generator."""
