"""The library's one test hook (`HF_DYNAMIC_CKPT_FAULT`, `hf_dynamic_ckpt.errors.fault`): what each entry does."""

from __future__ import annotations

import errno
import json
import threading
import time
from pathlib import Path

import pytest

from hf_dynamic_ckpt.errors import FAULT_ENV, ConfigError, fault


def test_unset_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    fault("write", step=4, name="weights.safetensors")


def test_raise_applies_only_where_every_filter_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "write@step=4@name=weights.safetensors:raise=ENOSPC")
    fault("write", step=3, name="weights.safetensors")
    fault("write", step=4, name="optimizer.json")
    fault("read", step=4, name="weights.safetensors")
    with pytest.raises(OSError) as info:
        fault("write", step=4, name="weights.safetensors")
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == f"[Errno {errno.ENOSPC}] No space left on device (injected by {FAULT_ENV} at write)"


def test_nth_counts_the_calls_of_the_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "fs@nth=2:raise=EIO;fs@nth=3:raise=EIO")  # a new spec: counting starts again
    fault("fs", op="mkdir")
    for _ in range(2):
        with pytest.raises(OSError):
            fault("fs", op="rename")
    fault("fs", op="rename")


def test_log_and_gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(FAULT_ENV, f"read:log={log};commit:gate={tmp_path}")
    fault("read", name="weights.safetensors", step=2)
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"point": "read", "name": "weights.safetensors", "step": "2"}]
    done = threading.Event()
    thread = threading.Thread(target=lambda: (fault("commit"), done.set()))
    thread.start()
    while not (tmp_path / "commit.reached").exists():
        time.sleep(0.01)
    assert not done.wait(0.1), "the gate let the call through before it was opened"
    (tmp_path / "commit.go").touch()
    thread.join(5)
    assert done.is_set()


def test_a_malformed_entry_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "write:explode")
    with pytest.raises(ConfigError, match="HF_DYNAMIC_CKPT_FAULT entry 'write:explode' is invalid"):
        fault("write")
