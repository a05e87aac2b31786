"""Layout planner: which parallel layouts (pp, dp_replicate, dp_shard, cp, tp, microbatches,
activation checkpointing) divide a model and fit a GPU, with predicted memory, step time and MFU,
and a full-size dry run of one layout on torch's fake process group.

  python -m common.plan --help

models.py   parameter tables, FLOPs and saved activations from a model's sizes
layout.py   one layout priced: bytes per rank, collectives, step time
search.py   enumeration and ranking
source.py   the model from a pipeline config (spec loaded by name) or a preset
dry_run.py  the real mesh and the real parallelize on a meta-device model, rank by rank
"""
