"""train.save_on_signal's parsing and signal handling (common/stop_signals.py), in this process.
The trainer's use of it (a checkpoint at the step in flight, the exit code, the resume) is tested
end to end in tests/faults/test_signal.py."""
from __future__ import annotations

import os
import signal

import pytest

from common.config import ConfigError, build_config
from common.stop_signals import StopSignals, grace_message, grace_shortfall, parse_signals
from tests.conftest import ROOT


def test_parse_signals_accepts_names_with_or_without_sig_and_refuses_the_uncatchable():
    assert parse_signals("SIGTERM,usr1, SIGTERM") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("none") == () and parse_signals("") == ()
    for bad in ("SIGKILL", "SIGNOPE", "kill"):
        with pytest.raises(ValueError, match="not a signal a process can catch"):
            parse_signals(bad)


def test_grace_shortfall_counts_a_step_and_a_write_against_the_grace_period():
    assert grace_shortfall(step_s=10.0, write_s=19.9, grace_s=30.0) is None
    ev = grace_shortfall(step_s=10.0, write_s=25.0, grace_s=30.0)
    assert ev == {"event": "signal_grace", "needed_s": 35.0, "step_s": 10.0, "write_s": 25.0, "grace_s": 30.0}
    assert "up to 35 s (a step 10 s + a checkpoint write 25 s)" in grace_message(ev)
    assert "train.signal_grace_s=30" in grace_message(ev)
    assert grace_shortfall(step_s=1e6, write_s=1e6, grace_s=0.0) is None  # 0: no check


def test_config_refuses_an_unknown_signal():
    from pipelines.text2image.config import T2IConfig
    with pytest.raises(ConfigError, match="train.save_on_signal='SIGTERM,SIGFOO'"):
        build_config(T2IConfig, os.path.join(ROOT, "pipelines/text2image/configs/tiny.yaml"),
                     ["train.save_on_signal=SIGTERM,SIGFOO"])


def test_the_first_signal_is_recorded_later_ones_wait_too_and_close_gives_them_back():
    seen = []
    before = signal.signal(signal.SIGUSR1, lambda s, f: seen.append("usr1 handler"))
    before2 = signal.signal(signal.SIGUSR2, lambda s, f: seen.append("usr2 handler"))
    try:
        stop = StopSignals((signal.SIGUSR1, signal.SIGUSR2))
        assert stop.flag == 0.0 and stop.received is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1 and stop.flag == 1.0 and seen == []
        first_at = stop.received_at
        assert 0 <= stop.seconds_since() < 60
        # The same one again (torchrun forwarding the scheduler's SIGTERM), or another of them:
        # still waiting for the save, and the first stays the one reported.
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.received == signal.SIGUSR1 and stop.received_at == first_at and seen == []
        stop.close()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert seen == ["usr1 handler", "usr2 handler"]
        # Nothing held any more: a second StopSignals may take them again.
        again = StopSignals((signal.SIGUSR2,))
        os.kill(os.getpid(), signal.SIGUSR2)
        assert again.received == signal.SIGUSR2 and seen == ["usr1 handler", "usr2 handler"]
        again.close()
    finally:
        signal.signal(signal.SIGUSR1, before)
        signal.signal(signal.SIGUSR2, before2)


def test_forked_children_ignore_the_signals():
    """A data-loader worker forked during training outlives a SIGTERM sent to the whole process
    group, so the trainer can finish its step and save instead of failing on a lost worker."""
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    stop = StopSignals((signal.SIGTERM,))
    try:
        pid = os.fork()
        if pid == 0:
            ignored = signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # not the parent's handler
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(7 if ignored else 3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 7, status
        assert stop.received is None  # the parent's record is its own
    finally:
        stop.close()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        signal.signal(signal.SIGTERM, before)
