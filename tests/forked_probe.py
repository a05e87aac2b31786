"""A module the forked-run tests start as `python -m tests.forked_probe ACTION` (tests/forked_runs.py)."""
import os
import sys
import time

if __name__ == "__main__":
    action = sys.argv[1]
    print(f"argv={sys.argv[1:]} rank={os.environ.get('RANK', '-')} cwd={os.getcwd()}")
    print(f"probe-err rank={os.environ.get('RANK', '-')}", file=sys.stderr)
    if action == "leak":  # what one run changes must not reach the next
        os.environ["FORKED_PROBE_LEAK"] = "1"
        sys.modules["forked_probe_leak"] = sys
    elif action == "look":
        print(f"leaked_env={'FORKED_PROBE_LEAK' in os.environ} leaked_module={'forked_probe_leak' in sys.modules}")
    elif action == "fail-rank1":  # rank 1 fails at once, rank 0 would wait for it forever
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(600)
    elif action == "loader-workers":  # whose children a DataLoader's workers are
        import torch.utils.data as tud

        class Parents(tud.IterableDataset):
            def __iter__(self):
                yield os.getppid()

        parents = set(int(p) for p in tud.DataLoader(Parents(), batch_size=None, num_workers=2))
        print(f"workers_are_children={parents == {os.getpid()}}")
    elif action == "rendezvous":  # rank 0 hosts the store on MASTER_PORT
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        print(f"port={os.environ['MASTER_PORT']}")
        dist.destroy_process_group()
    elif action == "raise":
        raise RuntimeError("probe failed")
    elif action == "sleep":
        time.sleep(600)
