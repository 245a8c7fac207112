"""`clone_small`: the copy of small state (RNG, scheduler, sampler) a snapshot takes while training waits."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import torch

from hf_dynamic_ckpt.engine.live import clone_small
from hf_dynamic_ckpt.state.rng import capture_rng_state


def test_an_rng_state_is_copied_equal_and_independent_of_the_original():
    random.seed(1)
    np.random.seed(2)
    state = capture_rng_state()
    copy = clone_small(state)
    assert copy == state
    for path in (("python", "state"), ("numpy", "keys")):
        original, copied = state[path[0]][path[1]], copy[path[0]][path[1]]
        assert type(copied) is list and copied is not original
        original[0] = -1  # the caller reuses or changes its dict after the save
        assert copied[0] != -1


def test_containers_keep_their_kind_and_tensors_are_cloned():
    t = torch.arange(3.0)
    nested = [1, [2, 3]]
    obj = {"t": t, "pair": (1, 2.5, "x", None), "nested": nested, "od": OrderedDict(k=[t, 4]), "b": b"raw"}
    out = clone_small(obj)
    assert out["pair"] == (1, 2.5, "x", None) and type(out["pair"]) is tuple
    assert out["nested"] == [1, [2, 3]] and out["nested"][1] is not nested[1]
    assert torch.equal(out["t"], t) and out["t"].data_ptr() != t.data_ptr()
    assert torch.equal(out["od"]["k"][0], t) and out["od"]["k"][0].data_ptr() != t.data_ptr()
    t.add_(1)
    assert torch.equal(out["t"], torch.arange(3.0))
