"""The fault-injection suite's long version: every fault of tests/faults/ injected many times
into the real text2image train CLI (1-2 gloo ranks, fp32, CPU), then one table:

  fault | injected | survived | data lost | test

survived: the run went on (or stopped as it should, with one line) and what the test asserts held
each time: resumes bit-identical to the uninterrupted run (losses, gradient norms, model, AdamW
state and EMA by torch.equal), the previous checkpoint intact and the one used, exact skip
counts. data lost: samples trained a different number of times than in the uninterrupted run,
counted by key (MMP_FAULT_RECORD_KEYS), or steps whose result differs.

  python bench/faults.py [--kills 10] [--steps 24] [--only kill,sync_save,...] [--dir /tmp/faults_bench]
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.faults.harness import (checkpoint_state, corrupt_copy, events, latest, random_steps,  # noqa: E402
                                  same_losses, same_tensors, step_dir, tail, train, trained_keys)
from tests.conftest import read_metrics  # noqa: E402

REC = {"MMP_FAULT_RECORD_KEYS": "1"}
STEPS = [24]  # --steps


def keys_lost(ref: str, run: str) -> int:
    """Samples whose number of trainings differs from the reference run's (0: nothing lost or repeated)."""
    a = collections.Counter(k for ks in trained_keys(ref).values() for k in ks)
    b = collections.Counter(k for ks in trained_keys(run).values() for k in ks)
    return sum(abs(a[k] - b[k]) for k in set(a) | set(b))


def final_equal(ref: str, run: str, steps: int) -> bool:
    return same_losses(ref, run, range(1, steps + 1)) == [] and \
        same_tensors(checkpoint_state(step_dir(ref, steps)), checkpoint_state(step_dir(run, steps))) == []


def reference(work: str, data: str, steps: int, nproc: int) -> str:
    ref = os.path.join(work, f"ref{nproc}")
    if not os.path.isdir(ref):
        proc = train(ref, data, f"train.steps={steps}", nproc=nproc, fault_env=REC)
        assert proc.returncode == 0, tail(proc)
    return ref


def kills(work, data, n, steps, nproc) -> dict:
    """SIGKILL at n random steps (seeded), each attempt resuming the previous one."""
    ref = reference(work, data, steps, nproc)
    run = os.path.join(work, f"kill{nproc}")
    ok = 0
    for i, k in enumerate(random_steps(seed=16 + nproc, count=n, lo=2, hi=steps)):
        rank = i % nproc
        proc = train(run, data, f"train.steps={steps}", nproc=nproc,
                     fault_env={**REC, "MMP_FAULT_KILL_AT_STEP": str(k), "MMP_FAULT_KILL_RANK": str(rank)})
        resumed = [e["step"] for e in events(run, "resume")]
        expect_resume = (k - 1) // 2 * 2  # checkpoints every 2 steps
        ok += proc.returncode != 0 and f"killing rank {rank} at step {k}" in proc.stderr and \
            (not resumed or resumed[-1] < k) and (expect_resume == 0 or os.path.isdir(step_dir(run, expect_resume)))
    proc = train(run, data, f"train.steps={steps}", nproc=nproc, fault_env=REC)
    equal = proc.returncode == 0 and final_equal(ref, run, steps)
    return {"injected": n, "survived": ok if equal else 0, "lost": keys_lost(ref, run)}


