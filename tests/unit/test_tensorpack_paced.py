"""A paced L1 write: no faster than the disk, and no slower either.

`HashingWriter(paced=True)` waits, after each writeback request, for the bytes
`PACE_WINDOW` behind the end to be on disk, and records whether that wait blocked. While it
does not (the disk waits for the writer), `write_tensor_file(paced=True)` stores the parts
that compress slowly raw. The disk's speed is simulated here by the time `wait_written` takes.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from helpers import save_state
from test_tensorpack_v3 import _assert_same, _frames, _table

import hf_dynamic_ckpt.store.tensorpack as tp
from hf_dynamic_ckpt.store.hashing import file_checksum
from hf_dynamic_ckpt.store import (
    HashingWriter,
    read_header,
    read_tensor_file,
    wait_written,
    write_tensor_file,
)


def _disk(monkeypatch: pytest.MonkeyPatch, seconds: list[float] | float,
          work_s: float = 0.0) -> list[tuple[int, int]]:
    """Every writeback request succeeds; each wait takes the next of `seconds` (or always `seconds`).

    The writer's clock is simulated (`tp.time.perf_counter`): the writer takes `work_s` per
    writeback request and each wait its `seconds`, whatever the machine's load.
    """
    waits: list[tuple[int, int]] = []
    clock = [0.0]

    def writeback(fd: int, off: int, n: int) -> bool:
        clock[0] += work_s
        return True

    monkeypatch.setattr(tp, "start_writeback", writeback)
    monkeypatch.setattr(tp, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def wait(fd: int, off: int, n: int) -> bool:
        waits.append((off, n))
        clock[0] += seconds[len(waits) - 1] if isinstance(seconds, list) else seconds
        return True

    monkeypatch.setattr(tp, "wait_written", wait)
    return waits


def test_paced_writer_waits_for_the_range_a_window_behind_and_tells_who_set_the_pace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "WRITEBACK_BYTES", 1000)
    monkeypatch.setattr(tp, "PACE_WINDOW", 3000)
    # The writer works 2 ms per 1000 bytes; two waits of 50 ms block, then the disk is already done.
    waits = _disk(monkeypatch, [0.05, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0], work_s=0.002)
    seen = []
    with open(tmp_path / "f", "wb") as raw:
        w = HashingWriter(raw, paced=True)
        assert not w.disk_bound  # before any wait: as fast as the writer can, until the disk shows it is behind
        for _ in range(10):
            w.write(b"x" * 1000)
            seen.append(w.disk_bound)
    # After 4000 bytes the first 1000 must be on disk, then each further 1000, in order, none twice.
    assert waits == [(0, 1000), (1000, 1000), (2000, 1000), (3000, 1000), (4000, 1000), (5000, 1000), (6000, 1000)]
    # The share of time spent waiting since the previous wait (50/58 ms, then 50/52 ms), averaged, halved at
    # each wait: 0 before, then ~0.43, ~0.70, ~0.35, ~0.17, ...: one blocking wait is not enough, two are, one
    # free wait undoes them.
    assert seen == [False, False, False, False, True, False, False, False, False, False]
    assert w.disk_wait_s == pytest.approx(0.1)  # the two blocking waits, nothing else
    assert w.checksum() == file_checksum(tmp_path / "f")


def test_unpaced_writer_never_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "WRITEBACK_BYTES", 1000)
    monkeypatch.setattr(tp, "PACE_WINDOW", 1000)
    waits = _disk(monkeypatch, 0.0)
    with open(tmp_path / "f", "wb") as raw:
        w = HashingWriter(raw)
        for _ in range(10):
            w.write(b"x" * 1000)
    assert waits == [] and w.disk_bound and w.disk_wait_s == 0.0


def test_pacing_stops_where_the_wait_is_unsupported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "WRITEBACK_BYTES", 1000)
    monkeypatch.setattr(tp, "PACE_WINDOW", 1000)
    monkeypatch.setattr(tp, "start_writeback", lambda fd, off, n: True)
    calls = []
    monkeypatch.setattr(tp, "wait_written", lambda fd, off, n: calls.append(n) or False)
    with open(tmp_path / "f", "wb") as raw:
        w = HashingWriter(raw, paced=True)
        for _ in range(10):
            w.write(b"x" * 1000)
    assert calls == [1000]  # asked once, then never again
    assert w.disk_bound  # cannot tell who sets the pace: compress, as unpaced


def test_a_paced_writer_without_writeback_requests_behaves_as_unpaced(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "WRITEBACK_BYTES", 1000)
    with open(tmp_path / "f", "wb") as raw:
        monkeypatch.setattr(tp, "_sync_file_range", False)  # no sync_file_range (not Linux)
        assert HashingWriter(raw, paced=True).disk_bound
        monkeypatch.setattr(tp, "_sync_file_range", None)
        monkeypatch.setattr(tp, "start_writeback", lambda fd, off, n: False)  # the request fails
        w = HashingWriter(raw, paced=True)
        assert not w.disk_bound
        w.write(b"x" * 1000)
        assert w.disk_bound  # every part that compresses is compressed, as unpaced


def test_wait_written_on_a_real_file(tmp_path: Path) -> None:
    import sys

    with open(tmp_path / "f", "wb") as f:
        f.write(b"y" * 65536)
        f.flush()
        waited = wait_written(f.fileno(), 0, 65536)
        assert wait_written(f.fileno(), 0, 0) is False
    assert waited is sys.platform.startswith("linux")
    assert (tmp_path / "f").read_bytes() == b"y" * 65536


def _state() -> dict[str, torch.Tensor]:
    """Frames of dense fp32 (the exponent plane compresses slowly, the rest not at all) and of zeros."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for i in range(6):
        out[f"dense{i}"] = torch.randn(1 << 18, generator=g)  # 1 MiB: planes of 256 KiB, 256 KiB, 512 KiB
        out[f"zeros{i}"] = torch.zeros(1 << 18)
    return out


