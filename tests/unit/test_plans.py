"""The per-save shortcuts of the copy plans agree with the generic walks (issue 15: LoRA snapshots)."""

from __future__ import annotations

import torch

from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.engine.live import optimizer_tensors, tensors_in, walk_tensors
from hf_dynamic_ckpt.engine.plans import make_blueprint, substitute, substitute_optimizer
from hf_dynamic_ckpt.engine.snapshot import Snapshotter
from hf_dynamic_ckpt.state import StateSources

W_O = {Tier.WEIGHTS, Tier.OPTIMIZER}


def _adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _ids(tensors):
    return [id(t) for t in tensors]


def test_optimizer_walk_and_rebuild_agree_with_the_generic_ones():
    _, opt = _adamw()
    sd = opt.state_dict()
    found = optimizer_tensors(sd)
    assert _ids(found) == _ids(tensors_in(sd, [])) == _ids(t for _, t in walk_tensors(sd, ""))
    assert len(found) == 4 * 3  # step, exp_avg, exp_avg_sq per parameter
    repl = [torch.full_like(t, 7.0) for t in found]
    fast, generic = substitute_optimizer(sd, repl), substitute(sd, iter(repl))
    assert _ids(tensors_in(fast, [])) == _ids(tensors_in(generic, [])) == _ids(repl)
    assert fast == generic  # same keys everywhere, the same replacement objects, equal scalars
    assert list(fast["state"]) == list(sd["state"]) and fast["param_groups"] == generic["param_groups"]
    for pid, entry in sd["state"].items():  # new containers: later steps cannot reach the snapshot
        assert fast["state"][pid] is not entry and list(fast["state"][pid]) == list(entry)
    assert fast["param_groups"][0] is not sd["param_groups"][0]


def test_unusual_optimizer_layouts_take_the_generic_path():
    t = [torch.tensor(float(i)) for i in range(4)]
    nested = {"state": {0: {"a": t[0], "hist": [t[1], 2]}, 1: {"b": t[2], "step": 5}},
              "param_groups": [{"lr": t[3], "params": [0, 1]}]}
    found = optimizer_tensors(nested)
    assert _ids(found) == _ids(tensors_in(nested, []))
    repl = [torch.tensor(10.0 + i) for i in range(4)]
    out = substitute_optimizer(nested, repl)
    assert _ids(tensors_in(out, [])) == _ids(repl)
    assert out["state"][0]["hist"] is not nested["state"][0]["hist"] and out["state"][0]["hist"][1] == 2
    assert out["state"][1]["step"] == 5
    extra = {"state": {}, "param_groups": [], "more": [t[0]]}  # not a torch.optim layout
    assert _ids(optimizer_tensors(extra)) == [id(t[0])]
    assert substitute_optimizer(extra, [t[1]])["more"][0] is t[1]


def test_blueprint_of_the_same_objects_notices_new_memory_and_new_shapes():
    tensors = [torch.zeros(3), torch.zeros(2, 2)]
    bp = make_blueprint("w/", ("a", "b"), tensors, ["w/a", "w/b"], dedupe=True)
    assert bp.matches(("a", "b"), tensors)
    tensors[0].data = torch.ones(3)  # same object, new storage
    assert not bp.matches(("a", "b"), tensors)
    bp = make_blueprint("w/", ("a", "b"), tensors, ["w/a", "w/b"], dedupe=True)
    tensors[1].resize_(4)  # same object and memory, new shape
    assert not bp.matches(("a", "b"), tensors)
    assert not bp.matches(("a", "c"), tensors)


def test_plain_and_general_weight_paths_snapshot_the_same_bytes():
    model, opt = _adamw()
    frozen_key = "1.bias"
    plain = StateSources(weights=model.state_dict, optimizer=opt)  # detached tensors: the shortcut
    params = StateSources(weights=lambda: dict(model.named_parameters()), optimizer=opt)  # Parameters: general path
    frozen = StateSources(weights=model.state_dict, optimizer=opt, frozen_keys=frozenset({frozen_key}))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    shots = {}
    for name, sources in (("plain", plain), ("params", params), ("frozen", frozen)):
        snap = Snapshotter()
        for step in (1, 2):  # the second save runs on the held plan
            live = snap.collect(sources, step=step, epoch=0.0, tiers=W_O)
            shots[name] = (live.plain, snap.take(live).state)
    assert [shots[n][0] for n in ("plain", "params", "frozen")] == [True, False, False]
    for name, (_, state) in shots.items():
        assert list(state.weights) == list(expected)
        assert all(torch.equal(state.weights[k], v) and state.weights[k].data_ptr() != model.state_dict()[k].data_ptr()
                   for k, v in expected.items() if not (name == "frozen" and k == frozen_key))
        assert not state.weights[next(iter(expected))].requires_grad
    assert shots["plain"][1].dedup_keys == frozenset() and shots["frozen"][1].dedup_keys == {frozen_key}
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # the live state moves on; the snapshots keep the values they had
    assert all(torch.equal(shots["plain"][1].weights[k], v) for k, v in expected.items())
