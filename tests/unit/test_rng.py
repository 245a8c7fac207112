"""L2: RNG state capture/restore is exact and JSON-only."""

from __future__ import annotations

import base64
import copy
import json
import logging
import random
from typing import Any

import numpy as np
import pytest
import torch

from hf_dynamic_ckpt.errors import CorruptCheckpointError, FormatVersionError
from hf_dynamic_ckpt.state import (
    RNG_FORMAT_VERSION,
    capture_raw_rng_state,
    capture_rng_state,
    restore_rng_state,
)


def _draw() -> list[Any]:
    """Numbers from every generator, including the cached-Gaussian paths."""
    out: list[Any] = [random.random(), random.gauss(0.0, 1.0), random.randint(0, 10**9)]
    out += [np.random.randn(5).tolist(), np.random.randint(0, 10**9, size=3).tolist(),
            float(np.random.standard_normal())]
    out += [torch.rand(4).tolist(), torch.randn(3).tolist(), torch.randint(0, 10**9, (3,)).tolist()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out += [torch.rand(4, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())]
    return out


def test_round_trip_through_strict_json_is_exact() -> None:
    random.gauss(0.0, 1.0)  # leave a cached gaussian in python's and numpy's state
    np.random.standard_normal()
    state = json.loads(json.dumps(capture_rng_state(), allow_nan=False))
    first = _draw()
    assert first != _draw()  # the generators really advance
    restore_rng_state(state)
    assert _draw() == first


def test_a_raw_capture_is_the_json_capture_and_later_draws_do_not_reach_it() -> None:
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    raw = capture_raw_rng_state()
    assert raw.to_json() == capture_rng_state()  # the same state, the same JSON
    first = _draw()  # the generators advance; the raw capture holds copies
    later = capture_rng_state()
    assert raw.to_json() != later
    restore_rng_state(json.loads(json.dumps(raw.to_json(), allow_nan=False)))
    assert _draw() == first


def test_state_layout_and_version() -> None:
    state = capture_rng_state()
    assert state["format_version"] == RNG_FORMAT_VERSION
    assert set(state) == {"format_version", "python", "numpy", "torch_cpu", "cuda"}
    assert len(state["python"]["state"]) == 625 and state["numpy"]["kind"] == "MT19937"
    assert len(base64.b64decode(state["torch_cpu"])) == torch.get_rng_state().numel()
    cuda_live = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert (state["cuda"] is not None) == cuda_live


def _broken_states(state: dict[str, Any]) -> list[tuple[dict[str, Any], type[Exception], str]]:
    no_numpy = copy.deepcopy(state)
    del no_numpy["numpy"]
    bad_b64 = {**state, "torch_cpu": "not base64!"}
    short_torch = {**state, "torch_cpu": base64.b64encode(b"short").decode()}
    bad_numpy = copy.deepcopy(state)
    bad_numpy["numpy"]["keys"] = bad_numpy["numpy"]["keys"][:10]
    return [
        ({**state, "format_version": RNG_FORMAT_VERSION + 1}, FormatVersionError,
         f"format_version {RNG_FORMAT_VERSION + 1}, newer than"),
        ({"python": state["python"]}, CorruptCheckpointError, "no integer format_version"),
        (no_numpy, CorruptCheckpointError, r"RNG state is malformed \(KeyError"),
        (bad_b64, CorruptCheckpointError, "RNG state is malformed"),
        (short_torch, CorruptCheckpointError, "rejected by its generator"),
        (bad_numpy, CorruptCheckpointError, "rejected by its generator"),
    ]


def test_newer_version_and_malformed_states_are_refused_all_or_nothing() -> None:
    start = capture_rng_state()
    expected = _draw()
    for broken, exc, msg in _broken_states(capture_rng_state()):
        restore_rng_state(start)
        with pytest.raises(exc, match=msg):
            restore_rng_state(broken)
        # A refused state leaves every generator exactly where it was.
        assert _draw() == expected, msg


def test_cuda_states_without_matching_devices_warn_and_restore_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    state = capture_rng_state()
    fake_cuda = base64.b64encode(bytes(16)).decode()
    n = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
    state["cuda"] = [fake_cuda] * n
    first = _draw()
    with caplog.at_level(logging.WARNING, logger="hf_dynamic_ckpt.state"):
        restore_rng_state(state)
    assert f"holds {n} CUDA generator(s)" in caplog.text
    assert _draw()[:9] == first[:9]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generators_round_trip() -> None:
    torch.cuda.init()
    state = json.loads(json.dumps(capture_rng_state()))
    assert len(state["cuda"]) == torch.cuda.device_count()
    first = [torch.randn(8, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())]
    restore_rng_state(state)
    assert [torch.randn(8, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())] == first
