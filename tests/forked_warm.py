"""Imported by the tests' forkserver (tests/forked_runs.py) once, before it forks any run."""
from tests.forked_runs import warm_up

warm_up()
