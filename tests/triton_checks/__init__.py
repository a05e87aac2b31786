"""Kernel numerics checkers, run as child processes by the kernel tests."""
import os

# The tests run the checkers on fixed inputs so a CI result is reproducible; MMP_CHECK_SEED=random
# draws fresh ones (the seed is printed with every failure) when hunting for edge cases.
_seed = os.environ.get("MMP_CHECK_SEED", "0")
CHECK_SEED_ARGS = [] if _seed == "random" else ["--seed", _seed]
