from __future__ import annotations

import pytest
import torch

from hf_dynamic_ckpt.constants import ALL_TIERS, Tier
from hf_dynamic_ckpt.engine.buffers import BufferPool
from hf_dynamic_ckpt.engine.snapshot import Snapshotter
from hf_dynamic_ckpt.errors import SaveError
from hf_dynamic_ckpt.state import CachedWeights, StateSources
from hf_dynamic_ckpt.store import BlobRef


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    _train_step(model, opt, sched)
    return model, opt, sched


def _train_step(model, opt, sched=None):
    loss = model(torch.randn(4, 6)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()


def _clone_sd(sd):
    return {k: v.detach().clone() for k, v in sd.items()}


def test_buffered_snapshot_is_immune_to_later_steps():
    model, opt, sched = _setup()
    sources = StateSources(weights=model.state_dict, optimizer=opt, scheduler=sched)
    snap = Snapshotter()
    before_w = _clone_sd(model.state_dict())
    before_m = opt.state_dict()["state"][0]["exp_avg"].clone()
    before_lr = sched.get_last_lr()
    s = snap.take(snap.collect(sources, step=1, epoch=0.0, tiers=ALL_TIERS, rng={"seed": 1}))
    for _ in range(3):
        _train_step(model, opt, sched)
    for k, v in before_w.items():
        assert torch.equal(s.state.weights[k], v), k
        assert not torch.equal(model.state_dict()[k], v), f"{k} did not train: test is vacuous"
    assert torch.equal(s.state.optimizer["state"][0]["exp_avg"], before_m)
    assert s.state.scheduler["_last_lr"] == before_lr != sched.get_last_lr()
    assert s.copied_bytes == sum(v.numel() * v.element_size() for v in before_w.values()) + sum(
        t.numel() * t.element_size() for st in opt.state_dict()["state"].values() for t in st.values()
    )
    assert s.live_bytes == 0


def test_direct_snapshot_aliases_live_tensors():
    model, opt, _ = _setup()
    snap = Snapshotter()
    s = snap.take(snap.collect(StateSources(weights=model.state_dict, optimizer=opt), step=1, epoch=0.0,
                               tiers={Tier.WEIGHTS, Tier.OPTIMIZER}), copy=False)
    assert s.copied_bytes == 0 and len(snap.pool) == 0
    w = model.state_dict()
    for k, v in s.state.weights.items():
        assert v.data_ptr() == w[k].data_ptr()
    live_m = opt.state[next(iter(model.parameters()))]["exp_avg"]
    assert s.state.optimizer["state"][0]["exp_avg"].data_ptr() == live_m.data_ptr()


def test_buffers_are_reused_across_saves():
    model, opt, _ = _setup()
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    snap = Snapshotter()
    live = snap.collect(sources, step=1, epoch=0.0, tiers={Tier.WEIGHTS, Tier.OPTIMIZER})
    first_needed = snap.extra_bytes_needed(live)
    assert first_needed == live.copy_bytes > 0
    s1 = snap.take(live)
    gen = snap.pool.generation
    ptrs = {k: v.data_ptr() for k, v in s1.state.weights.items()}
    _train_step(model, opt)
    live2 = snap.collect(sources, step=2, epoch=0.0, tiers={Tier.WEIGHTS, Tier.OPTIMIZER})
    assert snap.extra_bytes_needed(live2) == 0
    s2 = snap.take(live2)
    assert snap.pool.generation == gen
    assert {k: v.data_ptr() for k, v in s2.state.weights.items()} == ptrs
    for k, v in model.state_dict().items():
        assert torch.equal(s2.state.weights[k], v)


def test_tier_subset_keeps_other_buffers_and_shape_change_reallocates():
    model, opt, _ = _setup()
    snap = Snapshotter()
    snap.take(snap.collect(StateSources(weights=model.state_dict, optimizer=opt), step=1, epoch=0.0,
                           tiers={Tier.WEIGHTS, Tier.OPTIMIZER}))
    n_all = len(snap.pool)
    snap.take(snap.collect(StateSources(weights=model.state_dict), step=2, epoch=0.0, tiers={Tier.WEIGHTS}))
    assert len(snap.pool) == n_all  # a weights-only save keeps the optimizer buffers
    gen = snap.pool.generation
    bigger = {"0.weight": torch.ones(7, 6)}
    s = snap.take(snap.collect(StateSources(weights=lambda: bigger), step=3, epoch=0.0, tiers={Tier.WEIGHTS}))
    assert snap.pool.generation > gen
    assert list(s.state.weights) == ["0.weight"]
    assert torch.equal(s.state.weights["0.weight"], bigger["0.weight"])
    # Weight buffers of keys that disappeared are freed; optimizer buffers stay.
    assert {n for n in snap.pool.buffers if n.startswith("weights/")} == {"weights/0.weight"}
    assert any(n.startswith("optimizer/") for n in snap.pool.buffers)


def test_frozen_weights_are_not_copied_and_become_blob_refs():
    model, _, _ = _setup()
    frozen = frozenset({"0.weight", "0.bias"})
    sources = StateSources(weights=model.state_dict, frozen_keys=frozen)
    snap = Snapshotter()
    s1 = snap.take(snap.collect(sources, step=1, epoch=0.0, tiers={Tier.WEIGHTS}))
    live = model.state_dict()
    assert s1.state.weights["0.weight"].data_ptr() == live["0.weight"].data_ptr()
    assert s1.state.dedup_keys == frozen
    assert set(s1.pending_blobs) == frozen
    assert s1.copied_bytes == sum(live[k].numel() * 4 for k in ("2.weight", "2.bias"))
    blobs = {k: {"digest": f"d{k}", "dtype": "float32", "shape": list(live[k].shape), "size": 1} for k in frozen}
    snap.mark_blobs_stored(s1.pending_blobs, blobs)
    s2 = snap.take(snap.collect(sources, step=2, epoch=0.0, tiers={Tier.WEIGHTS}))
    assert s2.state.weights["0.weight"] == BlobRef("d0.weight", "float32", (5, 6))
    assert s2.state.dedup_keys == frozen and not s2.pending_blobs
    with torch.no_grad():
        model[0].weight.add_(1.0)  # an in-place change bumps the version: no stale BlobRef
    s3 = snap.take(snap.collect(sources, step=3, epoch=0.0, tiers={Tier.WEIGHTS}))
    assert isinstance(s3.state.weights["0.weight"], torch.Tensor)
    assert isinstance(s3.state.weights["0.bias"], BlobRef)
    assert set(s3.pending_blobs) == {"0.weight"}


def test_blob_that_disappeared_is_written_again():
    model, _, _ = _setup()
    sources = StateSources(weights=model.state_dict, frozen_keys=frozenset({"0.weight"}))
    alive = {"yes": True}
    snap = Snapshotter(blob_exists=lambda ref: alive["yes"])
    s1 = snap.take(snap.collect(sources, step=1, epoch=0.0, tiers={Tier.WEIGHTS}))
    snap.mark_blobs_stored(s1.pending_blobs, {"0.weight": {"digest": "x", "dtype": "float32", "shape": [5, 6]}})
    s2 = snap.take(snap.collect(sources, step=2, epoch=0.0, tiers={Tier.WEIGHTS}))
    assert s2.state.weights["0.weight"] == BlobRef("x", "float32", (5, 6)) and not s2.pending_blobs  # still there
    alive["yes"] = False
    s3 = snap.take(snap.collect(sources, step=3, epoch=0.0, tiers={Tier.WEIGHTS}))
    # Gone from the store: copied from the live tensor and handed to the store as a blob to write again.
    assert torch.equal(s3.state.weights["0.weight"], model.state_dict()["0.weight"])
    assert set(s3.pending_blobs) == {"0.weight"} and "0.weight" in s3.state.dedup_keys


def test_shared_pool_copies_frozen_weights_too():
    model, _, _ = _setup()
    snap = Snapshotter(shared=True)
    s = snap.take(snap.collect(StateSources(weights=model.state_dict, frozen_keys=frozenset({"0.weight"})),
                               step=1, epoch=0.0, tiers={Tier.WEIGHTS}))
    w = s.state.weights["0.weight"]
    assert w.data_ptr() != model[0].weight.data_ptr() and w.is_shared()
    assert torch.equal(w, model[0].weight)


def test_state_tier_uses_overrides_and_small_state_is_deep_copied():
    model, opt, sched = _setup()
    pos = {"epoch": 0, "batches": [3, 4]}
    extra = {"trainer_state": {"global_step": 5}}
    sources = StateSources(weights=model.state_dict, optimizer=opt, scheduler=sched, sampler=lambda: pos)
    snap = Snapshotter()
    s = snap.take(snap.collect(sources, step=5, epoch=0.5, tiers=ALL_TIERS, rng={"python": [1, 2]}, extra=extra))
    pos["batches"].append(5)
    extra["trainer_state"]["global_step"] = 6
    assert s.state.rng == {"python": [1, 2]}
    assert s.state.sampler == {"epoch": 0, "batches": [3, 4]}
    assert s.state.extra == {"trainer_state": {"global_step": 5}}
    assert (s.state.step, s.state.epoch) == (5, 0.5)
    assert s.state.tiers == ALL_TIERS
    s2 = snap.take(snap.collect(sources, step=5, epoch=0.5, tiers={Tier.STATE}, sampler={"epoch": 9}))
    assert s2.state.sampler == {"epoch": 9}
    assert s2.state.rng is not None and s2.state.weights is None and s2.state.optimizer is None


def test_missing_sources_raise_named_errors():
    snap = Snapshotter()
    with pytest.raises(SaveError, match=r"tiers include 'weights' but StateSources.weights is None"):
        snap.collect(StateSources(), step=1, epoch=0.0, tiers={Tier.WEIGHTS})
    with pytest.raises(SaveError, match=r"tiers include 'optimizer' but StateSources has no optimizer"):
        snap.collect(StateSources(), step=1, epoch=0.0, tiers={Tier.OPTIMIZER})
    with pytest.raises(SaveError, match=r"weight 'w' is a list, not a torch.Tensor"):
        snap.collect(StateSources(weights=lambda: {"w": [1.0]}), step=1, epoch=0.0, tiers={Tier.WEIGHTS})


def test_noncontiguous_and_bf16_tensors_copy_exactly():
    base = torch.randn(6, 4).to(torch.bfloat16)
    tensors = {"t": base.t(), "s": base[::2]}
    snap = Snapshotter()
    s = snap.take(snap.collect(StateSources(weights=lambda: tensors), step=1, epoch=0.0, tiers={Tier.WEIGHTS}))
    for k, v in tensors.items():
        out = s.state.weights[k]
        assert out.is_contiguous() and out.dtype == torch.bfloat16 and torch.equal(out, v)


def test_buffer_pool_clear_and_generation():
    pool = BufferPool()
    a = pool.get("a", torch.zeros(3))
    assert pool.get("a", torch.ones(3)) is a and pool.generation == 1
    assert pool.nbytes == 12
    pool.get("a", torch.zeros(3, dtype=torch.float64))
    assert pool.generation == 2 and pool.nbytes == 24
    pool.clear()
    assert len(pool) == 0 and pool.nbytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shared", [False, True])
def test_cuda_snapshot_pinned_and_ordered_before_next_step(shared):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    snap = Snapshotter(shared=shared)
    s = snap.take(snap.collect(StateSources(weights=model.state_dict, optimizer=opt), step=1, epoch=0.0,
                               tiers={Tier.WEIGHTS, Tier.OPTIMIZER}))
    opt.zero_grad()
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()  # queued on the current stream, which waits on the snapshot's event
    s.wait_copies()
    for k, v in expected.items():
        assert s.state.weights[k].is_pinned() and s.state.weights[k].is_shared() == shared
        assert torch.equal(s.state.weights[k], v)


def test_cached_weights_reuses_the_mapping_until_a_parameter_is_replaced():
    model, opt, _ = _setup()
    calls = []

    def build():
        calls.append(1)
        return model.state_dict()

    weights = CachedWeights(model, build)
    first = weights()
    assert weights() is first and len(calls) == 1
    _train_step(model, opt)  # in-place updates are visible through the cached views
    assert torch.equal(weights()["0.weight"], model[0].weight) and len(calls) == 1
    model[0].weight = torch.nn.Parameter(torch.zeros(5, 6))  # storage replaced: rebuild
    fresh = weights()
    assert len(calls) == 2 and fresh is not first
    assert torch.equal(fresh["0.weight"], torch.zeros(5, 6))


def test_cached_weights_checks_data_pointers_of_what_the_mapping_aliases_only():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    calls = []

    def adapters():  # like get_peft_model_state_dict: a subset of the parameters
        calls.append(1)
        return {"1.weight": model[1].weight.detach()}

    weights = CachedWeights(model, adapters)
    first = weights()
    model[0].weight.data = torch.zeros(5, 6)  # a tensor the mapping does not hold moved: still valid
    assert weights() is first and len(calls) == 1
    model[1].weight.data = torch.ones(2, 5)  # what the mapping aliases moved (FlatKeeper does this): rebuilt
    assert weights() is not first and len(calls) == 2
    assert torch.equal(weights()["1.weight"], torch.ones(2, 5)) and len(calls) == 2
    model[0] = torch.nn.Linear(6, 5)  # a replaced module: rebuilt
    weights()
    model.register_buffer("extra", torch.zeros(1))  # a new slot: rebuilt
    weights()
    assert len(calls) == 4


def test_tied_weights_stay_tied_and_are_copied_once():
    emb = torch.randn(10, 4)
    tensors = {"embed.weight": emb, "lm_head.weight": emb, "other": torch.randn(3)}
    snap = Snapshotter()
    live = snap.collect(StateSources(weights=lambda: tensors), step=1, epoch=0.0, tiers={Tier.WEIGHTS})
    assert live.copy_bytes == (40 + 3) * 4
    s = snap.take(live)
    assert s.state.weights["lm_head.weight"] is s.state.weights["embed.weight"]
    assert s.state.weights["embed.weight"].data_ptr() != emb.data_ptr()
    assert s.copied_bytes == (40 + 3) * 4 and len(snap.pool) == 2


def test_many_small_tensors_share_one_region_per_dtype():
    torch.manual_seed(0)
    tensors = {f"a{i}": torch.randn(3, 5) for i in range(200)}
    tensors.update({f"b{i}": torch.randn(7).to(torch.bfloat16) for i in range(50)})
    expected = {k: v.clone() for k, v in tensors.items()}
    snap = Snapshotter()
    s = snap.take(snap.collect(StateSources(weights=lambda: tensors), step=1, epoch=0.0, tiers={Tier.WEIGHTS}))
    regions = snap.pool.layouts["weights/"].regions
    assert {d: r.numel() for d, r in regions.items()} == {torch.float32: 200 * 15, torch.bfloat16: 50 * 7}
    for k, v in s.state.weights.items():
        region = regions[v.dtype]
        assert v.untyped_storage().data_ptr() == region.untyped_storage().data_ptr(), k
        assert torch.equal(v, expected[k]) and v.dtype == expected[k].dtype, k
    for v in tensors.values():
        v.add_(1)  # the snapshot does not move with the sources
    assert all(torch.equal(s.state.weights[k], expected[k]) for k in tensors)


def test_plan_follows_replaced_tensors_and_reuses_fresh_state_dict_objects():
    model, opt, _ = _setup()
    sources = StateSources(weights=model.state_dict, optimizer=opt)  # fresh detached tensors on every call
    snap = Snapshotter()
    snap.take(snap.collect(sources, step=1, epoch=0.0, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}))
    plans, gen = dict(snap._plans), snap.pool.generation
    _train_step(model, opt)
    live = snap.collect(sources, step=2, epoch=0.0, tiers={Tier.WEIGHTS, Tier.OPTIMIZER})
    assert snap.extra_bytes_needed(live) == 0
    s2 = snap.take(live)
    assert snap._plans == plans and snap.pool.generation == gen  # same tensors: nothing worked out again
    assert all(torch.equal(s2.state.weights[k], v) for k, v in model.state_dict().items())
    # A parameter given new storage of the same shape, an optimizer state tensor replaced.
    model[0].weight.data = torch.full((5, 6), 3.0)
    param = next(iter(model.parameters()))
    opt.state[param]["exp_avg"] = torch.full((5, 6), 4.0)
    s3 = snap.take(snap.collect(sources, step=3, epoch=0.0, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}))
    assert torch.equal(s3.state.weights["0.weight"], torch.full((5, 6), 3.0))
    assert torch.equal(s3.state.optimizer["state"][0]["exp_avg"], torch.full((5, 6), 4.0))
    assert snap.pool.generation == gen  # same shapes: the buffers are reused
    model[0].weight.data = torch.full((2, 6), 5.0)  # new shape: new buffers
    s4 = snap.take(snap.collect(sources, step=4, epoch=0.0, tiers={Tier.WEIGHTS}))
    assert torch.equal(s4.state.weights["0.weight"], torch.full((2, 6), 5.0)) and snap.pool.generation > gen


