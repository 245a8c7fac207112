"""`RunOrchestrator` in a plain PyTorch loop (no Trainer): captures, skips, preemption, resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_dynamic_ckpt import CheckpointNotFoundError, SmartCkptConfig
from hf_dynamic_ckpt.run.orchestrator import RunOrchestrator
from hf_dynamic_ckpt.state import apply_optimizer_state, capture_rng_state, fast_forward_scheduler


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.drop(self.lin(x)).pow(2).mean()}


SURGE = 24
"""Steps before a gradient surge: past the policy's warm-up for finite capture triggers
(`policy.rules.CAPTURE_WARMUP`, which needs a `stability_window` at least that long)."""


def make(tmp_path: Path, **cfg: object) -> tuple[RunOrchestrator, Net, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    policy = {"stability_window": 8, **cfg.pop("policy", {})}  # type: ignore[dict-item]
    settings: dict[str, object] = {"base_interval": 1000, **cfg}
    config = SmartCkptConfig(root=str(tmp_path / "store"), policy=policy, **settings)  # type: ignore[arg-type]
    ck = RunOrchestrator(config)
    ck.attach(model, optimizer=opt, scheduler=sched)
    return ck, model, opt, sched


def train_step(ck: RunOrchestrator, model: Net, opt: torch.optim.Optimizer, sched: object, step: int,
               scale: float = 1.0) -> None:
    """One optimizer step; `step` is the number of steps completed before it."""
    ck.step_begin()
    x = torch.randn(4, 8)
    (model(x)["loss"] * scale).backward()
    ck.pre_update(step, epoch=0.0)
    opt.step()
    sched.step()  # type: ignore[attr-defined]
    opt.zero_grad()
    ck.step_end(step + 1, 0.0, lr=opt.param_groups[0]["lr"])


def test_pre_update_capture_saves_the_previous_steps_exact_state(tmp_path: Path) -> None:
    ck, model, opt, sched = make(tmp_path, policy={"stability_window": SURGE})
    boundary = {}
    for step in range(SURGE + 1):
        scale = 1000.0 if step == SURGE else 1.0  # the last step's gradients surge
        if step == SURGE:
            boundary = {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "rng": capture_rng_state()}
        train_step(ck, model, opt, sched, step, scale)
    ck.finish()
    captures = [e for e in ck.events if e.reason.startswith("pre_update")]
    assert [(e.step, e.at_step, e.pinned) for e in captures] == [(SURGE, SURGE + 1, True)]
    loaded = ck.store.load(f"step:{SURGE}")
    assert loaded.info.pinned
    for key, value in boundary["weights"].items():
        assert torch.equal(loaded.weights[key], value)
    assert loaded.rng == boundary["rng"]  # the RNG of the end of the step before, not after the surge's dropout
    assert loaded.optimizer["state"][0]["step"].item() == float(SURGE)
    ck.close()


def test_skip_bad_update_drops_the_gradients(tmp_path: Path) -> None:
    ck, model, opt, sched = make(tmp_path, policy={"skip_bad_update": True, "stability_window": SURGE})
    for step in range(SURGE):
        train_step(ck, model, opt, sched, step)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(ck, model, opt, sched, SURGE, scale=1000.0)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the surging update was not applied
    ck.close()


def test_preemption_flag_commits_synchronously_and_stops(tmp_path: Path) -> None:
    ck, model, opt, sched = make(tmp_path)
    for step in range(3):
        train_step(ck, model, opt, sched, step)
    assert not ck.preempted
    assert ck.preemption_flag is not None
    ck.preemption_flag.set()
    train_step(ck, model, opt, sched, 3)
    assert ck.preempted and ck.last_decision is not None and ck.last_decision.reason == "preemption"
    info = ck.store.resolve("step:4")  # committed before step_end returned
    assert info.reason.startswith("emergency: preemption")
    metrics = ck.metrics()
    assert metrics["smart_ckpt/last_save_step"] == 4.0 and metrics["smart_ckpt/saves"] == 1.0
    assert metrics["smart_ckpt/stall_ms"] > 0
    assert ck.metrics()["smart_ckpt/stall_ms"] == 0.0  # stall is reported since the previous call
    ck.close()


def test_resume_loads_back_into_live_objects(tmp_path: Path) -> None:
    ck, model, opt, sched = make(tmp_path)
    for step in range(4):
        train_step(ck, model, opt, sched, step)
    ck.save_now(4, 0.0, reason="manual")
    saved_opt = opt.state_dict()
    saved_lr = opt.param_groups[0]["lr"]
    ck.close()
    ck2, _, opt2, sched2 = make(tmp_path)
    loaded = ck2.resume("auto")
    assert loaded is not None and loaded.info.step == 4
    apply_optimizer_state(loaded, optimizer=opt2, scheduler=sched2)
    assert opt2.param_groups[0]["lr"] == saved_lr
    for k, s in saved_opt["state"].items():
        for name, t in s.items():
            assert torch.equal(opt2.state_dict()["state"][k][name], t)
    ck2.close()


def test_resume_auto_on_empty_store_is_a_fresh_start_and_step_n_must_exist(tmp_path: Path) -> None:
    ck, *_ = make(tmp_path)
    assert ck.resume("auto") is None
    assert ck.resume(None) is None
    with pytest.raises(CheckpointNotFoundError, match="step 7"):
        ck.resume("step:7")
    ck.close()


def test_lost_optimizer_fast_forwards_the_schedule_and_warns(tmp_path: Path) -> None:
    ck, model, opt, sched = make(tmp_path)
    for step in range(5):
        train_step(ck, model, opt, sched, step)
    ck.save_now(5, 0.0, reason="weights only", tiers=["weights", "state"])
    expected_lr = opt.param_groups[0]["lr"]
    ck.close()
    ck2, _, opt2, sched2 = make(tmp_path)
    loaded = ck2.resume("step:5")
    assert loaded is not None and loaded.optimizer is None
    with pytest.warns(UserWarning, match="optimizer state \\(L1\\) not restored"):
        apply_optimizer_state(loaded, optimizer=opt2, scheduler=sched2)
    assert math.isclose(opt2.param_groups[0]["lr"], expected_lr, rel_tol=0, abs_tol=0)
    assert opt2.state_dict()["state"] == {}
    ck2.close()


@pytest.mark.parametrize("kind", ["lambda", "step"])
def test_fast_forward_scheduler_equals_stepping(kind: str) -> None:
    def build() -> tuple[torch.optim.Optimizer, object]:
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        if kind == "lambda":
            return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.9**s)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    opt_a, a = build()
    for _ in range(11):
        opt_a.step()
        a.step()  # type: ignore[attr-defined]
    opt_b, b = build()
    fast_forward_scheduler(b, 11)
    assert b.state_dict() == a.state_dict()  # type: ignore[attr-defined]
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]


def test_lr_surge_triggers_a_pinned_pre_update_capture(tmp_path: Path) -> None:
    ck, model, opt, sched = make(tmp_path)
    for step in range(9):
        train_step(ck, model, opt, sched, step)
    boundary = {k: v.clone() for k, v in model.state_dict().items()}
    history_max = max(ck.policy.baselines.lr)
    for group in opt.param_groups:
        group["lr"] *= 100.0  # a schedule bug: step 10's update would use 100x the rate
    surged = opt.param_groups[0]["lr"]
    train_step(ck, model, opt, sched, 9)  # ordinary gradients and loss: only the rate jumps
    ck.finish()
    captures = [(e.step, e.at_step, e.pinned, e.reason) for e in ck.events if e.reason.startswith("pre_update")]
    assert captures == [(9, 10, True, f"pre_update lr_surge x{surged / history_max:.1f}")]
    loaded = ck.store.load("step:9")
    assert loaded.info.pinned
    assert all(torch.equal(loaded.weights[k], v) for k, v in boundary.items())  # the state before the surge
    ck.close()


def test_default_weights_source_is_cached_and_sees_a_replaced_parameter(tmp_path: Path) -> None:
    from hf_dynamic_ckpt.state import CachedWeights

    ck, model, opt, sched = make(tmp_path)
    source = ck._sources.weights
    assert isinstance(source, CachedWeights)
    first = source()
    assert source() is first  # built once, revalidated on later calls
    train_step(ck, model, opt, sched, 0)
    assert source() is first  # in-place updates keep the mapping valid
    ck.save_now(1, 0.0)
    assert torch.equal(ck.store.load("step:1").weights["lin.weight"], model.lin.weight.detach())
    model.lin.weight = nn.Parameter(torch.full((8, 8), 3.0))  # e.g. a load that re-assigns the parameter
    assert source() is not first
    ck.save_now(2, 0.0)
    assert torch.equal(ck.store.load("step:2").weights["lin.weight"], torch.full((8, 8), 3.0))
    ck.close()


def _data_step(ck: RunOrchestrator, model: Net, opt: torch.optim.Optimizer, sched: object, step: int,
               seed: int) -> None:
    """`train_step` on data fixed by (`seed`, `step`): two timelines see different batches."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ck.step_begin()
    model(torch.randn(4, 8, generator=g))["loss"].backward()
    ck.pre_update(step, epoch=0.0)
    opt.step()
    sched.step()  # type: ignore[attr-defined]
    opt.zero_grad()
    ck.step_end(step + 1, 0.0)


