"""Level 2: exact random-number-generator state of one rank, as versioned JSON.

Captured: Python's `random`, NumPy's global legacy `RandomState`, torch's CPU generator,
and every CUDA device's generator when CUDA is initialised. Stored as plain JSON (lists of
ints, base64 for torch's byte states), so a checkpoint's `rng-rank<R>.json` needs no pickle
and restores the generators bit-exactly.
"""

from __future__ import annotations

import base64
import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError, FormatVersionError

logger = logging.getLogger(__name__)

RNG_FORMAT_VERSION = 1
"""Version of the JSON written by `capture_rng_state`; readers refuse newer versions."""


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8).clone()


@dataclass(frozen=True, eq=False)
class RawRngState:
    """The generators' states as captured, before their conversion to JSON (`to_json`).

    Every field is a copy the generators no longer touch (`random.getstate()`'s tuple,
    NumPy's state dict with its own key array, torch's state tensors), so a later draw
    cannot change it. Snapshots and the per-step boundary capture of the integrations keep
    this form and the writer converts it (625 + 624 ints to lists, ~5 KB to base64), off the
    training thread: on the 2-core CI machine a JSON capture took 0.13 ms warm / 0.20 ms with
    cold caches, this one 0.09 / 0.14 (NumPy's `get_state` alone is ~0.04).
    """

    python: tuple[Any, ...]
    numpy: Any
    torch_cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None

    def to_json(self) -> dict[str, Any]:
        """The state in `capture_rng_state`'s JSON-able form."""
        version, internal, gauss_next = self.python
        st: Any = self.numpy
        if isinstance(st, dict) and st.get("bit_generator") == "MT19937":
            # The dict form and `tolist()` take ~0.1 ms, the legacy tuple and a per-element int() ~0.4 ms.
            kind, keys, pos = "MT19937", st["state"]["key"], st["state"]["pos"]
            has_gauss, cached_gaussian = st["has_gauss"], st["gauss"]
        else:  # a replaced global bit generator: the legacy form says what it can
            kind, keys, pos, has_gauss, cached_gaussian = st
        return {
            "format_version": RNG_FORMAT_VERSION,
            "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
            "numpy": {"kind": kind, "keys": np.asarray(keys).tolist(), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
            "torch_cpu": _b64(self.torch_cpu),
            "cuda": [_b64(t) for t in self.cuda] if self.cuda is not None else None,
        }


RngState = dict[str, Any] | RawRngState
"""An RNG state as saves take it: JSON-able (`capture_rng_state`) or raw (`capture_raw_rng_state`)."""


def capture_raw_rng_state() -> RawRngState:
    """This process's RNG states, captured now and converted to JSON later (`RawRngState.to_json`)."""
    st: Any = np.random.get_state(legacy=False)
    if not (isinstance(st, dict) and st.get("bit_generator") == "MT19937"):
        st = np.random.get_state(legacy=True)
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = tuple(torch.cuda.get_rng_state_all())
    return RawRngState(python=random.getstate(), numpy=st, torch_cpu=torch.get_rng_state(), cuda=cuda)


def rng_json(state: RawRngState | dict[str, Any] | None) -> dict[str, Any] | None:
    """`state` in JSON-able form (a `RawRngState` converted; a dict or `None` as it is)."""
    return state.to_json() if isinstance(state, RawRngState) else state


def capture_rng_state() -> dict[str, Any]:
    """Captures this process's RNG states in JSON-able form.

    Returns:
        `dict[str, Any]`: `{"format_version", "python", "numpy", "torch_cpu", "cuda"}`;
        `"cuda"` is a list with one base64 state per device, or `None` when CUDA is not
        available or not initialised (capturing would initialise it).

    Example:
    ```python
    >>> state = capture_rng_state()
    >>> a = torch.rand(3)
    >>> restore_rng_state(state)
    >>> torch.equal(a, torch.rand(3))
    True
    ```
    """
    return capture_raw_rng_state().to_json()


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restores RNG states captured by `capture_rng_state` (after a JSON round trip).

    CUDA states are restored when CUDA is available and the number of devices matches;
    otherwise a warning is logged and the CUDA generators are left alone.

    Args:
        state (`dict[str, Any]`): the captured state.

    Raises:
        `FormatVersionError`: the state was written by a newer format version.
        `CorruptCheckpointError`: a field is missing or malformed.
    """
    version = state.get("format_version") if isinstance(state, dict) else None
    if not isinstance(version, int):
        raise CorruptCheckpointError(f"RNG state has no integer format_version (got {version!r}); the file is corrupt.")
    if version > RNG_FORMAT_VERSION:
        raise FormatVersionError(
            f"RNG state has format_version {version}, newer than this library's {RNG_FORMAT_VERSION}; "
            "upgrade hf_dynamic_ckpt to resume from it."
        )
    try:
        py = state["python"]
        py_state = (int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"])
        npst = state["numpy"]
        np_state = (str(npst["kind"]), np.asarray(npst["keys"], dtype=np.uint32), int(npst["pos"]),
                    int(npst["has_gauss"]), float(npst["cached_gaussian"]))
        torch_cpu = _unb64(state["torch_cpu"])
        cuda = state.get("cuda")
        cuda_states = [_unb64(s) for s in cuda] if cuda else None
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"RNG state is malformed ({type(e).__name__}: {e}); the file is corrupt.") from e
    previous = (random.getstate(), np.random.get_state(legacy=True), torch.get_rng_state())
    try:
        torch.set_rng_state(torch_cpu)
        np.random.set_state(np_state)
        random.setstate(py_state)
    except (TypeError, ValueError, IndexError, RuntimeError) as e:
        # All or nothing: a half-restored set of generators would silently break exactness.
        random.setstate(previous[0])
        np.random.set_state(previous[1])
        torch.set_rng_state(previous[2])
        raise CorruptCheckpointError(f"RNG state was rejected by its generator ({e}); the file is corrupt.") from e
    if cuda_states:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            logger.warning("RNG state holds %d CUDA generator(s) but %d CUDA device(s) are visible; "
                           "CUDA generators not restored, GPU randomness will differ.", len(cuda_states), have)
