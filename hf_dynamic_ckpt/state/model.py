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

from ..errors import IncompatibleStateError

_MAX_LISTED_KEYS = 10


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a PEFT model (adapter-only checkpoints)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """What L0 holds: the adapter only for a PEFT model (PEFT key names), else the full state dict.

    The tensors alias the live parameters; the engine copies them.
    """
    if is_peft_model(model):
        from peft import get_peft_model_state_dict

        return dict(get_peft_model_state_dict(model))
    return dict(model.state_dict())


def frozen_weight_keys(model: nn.Module) -> frozenset[str]:
    """State-dict keys of parameters that do not train (stored once, content-addressed)."""
    if is_peft_model(model):
        return frozenset()
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    named = dict(model.named_parameters())
    return frozenset(k for k in model.state_dict() if k in named and id(named[k]) not in trainable)


def apply_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy saved L0 tensors into the live model in place (after `restore.check_weights`).

    Raises:
        `IncompatibleStateError`: names or shapes do not match the model.
    """
    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        check_weights(weights, trainable_state_dict(model))
        set_peft_model_state_dict(model, dict(weights))
        return
    check_weights(weights, model.state_dict())
    model.load_state_dict(dict(weights), strict=False)



def _fmt_keys(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED_KEYS])
    return shown + (f", ... and {len(keys) - _MAX_LISTED_KEYS} more" if len(keys) > _MAX_LISTED_KEYS else "")


def check_weights(saved: Mapping[str, torch.Tensor], expected: Mapping[str, Any]) -> None:
    """Check that saved weights fit a model's state dict, by key names and shapes.

    Args:
        saved (`Mapping[str, torch.Tensor]`): weights read from a checkpoint.
        expected (`Mapping[str, torch.Tensor]`): what the model holds (e.g. `model.state_dict()`,
            or the PEFT adapter dict).

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
        IncompatibleStateError: saved weights do not fit the model: shape mismatch (1): w saved [2, 3] vs model [2, 4]. ...
        ```
    """
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = sorted(k for k in set(saved) & set(expected) if tuple(saved[k].shape) != tuple(expected[k].shape))
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
