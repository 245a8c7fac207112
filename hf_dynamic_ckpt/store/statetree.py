"""Nested state dicts as JSON plus a flat tensor dict, without pickle (the L1 structure).

`flatten_state` / `unflatten_state` split any nested state (optimizer, scheduler, AMP
scaler `state_dict()`) into a JSON structure and a flat `{name: tensor}` dict, and put it
back together exactly: int keys stay int, tuples stay tuples, `inf`/`nan`/`-0.0` survive,
0-dim tensors (AdamW's `step`) stay tensors. Tagged JSON objects carry what JSON cannot
express (a one-key object whose key is in `_TAGS`); plain dicts with str keys stay plain
objects, so `jq` reads them. The tensors go into the container of `tensorpack.py`.

Decoding a structure read from disk never raises anything but `CorruptCheckpointError`
for a malformed one (its nesting depth is bounded by `jsonutil.loads_bounded` on read).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError, SaveError
from .tensorpack import DTYPES as _DTYPES
from .tensorpack import NAMES as _NAMES

_T_TENSOR = "__tensor__"
_T_NDARRAY = "__ndarray__"
_T_TUPLE = "__tuple__"
_T_DICT = "__dict__"
_T_FLOAT = "__float__"
_T_BYTES = "__bytes__"
_T_DTYPE = "__dtype__"
_T_NPSCALAR = "__npscalar__"
_TAGS = {_T_TENSOR, _T_NDARRAY, _T_TUPLE, _T_DICT, _T_FLOAT, _T_BYTES, _T_DTYPE, _T_NPSCALAR}


def _is_plain_key(k: Any) -> bool:
    return isinstance(k, str) and not k.startswith("__")


def flatten_state(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Splits a nested state (dict/list/tuple/scalars/tensors) into JSON and tensors.

    Args:
        obj (`Any`): e.g. `optimizer.state_dict()`, `scheduler.state_dict()`,
            `scaler.state_dict()`, or a dict of several of them.

    Returns:
        `tuple[Any, dict[str, torch.Tensor]]`: a JSON-serialisable structure in which each
        tensor is replaced by `{"__tensor__": name}`, and `{name: tensor}` (names are the
        `/`-joined paths, e.g. `"state/0/exp_avg"`).

    Raises:
        `SaveError`: a value of a type that cannot be stored without pickle (the message
        names its path and type).

    Example:
    ```python
    >>> structure, tensors = flatten_state(optimizer.state_dict())  # doctest: +SKIP
    >>> unflatten_state(structure, tensors)["param_groups"][0]["betas"]  # doctest: +SKIP
    (0.9, 0.999)
    ```
    """
    tensors: dict[str, torch.Tensor] = {}
    return _encode(obj, [], tensors), tensors


# Both walks (`_encode`, `_decode`) are module functions, not closures: a recursive closure refers to itself through
# its own cell, a reference cycle that keeps the tensors it closes over alive until the garbage collector runs; after
# a failed decode, that is a whole optimizer tier held while the caller retries or falls back.
def _name_for(path: list[str], tensors: Mapping[str, torch.Tensor]) -> str:
    base = "/".join(path) or "tensor"
    name, n = base, 1
    while name in tensors:
        name, n = f"{base}#{n}", n + 1
    return name


def _encode(x: Any, path: list[str], tensors: dict[str, torch.Tensor]) -> Any:
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)  # IntEnum and friends become plain ints
    if isinstance(x, float):
        if math.isfinite(x):
            return float(x)
        return {_T_FLOAT: repr(float(x))}  # 'inf', '-inf', 'nan'
    if isinstance(x, torch.Tensor):
        name = _name_for(path, tensors)
        tensors[name] = x
        return {_T_TENSOR: name}
    if isinstance(x, np.ndarray):
        name = _name_for(path, tensors)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(x))
        return {_T_NDARRAY: name}
    if isinstance(x, np.generic):
        return {_T_NPSCALAR: [x.dtype.str, base64.b64encode(x.tobytes()).decode("ascii")]}
    if isinstance(x, torch.dtype):
        return {_T_DTYPE: _NAMES.get(x, str(x))}
    if isinstance(x, (bytes, bytearray)):
        return {_T_BYTES: base64.b64encode(bytes(x)).decode("ascii")}
    if isinstance(x, tuple):
        return {_T_TUPLE: [_encode(v, [*path, str(i)], tensors) for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, [*path, str(i)], tensors) for i, v in enumerate(x)]
    if isinstance(x, dict):
        if all(_is_plain_key(k) for k in x):
            return {k: _encode(v, [*path, k], tensors) for k, v in x.items()}
        return {_T_DICT: [[_encode(k, [*path, "key"], tensors), _encode(v, [*path, str(k)], tensors)]
                          for k, v in x.items()]}
    where = "/".join(path) or "<root>"
    raise SaveError(
        f"State value at {where!r} is a {type(x).__module__}.{type(x).__name__}, which cannot be "
        "stored without pickle; keep only tensors, numbers, strings, None, lists, tuples and "
        "dicts in the state dict (e.g. drop lambdas from the scheduler state)."
    )


def unflatten_state(structure: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of `flatten_state`.

    Args:
        structure (`Any`): the JSON structure from `flatten_state` (after a JSON round trip).
        tensors (`Mapping[str, torch.Tensor]`): the tensors by name.

    Returns:
        `Any`: the original object, with tensors taken from `tensors`.

    Raises:
        `CorruptCheckpointError`: the structure names a tensor that is missing, or holds a
        malformed tag.
    """
    return _decode(structure, tensors)


def _decode(x: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(x, list):
        return [_decode(v, tensors) for v in x]
    if not isinstance(x, dict):
        return x
    if len(x) == 1:
        (tag, val), = x.items()
        if tag in _TAGS:
            try:
                return _decode_tag(tag, val, tensors)
            except CorruptCheckpointError:
                raise
            except (KeyError, ValueError, TypeError, IndexError) as e:
                raise CorruptCheckpointError(f"Malformed {tag} entry in the state structure: {val!r:.80}") from e
    return {k: _decode(v, tensors) for k, v in x.items()}


def _decode_tag(tag: str, val: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if tag in (_T_TENSOR, _T_NDARRAY):
        if val not in tensors:
            raise CorruptCheckpointError(f"State structure refers to tensor {val!r}, which the tensor file does not "
                                         "hold.")
        return tensors[val] if tag == _T_TENSOR else tensors[val].numpy()
    if tag == _T_TUPLE:
        return tuple(_decode(v, tensors) for v in val)
    if tag == _T_DICT:
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in val}
    if tag == _T_FLOAT:
        if val not in ("inf", "-inf", "nan"):
            raise ValueError(val)
        return float(val)
    if tag == _T_BYTES:
        return base64.b64decode(val, validate=True)
    if tag == _T_DTYPE:
        return _DTYPES[val]
    if tag == _T_NPSCALAR:
        return np.frombuffer(base64.b64decode(val[1], validate=True), dtype=np.dtype(val[0]))[0]
    raise ValueError(tag)


def _hashable(k: Any) -> Any:
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k
