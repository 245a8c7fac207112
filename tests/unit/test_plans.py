"""The per-save shortcuts of the copy plans agree with the generic walks (what a LoRA snapshot saves)."""

from __future__ import annotations

import pytest
import torch

from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.engine.live import optimizer_tensors, substitute, substitute_optimizer, tensors_in, walk_tensors
from hf_dynamic_ckpt.engine.plans import make_blueprint
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


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops a plan issues."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _plan_of(tensors, names=None):
    from hf_dynamic_ckpt.engine.buffers import Layout
    from hf_dynamic_ckpt.engine.plans import Plan

    names = names or tuple(f"t{i}" for i in range(len(tensors)))
    bp = make_blueprint("w/", names, tensors, [f"w/{n}" for n in names], dedupe=True)
    return Plan(bp, Layout(bp.spec, shared=False, pinned=False))


def _run(plan):
    with _Ops() as rec:
        plan.run(None)
    return [op for op in rec.ops if op in ("copy_", "cat", "_foreach_copy_")]


def test_sources_tiling_one_storage_are_copied_with_one_copy():
    flat = torch.randn(40)
    bf = torch.randn(6).to(torch.bfloat16)
    # In walk order: consecutive views (an empty one among them), two dtypes, one span each.
    tensors = [flat[0:12].view(3, 4), flat[12:12], flat[12:20], flat[20:40].view(4, 5), bf[0:2], bf[2:6].view(2, 2)]
    plan = _plan_of(tensors)
    assert len(plan.now.spans) == 2 and plan.now.cats == [] and plan.now.singles == ([], [])
    assert _run(plan) == ["copy_", "copy_"]  # not a cat of 6 sources
    for src, out in zip(tensors, plan.outputs()):
        assert out.shape == src.shape and torch.equal(out, src)
        assert out.numel() == 0 or out.data_ptr() != src.data_ptr()
    flat.add_(1.0)  # the next save copies the new values through the same span
    plan.run(None)
    assert all(torch.equal(out, src) for src, out in zip(tensors, plan.outputs()))


def test_sources_that_do_not_tile_one_span_are_concatenated():
    flat, other = torch.randn(20), torch.randn(8)
    cases = {
        "gap": [flat[0:4], flat[5:9]],
        "out of order": [flat[4:8], flat[0:4]],
        "overlap": [flat[0:4], flat[2:6]],
        "two storages": [flat[0:4], other[0:4]],
        "strided": [flat[0:8:2], flat[8:12]],
    }
    for what, tensors in cases.items():
        plan = _plan_of(tensors)
        assert plan.now.spans == [], what
        plan.run(None)
        assert all(torch.equal(out, src) for src, out in zip(tensors, plan.outputs())), what
    # Tied weights (the same view twice) tile the span with one buffer for both.
    tied = [flat[0:4], flat[4:10], flat[0:4]]
    plan = _plan_of(tied)
    assert len(plan.now.spans) == 1 and _run(plan) == ["copy_"]
    assert plan.outputs()[0] is plan.outputs()[2] and torch.equal(plan.outputs()[1], flat[4:10])
    # A span that is only part of the group (one more dtype member elsewhere) is not a span copy.
    plan = _plan_of([flat[0:4], flat[4:8], other[0:2]])
    assert plan.now.spans == [] and _run(plan) == ["cat"]


def test_a_consolidated_optimizer_state_snapshots_through_spans():
    model, opt = _adamw()
    params = list(model.parameters())
    # Lay the AdamW state out in one buffer per dtype, in state_dict walk order (what state.flat does).
    sd = opt.state_dict()
    walk = optimizer_tensors(sd)
    buf = torch.empty(sum(t.numel() for t in walk))
    offset = 0
    for p in params:
        for key, value in opt.state[p].items():
            view = buf[offset:offset + value.numel()].view(value.shape)
            view.copy_(value)
            opt.state[p][key] = view
            offset += value.numel()
    snap = Snapshotter()
    sources = StateSources(optimizer=opt)
    live = snap.collect(sources, step=1, epoch=0.0, tiers={Tier.OPTIMIZER})
    state = snap.take(live).state
    assert len(snap._plans["optimizer/"].now.spans) == 1 and snap._plans["optimizer/"].now.cats == []
    out = tensors_in(state.optimizer, [])
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr()
               for a, b in zip(out, optimizer_tensors(opt.state_dict())))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sources_tiling_one_span_are_one_device_to_host_copy():
    from hf_dynamic_ckpt.engine.buffers import CudaCopier, Layout
    from hf_dynamic_ckpt.engine.plans import Plan

    flat = torch.randn(40, device="cuda")
    tensors = [flat[0:12].view(3, 4), flat[12:40]]
    bp = make_blueprint("w/", ("a", "b"), tensors, ["w/a", "w/b"], dedupe=True)
    plan = Plan(bp, Layout(bp.spec, shared=False, pinned=bp.pinned))
    now = plan.now
    assert now.spans == [] and len(now.cuda) == 1 and now.cuda[0][0] is plan.layout.regions[torch.float32]
    copier = CudaCopier()
    plan.run(copier)
    for event in copier.finish():
        event.synchronize()
    assert all(torch.equal(out, src.cpu()) for src, out in zip(tensors, plan.outputs()))
