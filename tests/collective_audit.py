"""The toy pipeline's training run with every torch.distributed collective our code calls
recorded by its caller (tests/test_pipeline_contract.py): `python -m tests.collective_audit ARGS`
under torchrun, the toy's train arguments. Each rank writes run.dir/collectives_rank<r>.json."""
import atexit
import json
import os
import sys

import torch.distributed as dist

NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor",
         "all_to_all_single", "reduce", "gather", "scatter")


def install(path: str) -> None:
    callers: dict[str, int] = {}

    def wrap(fn):
        def audited(*args, **kwargs):
            frame = sys._getframe(1)
            caller = f"{frame.f_globals.get('__name__')}:{frame.f_code.co_name}"
            callers[caller] = callers.get(caller, 0) + 1
            return fn(*args, **kwargs)
        return audited

    for name in NAMES:
        setattr(dist, name, wrap(getattr(dist, name)))

    def write():
        with open(path, "w") as f:
            json.dump(callers, f)
    atexit.register(write)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from toy_pipeline import SPEC

    from common import run
    from common.cli import run_cli
    run_dir = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("run.dir="))
    os.makedirs(run_dir, exist_ok=True)
    install(os.path.join(run_dir, f"collectives_rank{os.environ.get('RANK', '0')}.json"))
    run_cli(lambda a: run.train(SPEC, a), sys.argv[1:])
