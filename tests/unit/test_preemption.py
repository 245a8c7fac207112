"""Preemption: real signals set the flag, previous handlers still run, one final save."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from hf_dynamic_ckpt.config import SmartCkptConfig
from hf_dynamic_ckpt.constants import ALL_TIERS
from hf_dynamic_ckpt.policy import RulePolicy
from hf_dynamic_ckpt.run.sensing import PreemptionFlag
from hf_dynamic_ckpt.signals import SignalFrame


@pytest.fixture
def previous_handlers():
    """Install counting Python handlers (so a real SIGTERM cannot kill pytest), restore after."""
    calls: list[int] = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    for s in saved:
        signal.signal(s, lambda signum, frame: calls.append(signum))
    yield calls
    for s, h in saved.items():
        signal.signal(s, h)


def _wait(flag: PreemptionFlag) -> None:
    deadline = time.monotonic() + 5.0
    while not flag.is_set and time.monotonic() < deadline:
        time.sleep(0.001)  # Python runs the handler in the main thread between bytecodes


def test_sigterm_sets_flag_chains_previous_and_next_boundary_saves_once(previous_handlers: list[int]) -> None:
    flag = PreemptionFlag(["SIGTERM", "SIGUSR1"])
    assert flag.install() and flag.install()  # idempotent
    policy = RulePolicy(SmartCkptConfig(base_interval=1000, policy={"max_interval": 1000}))
    decisions = []
    try:
        for step in range(1, 41):
            if step == 17:
                os.kill(os.getpid(), signal.SIGTERM)
                _wait(flag)
            decisions.append(policy.decide(SignalFrame(step=step, loss=1.0, preempt=flag.is_set)))
    finally:
        flag.uninstall()
    assert flag.signum == signal.SIGTERM
    assert previous_handlers == [signal.SIGTERM]  # the previous handler still ran, once
    saves = [(d.step, d.reason, d.tiers) for d in decisions if d.save]
    assert saves == [(17, "preemption", ALL_TIERS)]


def test_sigusr1_and_uninstall_restores_previous(previous_handlers: list[int]) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    flag = PreemptionFlag(["SIGUSR1"])
    flag.install()
    assert signal.getsignal(signal.SIGUSR1) == flag._handler
    os.kill(os.getpid(), signal.SIGUSR1)
    _wait(flag)
    assert flag.is_set and previous_handlers == [signal.SIGUSR1]
    flag.uninstall()
    flag.uninstall()  # idempotent
    assert signal.getsignal(signal.SIGUSR1) is before
    flag.clear()
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 5.0
    while len(previous_handlers) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert previous_handlers == [signal.SIGUSR1, signal.SIGUSR1]
    assert not flag.is_set  # uninstalled: our flag stays down


def test_install_off_main_thread_refuses() -> None:
    flag = PreemptionFlag(["SIGUSR1"])
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(flag.install()))
    t.start()
    t.join()
    assert result == [False] and not flag.installed
