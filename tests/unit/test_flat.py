"""Consolidated trainable state (`state.flat`): one flat buffer per (device, dtype),
values and training bit-identical, replaced state noticed and moved again, snapshots as one copy."""

from __future__ import annotations

import copy

import pytest
import torch

from examples import toy
from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.engine.live import optimizer_tensors, tensors_in
from hf_dynamic_ckpt.engine.snapshot import Snapshotter
from hf_dynamic_ckpt.state import StateSources, trainable_state_dict
from hf_dynamic_ckpt.state.flat import FlatKeeper, consolidate, pays

TOKENS = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4], [4, 2, 6, 1, 0, 3, 5, 7]])
W_O = {Tier.WEIGHTS, Tier.OPTIMIZER}


def _lora(adapters: int = 1):
    model = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=16, hidden_size=16, dropout=0.0), r=2, dropout=0.0)
    for i in range(1, adapters):
        from peft import LoraConfig

        model.add_adapter(f"extra{i}", LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    return model


def _step(model, opt, *, clip: float | None = None) -> None:
    model(input_ids=TOKENS, labels=TOKENS).loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
    opt.step()
    opt.zero_grad()


def _setup(adapters: int = 1, *, foreach: bool | None = None):
    torch.manual_seed(0)
    model = _lora(adapters)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=foreach)
    _step(model, opt)
    return model, opt


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _opt_state(opt):
    return [t.clone() for t in optimizer_tensors(opt.state_dict())]


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def test_consolidate_moves_values_bit_identically_into_one_buffer_in_walk_order():
    model, opt = _setup()
    params_before, state_before = _trainable(model), _opt_state(opt)
    sd = opt.state_dict()
    assert all(sd["state"][i] is opt.state[p] for i, p in enumerate(opt.param_groups[0]["params"]))
    order = list(trainable_state_dict(model).values())
    flat = consolidate(model, opt, order=order)
    assert flat is not None and flat.intact()
    assert _equal(_trainable(model), params_before) and _equal(_opt_state(opt), state_before)
    # Parameters: one fp32 buffer, views in the weights mapping's order, tiling it exactly.
    (buf,) = flat.param_buffers.values()
    weights = list(trainable_state_dict(model).values())
    offsets = [w.storage_offset() for w in weights]
    assert all(w.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for w in weights)
    assert offsets == [sum(w.numel() for w in weights[:i]) for i in range(len(weights))]
    assert sum(w.numel() for w in weights) == buf.numel()
    # Optimizer state (0-d steps included): one buffer, in state_dict() walk order.
    walk = optimizer_tensors(opt.state_dict())
    (sbuf,) = flat.state_buffers.values()
    assert [t.storage_offset() for t in walk] == [sum(t.numel() for t in walk[:i]) for i in range(len(walk))]
    assert all(t.untyped_storage().data_ptr() == sbuf.untyped_storage().data_ptr() for t in walk)
    assert any(t.dim() == 0 for t in walk)  # AdamW's step counters moved too
    assert all(p.grad is None and isinstance(p, torch.nn.Parameter) for p in flat.params)


@pytest.mark.parametrize("foreach", [False, True])
def test_training_after_consolidation_is_bit_identical(foreach):
    # Several adapters (one trained), gradient clipping, both AdamW implementations.
    a_model, a_opt = _setup(adapters=2, foreach=foreach)
    b_model, b_opt = copy.deepcopy(a_model), None
    b_opt = torch.optim.AdamW([p for p in b_model.parameters() if p.requires_grad], lr=1e-2, foreach=foreach)
    b_opt.load_state_dict(a_opt.state_dict())
    assert consolidate(b_model, b_opt, order=trainable_state_dict(b_model).values()) is not None
    for _ in range(3):
        _step(a_model, a_opt, clip=0.5)
        _step(b_model, b_opt, clip=0.5)
    assert _equal(_trainable(a_model), _trainable(b_model))
    assert _equal(_opt_state(a_opt), _opt_state(b_opt))
    assert torch.equal(a_model(input_ids=TOKENS).logits, b_model(input_ids=TOKENS).logits)


def test_keeper_waits_for_the_optimizer_state_and_moves_again_when_it_is_replaced():
    torch.manual_seed(0)
    model = _lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    keeper = FlatKeeper(model, opt, weights=lambda: trainable_state_dict(model), enabled=True)
    assert keeper.keep() is None and keeper.moves == 0  # no optimizer state before the first step
    _step(model, opt)
    first = keeper.keep()
    assert first is not None and keeper.moves == 1
    assert keeper.keep() is first and keeper.moves == 1  # in place: pointer checks only
    # A resume: load_state_dict replaces every state tensor; the parameters stay where they are.
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    assert not first.intact() and first.params_intact() and not first.state_intact()
    second = keeper.keep()
    assert second is not None and second is not first and keeper.moves == 2 and second.intact()
    assert second.param_buffers is first.param_buffers  # the parameters were not copied again
    assert _equal(_opt_state(opt), [t for t in optimizer_tensors(saved)])
    # A re-assigned parameter is noticed too.
    p = second.params[0]
    p.data = p.data.clone()
    assert not second.intact()
    third = keeper.keep()
    assert third is not None and third.intact() and p.untyped_storage().data_ptr() in {
        b.untyped_storage().data_ptr() for b in third.param_buffers.values()}