def _kinds_by_frame(path: Path) -> list[list[int]]:
    """The part kinds of each frame, in file order (here a frame is one tensor: top, second and low planes)."""
    return [[kind for kind, _, _, _ in _table(frame)] for frame in _frames(path)]


@pytest.fixture
def small_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "FRAME_BYTES", 1 << 20)  # one tensor per frame
    monkeypatch.setattr(tp, "WRITEBACK_BYTES", 64 << 10)
    monkeypatch.setattr(tp, "PACE_WINDOW", 128 << 10)


@pytest.mark.parametrize("threads", [1, 2])
def test_while_the_disk_waits_slow_parts_are_stored_raw_and_zeros_still_compressed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_frames: None, threads: int) -> None:
    _disk(monkeypatch, 0.0, work_s=0.001)  # a disk that is never behind, whatever holds the GIL meanwhile
    tensors = _state()
    paced, plain = tmp_path / "paced.bin", tmp_path / "plain.bin"
    write_tensor_file(tensors, paced, level=1, threads=threads, paced=True)
    write_tensor_file(tensors, plain, level=1, threads=threads)
    frames = _kinds_by_frame(paced)
    assert len(frames) == 12 and all(len(kinds) == 3 for kinds in frames)
    dense, zeros = frames[0::2], frames[1::2]
    assert all(kinds[1:] == [tp.PART_RAW] * 2 for kinds in dense)  # random bytes: raw in any case
    assert [kinds[0] for kinds in dense] == [tp.PART_RAW] * 6  # the exponent plane: raw, which costs no CPU
    assert zeros == [[tp.PART_ZSTD] * 3] * 6  # compresses faster than it would be written: always
    assert all(kinds[0] == tp.PART_ZSTD for kinds in _kinds_by_frame(plain)[0::2])
    assert plain.stat().st_size < paced.stat().st_size < sum(t.numel() * 4 for t in tensors.values())
    for path in (paced, plain):
        _assert_same(read_tensor_file(path), tensors)


def test_once_the_disk_sets_the_pace_the_paced_file_is_the_unpaced_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_frames: None) -> None:
    waits = _disk(monkeypatch, 0.01, work_s=0.001)  # every wait blocks: the writer is ahead of the disk
    tensors = _state()
    paced, plain = tmp_path / "paced.bin", tmp_path / "plain.bin"
    write_tensor_file(tensors, paced, level=1, threads=1, paced=True)
    assert len(waits) > 10  # the write was paced
    write_tensor_file(tensors, plain, level=1, threads=1)
    frames = _kinds_by_frame(paced)
    assert frames[0] == [tp.PART_RAW] * 3  # encoded before the first wait: as fast as possible
    assert frames[1:] == _kinds_by_frame(plain)[1:]  # then every part that compresses, as unpaced
    assert _frames(paced)[1:] == _frames(plain)[1:]
    _assert_same(read_tensor_file(paced), tensors)


def test_only_a_compressed_write_is_paced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          small_frames: None) -> None:
    waits = _disk(monkeypatch, 0.0)
    tensors = _state()
    path = tmp_path / "t.bin"
    write_tensor_file(tensors, path, paced=True, compression="none")
    _assert_same(read_tensor_file(path, copy=True), tensors)
    assert waits == []


