"""Kernel numerics checkers, run as child processes by the kernel tests."""
import os

# The checkers run on fixed inputs (seed 0, also their default) so a result is reproducible;
# MMP_CHECK_SEED=random draws fresh ones (the seed is printed with every failure) when hunting
# for edge cases.
CHECK_SEED_ARGS = ["--seed", os.environ.get("MMP_CHECK_SEED", "0")]
