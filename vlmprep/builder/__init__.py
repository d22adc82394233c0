"""The build: plan, run tasks in worker processes, journal, merge, and the executors that schedule tasks."""