def _grouped(path: Path) -> list[bool]:
    return [e["byte_grouped"] for e in read_header(path)[0]["tensors"]]


def test_after_a_write_the_disk_never_held_up_the_next_groups_only_where_it_pays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_frames: None) -> None:
    waits = _disk(monkeypatch, 0.0, work_s=0.001)  # a disk that is never behind
    tensors = _state()
    pace = tp.PaceMemory()
    first, second = tmp_path / "1.bin", tmp_path / "2.bin"
    write_tensor_file(tensors, first, level=1, threads=1, paced=True, pace=pace)
    assert len(waits) > 10 and _grouped(first) == [True] * 12 and pace.group is False
    write_tensor_file(tensors, second, level=1, threads=1, paced=True, pace=pace)
    # Dense moments: their planes were stored raw anyway. Zeros: compressed ungrouped as well.
    assert _grouped(second) == [False] * 12 and pace.group is False
    dense, zeros = _kinds_by_frame(second)[0::2], _kinds_by_frame(second)[1::2]
    assert dense == [[tp.PART_RAW]] * 6 and zeros == [[tp.PART_ZSTD]] * 6
    assert abs(second.stat().st_size - first.stat().st_size) <= 0.01 * first.stat().st_size
    _assert_same(read_tensor_file(second), tensors)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_disk_that_held_the_write_up_brings_byte_grouping_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_frames: None, threads: int) -> None:
    waits = _disk(monkeypatch, 0.01, work_s=0.001)  # every wait blocks: the disk sets the pace
    tensors = _state()
    pace = tp.PaceMemory()
    pace.learn(False)  # as after a write on a fast disk
    slow, after = tmp_path / "1.bin", tmp_path / "2.bin"
    write_tensor_file(tensors, slow, level=1, threads=threads, paced=True, pace=pace)
    assert len(waits) >= 5 and _grouped(slow) == [False] * 12  # decided before the write: by the last one
    assert pace.group is True
    write_tensor_file(tensors, after, level=1, threads=threads, paced=True, pace=pace)
    assert _grouped(after) == [True] * 12 and pace.group is True
    for path in (slow, after):
        _assert_same(read_tensor_file(path), tensors)


def test_a_short_hold_up_or_a_write_too_short_to_tell_does_not_bring_grouping_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_frames: None) -> None:
    tensors = _state()
    pace = tp.PaceMemory()
    pace.learn(False)
    waits = _disk(monkeypatch, [0.002, 0.002] + [0.0] * 100, work_s=0.001)  # behind twice, then never
    path = tmp_path / "t.bin"
    write_tensor_file(tensors, path, level=1, threads=1, paced=True, pace=pace)
    assert len(waits) >= 5 and pace.group is False  # judged on the whole write, not on its worst moment
    monkeypatch.setattr(tp, "PACE_WINDOW", 64 << 20)  # now the file is under one window: no wait at all
    waits.clear()
    pace.learn(True)
    write_tensor_file(tensors, path, level=1, threads=1, paced=True, pace=pace)
    assert waits == [] and pace.group is True  # nothing learnt: the memory stays as it was
    pace.learn(False)
    write_tensor_file(tensors, path, level=1, threads=1, paced=True, pace=pace)
    assert pace.group is False


def test_grouping_pays_where_only_a_grouped_plane_compresses_in_a_hurry() -> None:
    import zstandard

    cctx = zstandard.ZstdCompressor(compression_params=tp.compression_params(1))
    g = torch.Generator().manual_seed(0)
    n = 1 << 19  # 2 MiB of fp32, over UNGROUPED_MIN_BYTES

    def pays(t: torch.Tensor) -> bool:
        return tp.grouping_pays(cctx, t.reshape(-1).view(torch.uint8).numpy(), t.element_size())

    assert not pays(torch.randn(n, generator=g))  # AdamW-like moments: no plane shrinks to 0.1
    assert not pays(torch.randn(n, generator=g).to(torch.bfloat16).repeat(2))
    assert pays(torch.rand(n, generator=g) + 1.0)  # [1, 2): one exponent, a constant top plane
    assert pays(torch.randint(0, 100, (n,), generator=g).float())  # small integers: zero low bytes
    assert not pays(torch.zeros(n))  # compressed ungrouped just as well
    half = torch.randn(n, generator=g)
    half[: n // 2] = 0.0
    assert not pays(half)  # untouched embedding rows: the zeros compress either way, the rest in neither
    assert pays(torch.randn(1000, generator=g))  # small: grouped whatever it holds


def test_byte_grouping_stays_where_pacing_does_not_work_or_is_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_frames: None) -> None:
    monkeypatch.setattr(tp, "start_writeback", lambda fd, off, n: True)
    monkeypatch.setattr(tp, "wait_written", lambda fd, off, n: False)  # the wait fails: not paced
    tensors = _state()
    pace = tp.PaceMemory()
    pace.learn(False)
    path = tmp_path / "t.bin"
    write_tensor_file(tensors, path, level=1, threads=1, paced=True, pace=pace)
    assert pace.group is True  # nothing tells who set the pace: group, as a new store does
    pace.learn(False)
    write_tensor_file(tensors, path, level=1, threads=1, pace=pace)  # not paced: `pace` is neither read nor changed
    assert _grouped(path) == [True] * 12 and pace.group is False
    _assert_same(read_tensor_file(path), tensors)


