"""`Stateful`: `state_dict()` / `load_state_dict()` over a dataclass's own fields.

Each part of the policy (a trigger, the cadence) keeps its state in dataclass fields of JSON
scalar types, so its state dict is its fields: nothing is listed twice by hand, and a field
added to a part is saved and restored without touching `RulePolicy`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

# Field annotations (strings: `from __future__ import annotations`) -> JSON types accepted.
_ACCEPT: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "int": (int,),
    "float": (int, float),
    "int | None": (int, type(None)),
    "float | None": (int, float, type(None)),
}


class Stateful:
    """Mixin for dataclasses whose fields are the whole state (JSON scalars only)."""

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore every field from `state`; raises `ConfigError` naming a missing or mistyped field."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name not in state:
                raise ConfigError(f"policy state of {type(self).__name__} has no {f.name!r}: it was not written by "
                                  "this version's state_dict(); start without it (the policy warms up again).")
            value: Any = state[f.name]
            accepted = _ACCEPT[str(f.type)]
            if not isinstance(value, accepted) or (bool not in accepted and type(value) is bool):
                raise ConfigError(f"policy state of {type(self).__name__}: {f.name}={value!r} is invalid: expected "
                                  f"{f.type}.")
            values[f.name] = float(state[f.name]) if str(f.type) == "float" else value  # JSON may spell 1.0 as 1
        for name, value in values.items():  # all or nothing
            setattr(self, name, value)