def test_default_is_on_only_for_many_small_trainable_tensors():
    lora = _lora()  # 8 adapter tensors: below MIN_TENSORS
    assert not pays(lora) and not FlatKeeper(lora).enabled and FlatKeeper(lora, enabled=True).enabled
    many = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(16)])  # 32 small tensors
    assert pays(many) and FlatKeeper(many).enabled and not FlatKeeper(many, enabled=False).enabled
    big = torch.nn.Sequential(*[torch.nn.Linear(512, 1024, device="meta") for _ in range(16)])
    assert not pays(big)  # 32 tensors, mean just over 1 MiB (a 2 MiB weight and a 4 KiB bias each)
    assert pays(torch.nn.Sequential(*[torch.nn.Linear(511, 1024, device="meta") for _ in range(16)]))  # 1 MiB
    big.requires_grad_(False)
    assert not pays(big)  # nothing trainable


def test_unusual_optimizer_state_is_left_where_it_is():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    for p in model.parameters():
        opt.state[p]["history"] = [torch.zeros(1)]  # not a flat dict of tensors and scalars
    before = {id(p): dict(opt.state[p]) for p in model.parameters()}
    flat = consolidate(model, opt)
    assert flat is not None and flat.entries == [] and flat.optimizer is None and len(flat.params) == 2
    assert all(opt.state[p]["momentum_buffer"] is before[id(p)]["momentum_buffer"] for p in model.parameters())


def test_snapshot_of_a_consolidated_run_is_one_copy_per_scope_with_the_same_content():
    model, opt = _setup(adapters=1)
    twin, twin_opt = copy.deepcopy(model), None
    twin_opt = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2)
    twin_opt.load_state_dict(opt.state_dict())
    consolidate(model, opt, order=trainable_state_dict(model).values())
    states = []
    for m, o in ((twin, twin_opt), (model, opt)):
        snap = Snapshotter()
        live = snap.collect(StateSources(weights=lambda m=m: trainable_state_dict(m), optimizer=o), step=1,
                            epoch=0.0, tiers=W_O)
        states.append(snap.take(live).state)
        plans = snap._plans
    plain, flat = states
    assert _equal(flat.weights, plain.weights)
    assert _equal(tensors_in(flat.optimizer, []), tensors_in(plain.optimizer, []))
    assert flat.optimizer["param_groups"] == plain.optimizer["param_groups"]
    assert [list(e) for e in flat.optimizer["state"].values()] == [list(e) for e in plain.optimizer["state"].values()]
    for scope in ("weights/", "optimizer/"):  # the consolidated run: one copy per scope, no cat
        assert len(plans[scope].now.spans) == 1 and plans[scope].now.cats == [] and plans[scope].now.singles == ([], [])


def test_save_pretrained_of_a_consolidated_model_writes_the_same_tensors(tmp_path):
    # Tensors sharing one storage: safetensors refuses aliases unless the caller de-aliases (PEFT clones,
    # transformers finds disjoint views): check the real files of both.
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, opt = _setup()
    expected = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    assert consolidate(model, opt, order=trainable_state_dict(model).values()) is not None
    model.save_pretrained(tmp_path / "adapter")
    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert list(written) == list(expected) and all(torch.equal(written[k], v) for k, v in expected.items())

    full = toy.tiny_qwen2(seed=0, vocab_size=16, hidden_size=16, dropout=0.0)
    full_opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    _step(full, full_opt)
    before = {k: v.clone() for k, v in full.state_dict().items()}
    flat = consolidate(full, full_opt, order=full.state_dict().values())
    assert flat is not None and len(flat.params) == len(list(full.parameters()))
    full.save_pretrained(tmp_path / "full")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full").state_dict()
    assert list(reloaded) == list(before) and all(torch.equal(reloaded[k], v) for k, v in before.items())


@pytest.mark.parametrize("replan", [True, False])
def test_a_move_plans_the_next_snapshot_ahead_through_on_move(tmp_path, replan):
    from hf_dynamic_ckpt.engine import SaveEngine
    from hf_dynamic_ckpt.store import CheckpointStore

    model, opt = _setup()
    sources = StateSources(weights=lambda: trainable_state_dict(model), optimizer=opt)
    with CheckpointStore(tmp_path) as store, SaveEngine(store, mode="thread") as engine:
        engine.prepare(sources, W_O, wait=True)  # at attach: plans for the tensors as they are
        moved = []
        keeper = FlatKeeper(model, opt, weights=sources.weights, enabled=True, on_move=lambda: (
            moved.append(1), replan and engine.prepare(sources, W_O, wait=True)))
        assert keeper.keep() is not None and moved == [1]
        assert keeper.keep() is not None and moved == [1]  # in place: no move, no call
        snap = engine._snapshotter
        stale = snap.blueprints(snap.collect(sources, step=1, epoch=0.0, tiers=W_O))
        # Replanned: the first save after the move copies through held plans (one span per scope), not new ones.
        assert (stale == {}) if replan else (set(stale) == {"weights/", "optimizer/"})
        if replan:
            spans = {s: p.now.spans for s, p in snap._plans.items()}
            assert all(len(v) == 1 for v in spans.values()), spans