def _resume_into(ck: RunOrchestrator, spec: str, model: Net, opt: torch.optim.Optimizer, sched: object) -> int:
    from hf_dynamic_ckpt.state import apply_weights, restore_rng_state

    loaded = ck.resume(spec)
    assert loaded is not None
    apply_weights(model, loaded.weights)
    apply_optimizer_state(loaded, optimizer=opt, scheduler=sched)
    restore_rng_state(loaded.rng)
    return loaded.info.step


def test_resume_from_an_older_step_abandons_the_newer_timeline(tmp_path: Path) -> None:
    # Timeline A: steps 1..6, saved at 2, 4, 6.
    ck, model, opt, sched = make(tmp_path)
    for step in range(6):
        _data_step(ck, model, opt, sched, step, seed=1)
        if (step + 1) % 2 == 0:
            ck.save_now(step + 1, 0.0)
    a6 = {k: v.clone() for k, v in model.state_dict().items()}
    ck.close()

    # Timeline B: resume from step 2, other data, save at 3 and at 4 (a step A also saved), then crash.
    ck, model, opt, sched = make(tmp_path)
    assert _resume_into(ck, "step:2", model, opt, sched) == 2
    every = {i.step: i.abandoned for i in ck.store.list(include_unhealthy=True, include_abandoned=True)}
    assert every == {6: False, 4: False, 2: False}  # a resume that has not trained yet changes nothing
    with pytest.warns(UserWarning, match=r"checkpoints 4, 6 belong to a run that went past the restore point "
                                         r"\(step 2\); they are kept but abandoned"):
        _data_step(ck, model, opt, sched, 2, seed=2)  # it trains: its timeline is the task's from now on
    assert [i.step for i in ck.store.list(include_unhealthy=True)] == [2]  # auto/best/fastest see only this
    every = {i.step: i.abandoned for i in ck.store.list(include_unhealthy=True, include_abandoned=True)}
    assert every == {6: True, 4: True, 2: False}  # nothing deleted
    ck.save_now(3, 0.0)
    _data_step(ck, model, opt, sched, 3, seed=2)
    ck.save_now(4, 0.0)
    # What uninterrupted training of timeline B does next.
    for step in range(4, 6):
        _data_step(ck, model, opt, sched, step, seed=2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = opt.state_dict()
    ck.close()

    ck, model, opt, sched = make(tmp_path)
    assert _resume_into(ck, "auto", model, opt, sched) == 4  # B's step 4 (it replaced A's), not A's step 6
    for step in range(4, 6):
        _data_step(ck, model, opt, sched, step, seed=2)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    for k, st in expected_opt["state"].items():
        for name, t in st.items():
            assert torch.equal(opt.state_dict()["state"][k][name], t)
    # A's abandoned step 6 is still there and restorable by name.
    assert all(torch.equal(ck.store.load("step:6").weights[k], v) for k, v in a6.items())
    ck.close()


def test_resume_never_deletes_and_retention_waits_until_the_new_timeline_passes(tmp_path: Path) -> None:
    ck, model, opt, sched = make(tmp_path, keep_last=3)
    for step in range(6):  # A: 2, 4 (pinned), 6
        _data_step(ck, model, opt, sched, step, seed=1)
        if (step + 1) % 2 == 0:
            ck.save_now(step + 1, 0.0, pin=step + 1 == 4)
    ck.close()
    ck, model, opt, sched = make(tmp_path, keep_last=1, policy={"keep_log_spaced": False})
    _resume_into(ck, "step:2", model, opt, sched)

    def steps() -> dict[int, bool]:
        ck.finish()
        return {i.step: i.abandoned for i in ck.store.list(include_unhealthy=True, include_abandoned=True)}

    for step in range(2, 7):  # B saves 3 and 5: A's 6 is not passed yet, so retention keeps it
        if step == 2:
            with pytest.warns(UserWarning, match="checkpoints 4, 6 belong to a run that went past"):
                _data_step(ck, model, opt, sched, step, seed=2)  # set aside when B first trains
        else:
            _data_step(ck, model, opt, sched, step, seed=2)
        if step + 1 in (3, 5):
            ck.save_now(step + 1, 0.0)
    assert steps() == {6: True, 5: False, 4: True}  # keep_last=1 removed B's 3 and A's own 2, never 4 or 6
    ck.save_now(7, 0.0)  # B passes 6: the abandoned 6 goes; the pinned abandoned 4 stays
    assert steps() == {7: False, 4: True}
    ck.close()


@pytest.mark.parametrize(("engine", "codec"), [("sync", "none"), ("process", "none"), ("sync", "zstd")])
def test_level_1_codec_from_config_reaches_the_written_file(tmp_path: Path, engine: str, codec: str) -> None:
    from hf_dynamic_ckpt.constants import OPTIMIZER_NAME
    from hf_dynamic_ckpt.store.optpack import read_header

    ck, model, opt, sched = make(tmp_path, engine=engine,
                                 storage_levels={"level_1": {"compression": codec}})
    if engine == "process":
        assert ck.engine.start(wait_s=120)
    for step in range(3):
        train_step(ck, model, opt, sched, step)
    ck.save_now(3, 0.0, blocking=False)
    ck.finish()
    ck.close()
    assert ck.events[-1].path is not None and ck.events[-1].handle is None  # committed, settled
    path = Path(ck.events[-1].path) / OPTIMIZER_NAME
    with path.open("rb") as f:
        header, _, _ = read_header(f, path)
    assert header["codec"] == codec


def test_the_save_side_starts_after_the_first_step_and_after_a_background_optimizer_read(
        tmp_path: Path, monkeypatch) -> None:
    # Resume speed: starting the writer process competed with the L1 read and with the first step.
    # A resume only reads: no engine until the first step has ended, and none while the optimizer tier is read.
    import threading

    from hf_dynamic_ckpt.engine import SaveEngine

    prepared: list[int] = []
    real_start = SaveEngine.start

    def start(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        prepared.append(1)
        return real_start(self, *args, **kwargs)

    monkeypatch.setattr(SaveEngine, "start", start)

    ck, model, opt, sched = make(tmp_path)
    assert prepared == [] and not ck.started  # attached, not stepped yet
    for step in range(2):
        train_step(ck, model, opt, sched, step)
    assert prepared[:1] == [1]  # at the end of the first step (a save calls it again: idempotent)
    ck.save_now(2, 0.0, reason="manual")
    ck.close()
    torch.manual_seed(1)
    model2 = Net()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
    ck2 = RunOrchestrator(SmartCkptConfig(root=str(tmp_path / "store"), base_interval=1000,
                                          policy={"stability_window": 8}))
    prepared.clear()
    from hf_dynamic_ckpt.run import resume as resume_module

    real_read = resume_module.read_optimizer_tier
    gate = threading.Event()
    monkeypatch.setattr(resume_module, "read_optimizer_tier", lambda *args: gate.wait(60) and real_read(*args))
    loaded = ck2.resume("step:2", background_optimizer=True)
    assert loaded is not None and loaded.optimizer is None
    ck2.attach(model2, optimizer=opt2, scheduler=sched2)
    assert prepared == [] and not ck2.started  # the resume read, built no save side
    gate.set()
    ck2.complete_resume(loaded)
    assert prepared == [] and loaded.optimizer is not None and not ck2.started  # the first step first
    train_step(ck2, model2, opt2, sched2, 2)
    assert prepared == [1] and ck2.started
    ck2.attach(model2, optimizer=opt2, scheduler=sched2)  # after the first step: the writer runs already
    assert prepared[0] == 1 and ck2.engine.writer_pid is not None
    ck2.close()