def test_state_dict_walks_agree_and_the_copy_shares_no_mutable_container():
    from types import MappingProxyType

    from hf_dynamic_ckpt.engine.live import substitute, tensors_in, walk_tensors

    t = [torch.tensor(float(i)) for i in range(6)]
    obj = {
        "state": {0: {"a": t[0], "step": 3, "b": (t[1], 2.0)}},
        "param_groups": [{"lr": t[2], "params": [0, 1], "betas": (0.9, 0.99), "name": None}],
        "m": MappingProxyType({"x": t[3], "y": [t[4], {"z": torch.nn.Parameter(t[5].clone())}]}),
    }
    found = tensors_in(obj, [])
    assert [id(x) for x in found] == [id(x) for _, x in walk_tensors(obj, "")] and len(found) == 6
    replacements = [torch.tensor(100.0 + i) for i in range(6)]
    out = substitute(obj, iter(replacements))
    assert [id(x) for x in tensors_in(out, [])] == [id(x) for x in replacements]
    group = out["param_groups"][0]
    assert group["params"] == [0, 1] and group["params"] is not obj["param_groups"][0]["params"]
    assert group["betas"] == (0.9, 0.99) and group["name"] is None and out["state"][0]["step"] == 3
    assert type(out["m"]) is dict and out["state"][0]["b"][1] == 2.0
    obj["param_groups"][0]["params"].append(2)  # the live state changes after the snapshot
    assert group["params"] == [0, 1]
