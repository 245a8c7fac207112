"""The data position of an Accelerate loop on another number of processes (`integrations.position`) and the
plan of such a resume (`integrations.accelerate.apply_elastic`): kept in samples of the epoch's order, rounded down with
a warning, rank 0's epoch start for a rank the checkpoint had not, the order warning only where the order differs,
the scheduler's pace."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from hf_dynamic_ckpt.config import SmartCkptConfig
from hf_dynamic_ckpt.errors import GlobalBatchError
from hf_dynamic_ckpt.integrations.accelerate import apply_elastic, keep_pace, natural_pace
from hf_dynamic_ckpt.integrations.position import (
    BatchGeometry,
    ResumableLoader,
    deals_batches,
    order_note,
    per_device_batch,
    rescale_batches_seen,
)
from hf_dynamic_ckpt.state import capture_rng_state


def test_rescale_keeps_the_position_in_samples_of_the_order() -> None:
    two, one = BatchGeometry(2, 2, 2), BatchGeometry(2, 1, 4)
    # 6 batches on each of 2 ranks = 24 samples = 12 batches of one process.
    assert rescale_batches_seen(6, two, one, dealt=True) == (12, 0)
    assert rescale_batches_seen(12, one, two, dealt=True) == (6, 0)
    # 4 -> 2 processes with the per-device batch halved: the same samples per rank.
    assert rescale_batches_seen(5, BatchGeometry(2, 4, 1), BatchGeometry(4, 2, 1), dealt=True) == (5, 0)
    # 5 batches of 2 x 3 = 30 samples; batches of 1 x 4: 7 of them (28), the last 2 samples read again.
    assert rescale_batches_seen(5, BatchGeometry(3, 2, 1), BatchGeometry(4, 1, 1), dealt=True) == (7, 2)
    # A loader that gives every rank every batch: the number of processes does not count.
    assert rescale_batches_seen(6, BatchGeometry(4, 2, 1), BatchGeometry(4, 1, 1), dealt=False) == (6, 0)
    assert rescale_batches_seen(3, BatchGeometry(4, 2, 1), BatchGeometry(8, 1, 1), dealt=False) == (1, 4)


@pytest.fixture()
def accelerator():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    yield acc
    acc.gradient_accumulation_steps = 1  # the gradient state is a process-wide singleton


def _loader(accelerator, *, batch_size: int = 2, n: int = 40, generator: torch.Generator | None = None,
            shuffle: bool = True):
    data = torch.utils.data.TensorDataset(torch.arange(n))
    return accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=shuffle,
                                                           generator=generator))


def _saved_by_two(position: dict, *, seen: int, per_device: int) -> dict:
    """`position` as a run of 2 processes (per-device batch `per_device`, accumulation 2) would have stored it."""
    return {**position, "batches_seen": seen, "world_size": 2,
            "batch": {"per_device": per_device, "world_size": 2, "accumulation": 2},
            "epoch_start_rng": [position["epoch_start_rng"][0], capture_rng_state()]}


def test_a_position_of_two_processes_resumes_on_one_in_samples(accelerator,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    dl = _loader(accelerator, generator=torch.Generator().manual_seed(3))
    assert deals_batches(dl) and per_device_batch(dl) == 2
    loader = ResumableLoader(accelerator, dl)
    it = iter(loader)
    order = [int(x) for _ in range(3) for x in next(it)[0]]
    position = loader.position()
    assert position["batch"] == {"per_device": 2, "world_size": 1, "accumulation": 1} and position["dealt"] is True
    # 3 batches per rank of 2 processes x 2 = 12 samples: 6 batches of this process.
    saved = _saved_by_two(position, seen=3, per_device=2)
    fresh = ResumableLoader(accelerator, _loader(accelerator, generator=torch.Generator().manual_seed(3)))
    with caplog.at_level(logging.INFO, logger="hf_dynamic_ckpt"):
        fresh.resume_from(saved, rng=None)
    assert fresh.batches_seen == 6 and fresh.position()["batches_seen"] == 6
    assert "sample 12 of epoch 0's order; resumed as 6 batch(es) per rank" in caplog.text
    assert "read" not in caplog.text and "main random stream" not in caplog.text  # a generator orders the epoch
    # The epoch continues at sample 12 of the same order (the generator's state at the epoch start).
    rest = [int(x) for batch in fresh for x in batch[0]]
    full = order + [int(x) for batch in it for x in batch[0]]
    assert rest == full[12:]


def test_rounding_down_says_how_many_samples_are_read_again(accelerator, caplog: pytest.LogCaptureFixture) -> None:
    dl = _loader(accelerator, batch_size=4, generator=torch.Generator().manual_seed(3))
    loader = ResumableLoader(accelerator, dl)
    it = iter(loader)
    next(it)
    # 5 batches per rank of 2 processes x 3 = 30 samples: 7 batches of 4 (28), samples 29..30 read again.
    saved = _saved_by_two(loader.position(), seen=5, per_device=3)
    fresh = ResumableLoader(accelerator, _loader(accelerator, batch_size=4, generator=torch.Generator().manual_seed(3)))
    with caplog.at_level(logging.WARNING, logger="hf_dynamic_ckpt"):
        fresh.resume_from(saved, rng=None)
    assert fresh.batches_seen == 7
    assert ("data position: sample 30 of epoch 0's order is not a whole batch of 4 sample(s) on 1 process(es) x 4 "
            "per device: the resumed run reads the last 2 sample(s) before it again") in caplog.text


def test_only_an_order_from_the_main_stream_is_said_to_differ(accelerator, caplog: pytest.LogCaptureFixture) -> None:
    plain = _loader(accelerator)
    # One process: accelerate gives the shuffling sampler no generator; its order comes from the main stream.
    assert order_note(plain, saved_generator=True) is not None
    assert order_note(_loader(accelerator, generator=torch.Generator()), saved_generator=True) is None
    assert order_note(_loader(accelerator, generator=torch.Generator()), saved_generator=False) is not None
    assert order_note(_loader(accelerator, shuffle=False), saved_generator=False) is None
    loader = ResumableLoader(accelerator, plain)
    it = iter(loader)
    next(it)
    saved = _saved_by_two(loader.position(), seen=2, per_device=2)
    with caplog.at_level(logging.WARNING, logger="hf_dynamic_ckpt"):
        ResumableLoader(accelerator, _loader(accelerator)).resume_from(saved, rng=None)
    assert ("data position: saved by 2 process(es), resumed by 1, and the sampler draws the epoch's order from the "
            "main random stream") in caplog.text
    assert "use_seedable_sampler=True" in caplog.text


def test_the_seedable_sampler_orders_alike_on_any_number_of_processes() -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    assert order_note(_loader(acc), saved_generator=False) is None


def test_a_rank_the_checkpoint_had_not_starts_the_epoch_from_rank_0s_state(
        accelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_dynamic_ckpt import distributed as dist

    loader = ResumableLoader(accelerator, _loader(accelerator))
    it = iter(loader)
    next(it)
    position = loader.position()
    rest = [int(x) for batch in it for x in batch[0]]
    monkeypatch.setattr(dist, "rank", lambda: 1)  # rank 1 of a resume on more processes than the checkpoint's
    fresh = ResumableLoader(accelerator, _loader(accelerator))
    fresh.resume_from(position, rng=None)
    monkeypatch.undo()
    torch.manual_seed(1234)  # whatever this process's stream is now: the epoch starts from rank 0's state
    assert [int(x) for batch in fresh for x in batch[0]] == rest


def test_the_scheduler_keeps_the_pace_of_the_run_it_continues(accelerator) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=10)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    assert natural_pace(sched, 1) == 1 and natural_pace(sched, 2) == 2 and natural_pace(object(), 2) is None
    keep_pace(sched, 2)  # a checkpoint of 2 processes: 2 scheduler steps per optimizer step
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    sched.step()
    assert sched.scheduler.last_epoch == 2


def _loaded(sampler: dict, *, world_size: int, step: int = 6, pace: int | None = None) -> SimpleNamespace:
    extra = {"accelerate": {"scheduler_pace": pace}} if pace is not None else {}
    return SimpleNamespace(sampler=sampler, info=SimpleNamespace(world_size=world_size, step=step), extra=extra)


def _plan(accelerator, loader, loaded, *, keep: bool = True, pace: int | None = None,
          caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    """`apply_elastic` of `loaded` on one process; the lines it logs (level, message)."""
    run = SimpleNamespace(world_size=1, rank=0, announce=logging.getLogger("hf_dynamic_ckpt.test"),
                          config=SmartCkptConfig(runtime={"keep_global_batch": keep}))
    sched = SimpleNamespace(step=None)
    state = SimpleNamespace(loader=loader, scheduler_pace=pace, scheduler=sched)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_dynamic_ckpt.test"):
        apply_elastic(loaded, state=state, run=run, accelerator=accelerator)  # type: ignore[arg-type]
    return [(r.levelno, r.getMessage().removeprefix("smart_ckpt: ")) for r in caplog.records]


def test_the_plan_keeps_the_global_batch_and_says_what_differs(accelerator, caplog, monkeypatch) -> None:
    import hf_dynamic_ckpt.integrations.accelerate as acc_module

    monkeypatch.setattr(acc_module, "keep_pace", lambda scheduler, pace: None)  # a stand-in scheduler
    loader = ResumableLoader(accelerator, _loader(accelerator))
    saved = {"batch": {"per_device": 2, "world_size": 2, "accumulation": 2}, "dealt": True, "draws_random": True}
    lines = _plan(accelerator, loader, _loaded(saved, world_size=2, pace=2), pace=1, caplog=caplog)
    assert accelerator.gradient_accumulation_steps == 4
    levels = [level for level, _ in lines]
    texts = " | ".join(line for _, line in lines)
    assert levels == [logging.INFO, logging.WARNING, logging.INFO]
    assert "gradient_accumulation_steps 1 -> 4: the same samples per optimizer step" in texts
    assert "each rank draws its own masks" in texts and "keeps the pace of the run it continues" in texts
    # A loader that gives every rank every batch: its global batch does not depend on the number of processes.
    accelerator.gradient_accumulation_steps = 2  # the same command as the checkpoint's
    assert _plan(accelerator, loader, _loaded({**saved, "dealt": False}, world_size=2), caplog=caplog) == []
    assert accelerator.gradient_accumulation_steps == 2
    with pytest.raises(GlobalBatchError):  # 3 samples per step: no accumulation of batches of 2 gives them
        _plan(accelerator, loader, _loaded({**saved, "batch": {"per_device": 1, "world_size": 3, "accumulation": 1}},
                                           world_size=3), caplog=caplog)


def test_accepting_another_global_batch_warns_that_the_position_stays_in_samples(accelerator, caplog) -> None:
    loader = ResumableLoader(accelerator, _loader(accelerator))
    accelerator.gradient_accumulation_steps = 2
    saved = {"batch": {"per_device": 2, "world_size": 2, "accumulation": 2}, "dealt": True, "draws_random": False}
    lines = _plan(accelerator, loader, _loaded(saved, world_size=2), keep=False, caplog=caplog)
    assert accelerator.gradient_accumulation_steps == 2
    assert lines == [(logging.WARNING, (
        "step 6 was saved with a global batch of 2 process(es) x 2 per device x 2 accumulation = 8 and is resumed "
        "with 1 process(es) x 2 per device x 2 accumulation = 4 (runtime.keep_global_batch=false): every optimizer "
        "step from here on averages 4 samples instead of 8; the step count and the learning-rate schedule's "
        "position stay in optimizer steps, the data position in samples of its order"))]
