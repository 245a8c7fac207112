"""Strict JSON in and out: one spelling of non-finite numbers, bounded nesting on read.

Every JSON file the library writes (manifests, L2 state, the timeline, policy state in
`extra`) is strict JSON so `jq` reads it: non-finite floats are written as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (`json_safe`) and read back with `as_float`.
Every JSON file it reads from a checkpoint goes through `loads_bounded`, which refuses
documents nested deeper than `MAX_DEPTH` before the parser recurses into them (a
hostile ``[[[[...]]]]`` must not end in a `RecursionError`).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping
from typing import Any

NAN = "NaN"
POS_INF = "Infinity"
NEG_INF = "-Infinity"
MAX_DEPTH = 64
"""Deepest nesting of arrays/objects any file of a checkpoint may have (the real ones stay below 12)."""


def safe_float(value: float | None) -> float | str | None:
    """One number as strict JSON: finite floats stay, NaN/inf become their strings, `None` stays."""
    if value is None or math.isfinite(value := float(value)):
        return value
    return NAN if math.isnan(value) else POS_INF if value > 0 else NEG_INF


def json_safe(obj: Any) -> Any:
    """Replace non-finite floats by strings, tuples by lists, so the result is strict JSON."""
    if isinstance(obj, float):
        return safe_float(obj)
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if hasattr(obj, "item"):  # numpy / torch scalars
        return json_safe(obj.item())
    return str(obj)


def as_float(value: Any) -> float | None:
    """Inverse of `json_safe` for one number: ``"NaN"`` -> nan; anything else unusable -> `None`."""
    with contextlib.suppress(ValueError):
        return None if isinstance(value, bool) or not isinstance(value, int | float | str) else float(value)
    return None


def nesting_depth(obj: Any, *, limit: int | None = None) -> int:
    """Deepest list/dict nesting of a parsed JSON value (iterative; stops early past `limit`)."""
    deepest, stack = 0, [(obj, 1)]
    while stack and (limit is None or deepest <= limit):
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def loads_bounded(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads` that raises `ValueError` for invalid JSON or nesting deeper than `max_depth` (the parser's own
    recursion limit is caught; the depth check keeps recursive walkers such as `unflatten_state` far from it)."""
    try:
        obj = json.loads(data)
    except RecursionError as e:
        raise ValueError(f"JSON nested too deeply to parse (more than {max_depth} levels)") from e
    if nesting_depth(obj, limit=max_depth) > max_depth:
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return obj