def sync_save_kills(work, data, n, steps) -> dict:
    """SIGKILL between the shard writes and the rename of n different checkpoints; each next
    attempt must resume from the checkpoint before the torn one."""
    ref = reference(work, data, steps, 1)
    run = os.path.join(work, "sync_save")
    ok, expect, seen_resumes = 0, None, 0

    def resumed_as_expected() -> bool:
        nonlocal seen_resumes
        used = [e["checkpoint"] for e in events(run, "resume")]
        new, seen_resumes = used[seen_resumes:], len(used)
        return new == ([expect] if expect else [])

    for s in (2 * x for x in random_steps(seed=18, count=n, lo=2, hi=steps // 2)):
        proc = train(run, data, f"train.steps={steps}", fault_env={**REC, "MMP_FAULT_KILL_IN_SYNC_SAVE": str(s)})
        good = proc.returncode == -9 and (expect is None or resumed_as_expected())
        prev = s - 2
        good &= os.path.isdir(step_dir(run, s) + ".tmp") and not os.path.exists(step_dir(run, s))
        good &= latest(run) == os.path.basename(step_dir(run, prev)) and \
            same_tensors(checkpoint_state(step_dir(ref, prev)), checkpoint_state(step_dir(run, prev))) == []
        ok += good
        expect = step_dir(run, prev)
    proc = train(run, data, f"train.steps={steps}", fault_env=REC)
    ok -= not resumed_as_expected()  # the last torn save is judged by the final attempt's resume
    equal = proc.returncode == 0 and final_equal(ref, run, steps)
    return {"injected": n, "survived": ok if equal else 0, "lost": keys_lost(ref, run)}


def disk_full(work, data, n, steps) -> dict:
    ref = reference(work, data, steps, 1)
    run = os.path.join(work, "disk_full")
    ok = 0
    for s in random_steps(seed=19, count=n, lo=2, hi=steps // 2):
        s *= 2
        proc = train(run, data, f"train.steps={steps}", fault_env={**REC, "MMP_FAULT_SAVE_ERROR": str(s)})
        lines = proc.stderr.strip().splitlines()
        ok += proc.returncode == 2 and len(lines) == 1 and "No space left on device" in lines[0] and \
            latest(run) == os.path.basename(step_dir(run, s - 2)) and \
            same_tensors(checkpoint_state(step_dir(ref, s - 2)), checkpoint_state(step_dir(run, s - 2))) == []
    proc = train(run, data, f"train.steps={steps}", fault_env=REC)
    equal = proc.returncode == 0 and final_equal(ref, run, steps)
    return {"injected": n, "survived": ok if equal else 0, "lost": keys_lost(ref, run)}


def corrupt(work, data, epochs) -> dict:
    """~1% corrupt samples, `epochs` epochs, 1 process vs 2 ranks: counts exact and equal."""
    cdata = os.path.join(work, "corrupt_data")
    if not os.path.isdir(cdata):
        bad = corrupt_copy(data, cdata, every=100, seed=3)
    else:
        bad = corrupt_copy(data, cdata + "_again", every=100, seed=3)
    counts, seen = {}, {}
    for nproc in (1, 2):
        run = os.path.join(work, f"corrupt{nproc}")
        proc = train(run, cdata, f"train.steps={8 * epochs}", f"data.micro_batch_size={32 // nproc}",
                     "train.ckpt_every=1000", nproc=nproc, fault_env=REC)
        assert proc.returncode == 0, tail(proc)
        m = read_metrics(run)
        counts[nproc] = [m[s]["corrupt_samples"] for s in sorted(m)]
        seen[nproc] = collections.Counter(k for ks in trained_keys(run).values() for k in ks)
    injected = len(bad) * epochs
    exact = counts[1][-1] == injected and counts[1] == counts[2] and seen[1] == seen[2]
    trained_bad = sum(seen[1][k] for k in bad)
    return {"injected": injected, "survived": injected if exact and not trained_bad else 0,
            "lost": 256 - len(bad) - len(seen[1]), "note": f"{len(bad)} of 256 samples x {epochs} epochs"}


def non_finite(work, data) -> dict:
    """NaN/inf losses and gradients at 4 steps (never 2 in a row): skipped, every tensor untouched."""
    run = os.path.join(work, "nan")
    loss_at, grad_at = [3, 9], [6, 12]
    proc = train(run, data, "train.steps=14", "train.ckpt_every=1",
                 fault_env={"MMP_FAULT_NAN_LOSS_AT_STEP": ",".join(map(str, loss_at)),
                            "MMP_FAULT_NAN_GRAD_AT_STEP": ",".join(map(str, grad_at)), "MMP_FAULT_BAD_VALUE": "inf"})
    ok = 0
    if proc.returncode == 0:
        for s in loss_at + grad_at:
            ok += same_tensors(checkpoint_state(step_dir(run, s - 1)), checkpoint_state(step_dir(run, s))) == []
        ok *= read_metrics(run)[14]["skipped_steps"] == 4
    stop = train(os.path.join(work, "nan_stop"), data, "train.steps=14", "train.max_bad_steps=3",
                 fault_env={"MMP_FAULT_NAN_LOSS_AT_STEP": "4,5", "MMP_FAULT_NAN_GRAD_AT_STEP": "6"})
    lines = [x for x in stop.stderr.strip().splitlines() if "fault injection:" not in x]
    stopped = stop.returncode == 2 and len(lines) == 1 and "3 non-finite steps in a row" in lines[0]
    return {"injected": 4 + 3, "survived": ok + 3 * stopped, "lost": 0,
            "note": "4 skipped steps; 3 in a row stopped the run (max_bad_steps=3)"}


def layout_change(work, data) -> dict:
    ok, lost = 0, 0
    for before, after in ((1, 2), (2, 1)):
        run = os.path.join(work, f"layout{before}{after}")
        common = ["train.steps=16", "train.ckpt_every=4"]
        a = train(run, data, *common, f"data.micro_batch_size={32 // before}", "train.stop_after=9", nproc=before,
                  fault_env=REC)
        b = train(run, data, *common, f"data.micro_batch_size={32 // after}", nproc=after, fault_env=REC)
        count = collections.Counter(k for ks in trained_keys(run).values() for k in ks)
        lost += sum(abs(c - 2) for c in count.values()) + 2 * (256 - len(count))  # 2 epochs: each key twice
        ok += a.returncode == 0 and b.returncode == 0 and [e["step"] for e in events(run, "resume")] == [8]
    return {"injected": 2, "survived": ok if not lost else 0, "lost": lost, "note": "1 -> 2 and 2 -> 1 ranks"}


def bad_input(work, data) -> dict:
    """Every case of tests/faults/test_bad_input.py, in-process through the CLI wrapper as there
    (the tests also run some as real subprocesses)."""
    import contextlib
    import io
    import pathlib
    import random
    import tarfile

    from common.cli import run_cli
    from common.run import train as run_train
    from pipelines.text2image.spec import SPEC
    from tests.faults import test_bad_input as t
    d = pathlib.Path(work) / "bad"
    for sub in ("empty_dir", "empty_tar", "garbage_tar", "config_dir"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    tarfile.open(d / "empty_tar" / "shard-000000.tar", "w").close()
    (d / "garbage_tar" / "shard-000000.tar").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(5000)))
    (d / "bad_yaml").write_text("train:\n  steps: [1, 2\n")
    (d / "section_yaml").write_text("trainer:\n  steps: 3\n")
    (d / "list_yaml").write_text("- 1\n- 2\n")
    paths = {k: str(d / k) for k in ("empty_dir", "empty_tar", "garbage_tar", "bad_yaml", "section_yaml", "list_yaml",
                                   "config_dir")}
    paths["ref"] = step_dir(reference(work, data, STEPS[0], 1), STEPS[0])
    cases = [(c[0], t.argv_for(os.path.join(work, "bad_run"), data, t.fill(c[1], paths)), c[2]) for c in t.CASES]
    cases += [(c[0], t.argv_for(os.path.join(work, "bad_run"), data, [], config=c[1].format(**paths)), c[2])
              for c in t.CONFIG_CASES]
    ok, failed = 0, []
    for name, argv, words in cases:
        err, code = io.StringIO(), None
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                run_cli(lambda a: run_train(SPEC, a), argv)
            except SystemExit as e:
                code = e.code
            except BaseException as e:  # noqa: B036 - a traceback: counted as not surviving
                err.write(f"Traceback: {type(e).__name__}: {e}\n")
        lines = err.getvalue().strip().splitlines()
        good = code == 2 and len(lines) == 1 and "Traceback" not in err.getvalue() and \
            all(w in lines[0] for w in t.fill(words, paths))
        ok += good
        if not good:
            failed.append(name)
    return {"injected": len(cases), "survived": ok, "lost": 0,
            "note": f"{len(cases)} kinds" + (f"; not yet one line: {', '.join(failed)}" if failed else "")}


ROWS = [  # key, fault, test
    ("kill1", "kill -9 at random steps, 1 process", "tests/faults/test_kill.py::test_sigkill_at_random_steps_single_process"),
    ("sync_save", "kill -9 between shard writes and rename", "tests/faults/test_kill.py::test_sigkill_between_shard_writes_and_rename"),
    ("disk_full", "disk full (ENOSPC) during a save", "tests/faults/test_disk.py"),
    ("nan", "NaN/inf loss or gradient", "tests/faults/test_nan.py"),
    ("corrupt", "~1% corrupt samples, 1 vs 2 ranks", "tests/faults/test_data.py::test_corrupt_samples_counted_exactly_under_every_dp_layout"),
    ("layout", "DP degree changed on resume", "tests/faults/test_data.py::test_resume_under_another_dp_degree_repeats_and_skips_nothing"),
    ("bad_input", "bad configuration / input", "tests/faults/test_bad_input.py"),
    ("kill2", "kill -9 at random steps, 2-rank FSDP", "tests/faults/test_kill.py::test_sigkill_at_random_steps_two_rank_fsdp"),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=10, help="kills per kill scenario (default 10)")
    p.add_argument("--steps", type=int, default=24, help="steps of the killed runs (default 24)")
    p.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(r[0] for r in ROWS))
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    args = p.parse_args(argv)
    if args.steps < 2 * args.kills + 2:
        p.error("--steps must be >= 2 x --kills + 2 (distinct save steps for the torn-save kills)")
    os.environ["OMP_NUM_THREADS"] = "1"
    work = args.dir or tempfile.mkdtemp(prefix="faults_bench_")
    os.makedirs(work, exist_ok=True)
    from data.synth import generate
    data = os.path.join(work, "synth")
    if not os.path.isdir(data):
        generate(data, count=256, heldout_count=32, size=32, shard_size=32, seed=0)
    n, steps = args.kills, args.steps
    STEPS[0] = steps
    run = {"kill1": lambda: kills(work, data, n, steps, 1), "kill2": lambda: kills(work, data, n, steps, 2),
           "sync_save": lambda: sync_save_kills(work, data, n, steps),
           "disk_full": lambda: disk_full(work, data, 3, steps), "corrupt": lambda: corrupt(work, data, 2),
           "nan": lambda: non_finite(work, data), "layout": lambda: layout_change(work, data),
           "bad_input": lambda: bad_input(work, data)}
    only = [s for s in args.only.split(",") if s] or [r[0] for r in ROWS]
    results = []
    for key, fault, test in ROWS:
        if key not in only:
            continue
        t0 = time.monotonic()
        r = run[key]()
        r["s"] = time.monotonic() - t0
        results.append((fault, r, test))
        print(f"{fault}: {r}", flush=True)
    print()
    print("| fault | injected | survived | data lost | test | time |")
    print("|---|---|---|---|---|---|")
    for fault, r, test in results:
        note = f" ({r['note']})" if r.get("note") else ""
        print(f"| {fault}{note} | {r['injected']} | {r['survived']}/{r['injected']} | "
              f"{'none' if r['lost'] == 0 else r['lost']} | `{test}` | {r['s']:.0f} s |")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["survived"] == r["injected"] and r["lost"] == 0 for _, r, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
