"""Fault-injection suite: the real train CLI under kills, torn saves, full disks, corrupt data,
non-finite steps, layout changes on resume and bad input (bench/faults.py runs the long version)."""
