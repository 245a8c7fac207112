"""A model's trainable state as a checkpoint holds it, and back: L0 names, frozen keys, checks.

`trainable_state_dict` is what L0 stores (a PEFT model's adapters only, under PEFT's key
names; every other model's full state dict); `apply_weights` is its inverse, after
`check_weights` has compared names and shapes with the live model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..constants import ADAPTER_KEY_SEP
from ..errors import IncompatibleStateError

_MAX_LISTED_KEYS = 10


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a PEFT model (adapter-only checkpoints)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def adapter_names(model: nn.Module) -> list[str]:
    """The PEFT adapters of `model` in a stable order (the active one first); `[]` for other models."""
    if not is_peft_model(model):
        return []
    names = list(getattr(model, "peft_config", {}) or {})
    active = getattr(model, "active_adapter", None)
    if isinstance(active, str) and active in names:
        names.remove(active)
        names.insert(0, active)
    return names


def adapter_key(adapter: str, key: str) -> str:
    """The L0 name of a PEFT key of `adapter` in a model with several adapters."""
    return f"{adapter}{ADAPTER_KEY_SEP}{key}"


def split_adapters(weights: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Inverse of `trainable_state_dict` for a PEFT model: `{adapter: {peft key: tensor}}`.

    Keys without an adapter prefix belong to the only adapter (models with one adapter keep
    PEFT's own key names, byte-identical with its ``adapter_model.safetensors``).
    """
    if len(names) <= 1:
        return {names[0] if names else "default": dict(weights)}
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for key, tensor in weights.items():
        adapter, sep, rest = key.partition(ADAPTER_KEY_SEP)
        if not sep or adapter not in out:
            raise IncompatibleStateError(
                f"saved weight {key!r} names no adapter of the model (adapters: {', '.join(names)}); resume with the "
                "adapters the checkpoint was saved with."
            )
        out[adapter][rest] = tensor
    return out


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """What L0 holds: a PEFT model's adapters only, else the full state dict.

    A PEFT model with one adapter (whatever its name) is stored under PEFT's key names; with
    several, every adapter, active or not, is stored under ``"<adapter>::<PEFT key>"``.
    The tensors alias the live parameters; the engine copies them.
    """
    names = adapter_names(model)
    if not names:
        return dict(model.state_dict())
    from peft import get_peft_model_state_dict

    if len(names) == 1:
        return dict(get_peft_model_state_dict(model, adapter_name=names[0]))
    out: dict[str, torch.Tensor] = {}
    for name in names:
        out.update({adapter_key(name, k): v for k, v in get_peft_model_state_dict(model, adapter_name=name).items()})
    return out


def own_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state-dict entries of a model without adapters that are a CPU parameter's or buffer's own memory: what
    a resume can read the weights file straight into (`plan_resume(into=...)`); empty for a PEFT model (its
    adapters go through PEFT's setter) or a model on another device. A state-dict hook that hands out converted
    copies leaves those keys out: reading into them would not change the model."""
    if adapter_names(model):
        return {}
    own = {t.data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel() and t.device.type == "cpu"}
    return {k: t for k, t in model.state_dict().items() if t.data_ptr() in own}


def frozen_weight_keys(model: nn.Module) -> frozenset[str]:
    """State-dict keys of parameters that do not train (stored once, content-addressed)."""
    if is_peft_model(model):
        return frozenset()
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    named = dict(model.named_parameters())
    return frozenset(k for k in model.state_dict() if k in named and id(named[k]) not in trainable)


def apply_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy saved L0 tensors into the live model in place (after `check_weights`).

    Raises:
        `IncompatibleStateError`: names or shapes do not match the model.
    """
    names = adapter_names(model)
    check_weights(weights, expected_weights(model))
    if names:
        from peft import set_peft_model_state_dict

        for adapter, state in split_adapters(weights, names).items():
            set_peft_model_state_dict(model, state, adapter_name=adapter)
        return
    model.load_state_dict(dict(weights), strict=False)


def expected_weights(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """`trainable_state_dict(model)` for `check_weights`, buffers checked by name only.

    A module may resize a buffer when it loads a state dict (Trainer loads with
    `load_state_dict(strict=False)`, which lets it); parameters must keep their shapes.
    """
    out: dict[str, torch.Tensor | None] = dict(trainable_state_dict(model))
    if not adapter_names(model):
        for name, _ in model.named_buffers():
            if name in out:
                out[name] = None
    return out


def _fmt_keys(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED_KEYS])
    return shown + (f", ... and {len(keys) - _MAX_LISTED_KEYS} more" if len(keys) > _MAX_LISTED_KEYS else "")


def check_weights(saved: Mapping[str, torch.Tensor], expected: Mapping[str, Any]) -> None:
    """Check that saved weights fit a model's state dict, by key names and shapes.

    Args:
        saved (`Mapping[str, torch.Tensor]`): weights read from a checkpoint.
        expected (`Mapping[str, torch.Tensor | None]`): what the model holds (e.g. `model.state_dict()`,
            the PEFT adapter dict, or `expected_weights(model)`); a `None` entry is checked by name only.

    Raises:
        `IncompatibleStateError`: with the message

            ``saved weights do not fit the model: <parts>. Resume with the model (and adapter)
            configuration the checkpoint was saved from.``

            where ``<parts>`` joins with ``"; "`` the non-empty ones of
            ``missing from the checkpoint (N): k1, k2``,
            ``unexpected in the checkpoint (N): k3`` and
            ``shape mismatch (N): k4 saved [2, 3] vs model [2, 4]``; keys are sorted and at
            most 10 are listed per part (``..., ... and M more``).

    Example:
        ```python
        >>> check_weights({"w": torch.zeros(2, 3)}, {"w": torch.zeros(2, 4)})
        IncompatibleStateError: saved weights do not fit the model: shape mismatch (1): w saved [2, 3] vs model
        [2, 4]. ...
        ```
    """
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = sorted(k for k in set(saved) & set(expected)
                        if expected[k] is not None and tuple(saved[k].shape) != tuple(expected[k].shape))
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint ({len(missing)}): {_fmt_keys(missing)}")
    if unexpected:
        parts.append(f"unexpected in the checkpoint ({len(unexpected)}): {_fmt_keys(unexpected)}")
    if mismatched:
        shown = [f"{k} saved {list(saved[k].shape)} vs model {list(expected[k].shape)}" for k in mismatched]
        parts.append(f"shape mismatch ({len(mismatched)}): {_fmt_keys(shown)}")
    if parts:
        raise IncompatibleStateError(
            "saved weights do not fit the model: " + "; ".join(parts)
            + ". Resume with the model (and adapter) configuration the checkpoint was saved from."
        )