def test_the_store_remembers_across_saves_whether_to_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           small_frames: None) -> None:
    from hf_dynamic_ckpt.constants import OPTIMIZER_NAME
    from hf_dynamic_ckpt.store import CheckpointStore

    _disk(monkeypatch, 0.0, work_s=0.001)
    from hf_dynamic_ckpt.store import CheckpointState

    g = torch.Generator().manual_seed(0)
    moments = {"exp_avg": torch.randn(512, 512, generator=g), "exp_avg_sq": torch.rand(512, 512, generator=g) * 1e-6}
    optimizer = {"state": {0: {"step": torch.tensor(1.0), **moments}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    store = CheckpointStore(tmp_path / "s")
    files = [Path(save_state(store, CheckpointState(step=step, optimizer=optimizer), reason="test").path)
             / OPTIMIZER_NAME for step in (1, 2)]
    assert store.task.l1_pace.group is False  # the simulated disk never held a write up
    names = [e["name"] for e in read_header(files[0])[0]["tensors"]]
    big = [i for i, name in enumerate(names) if name.endswith(("exp_avg", "exp_avg_sq"))]
    assert len(big) == 2
    assert [_grouped(files[0])[i] for i in big] == [True, True]  # a new store groups
    assert [_grouped(files[1])[i] for i in big] == [False, False]  # then only where it pays
    loaded = store.load("step:2").optimizer["state"][0]
    assert all(torch.equal(loaded[k], v) for k, v in moments.items())


def _spy_paced(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    seen: list[bool] = []
    real = tp.write_tensor_file

    def spy(*args, paced: bool = False, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(paced)
        return real(*args, paced=paced, **kwargs)

    monkeypatch.setattr(tp, "write_tensor_file", spy)
    return seen


def _save(store, step: int):  # type: ignore[no-untyped-def]
    from hf_dynamic_ckpt.store import CheckpointState

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = CheckpointState(step=step, weights=model.state_dict(), optimizer=opt.state_dict())
    return save_state(store, state, reason="test")


def test_the_store_paces_a_local_l1_write_unless_told_not_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_dynamic_ckpt.store import CheckpointStore

    seen = _spy_paced(monkeypatch)
    _save(CheckpointStore(tmp_path / "a"), 1)
    _save(CheckpointStore(tmp_path / "b", pace_to_disk=False), 1)
    assert seen == [True, False]


def test_an_object_store_root_compresses_every_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_dynamic_ckpt.store import CheckpointStore

    seen = _spy_paced(monkeypatch)
    store = CheckpointStore(f"file://{tmp_path / 'bucket'}/run", cache_dir=tmp_path / "cache")
    info = _save(store, 1)
    assert seen == [False]  # the upload, not the local cache's disk, is the slow link
    assert store.load(info).optimizer is not None


def test_pace_to_disk_is_a_level_setting_that_reaches_the_store(tmp_path: Path) -> None:
    from hf_dynamic_ckpt.config import SmartCkptConfig
    from hf_dynamic_ckpt.errors import ConfigError
    from hf_dynamic_ckpt.run.saver import open_run_store

    assert SmartCkptConfig().storage_levels.level_1.pace_to_disk is True
    config = SmartCkptConfig.from_dict({"storage_levels": {"level_1": {"compression": "zstd", "pace_to_disk": False}}})
    store = open_run_store(config, tmp_path / "store", rank=0, world_size=1, session_id="s1")
    try:
        assert store.spec.pace_to_disk is False
    finally:
        store.close()
    with pytest.raises(ConfigError, match=r"pace_to_disk='no' is invalid: expected true or false"):
        SmartCkptConfig.from_dict({"storage_levels": {"level_1": {"pace_to_disk": "no"}}})
