"""CheckpointStore: bit-exact round trips, frozen weights, atomic commit, multi-rank, resolve, errors."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import save_state
from safetensors import safe_open
from store_helpers import file_checksum, manifest_checksum

from examples import toy
from hf_dynamic_ckpt.constants import (
    MANIFEST_NAME,
    OPTIMIZER_META_NAME,
    OPTIMIZER_NAME,
    PINNED_MARKER,
    SAMPLER_NAME,
    WEIGHTS_NAME,
    Tier,
)
from hf_dynamic_ckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DistributedError,
    DynamicCkptError,
    FormatVersionError,
    IncompatibleStateError,
)
from hf_dynamic_ckpt.state import capture_rng_state, restore_rng_state
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore, check_frozen, frozen_record


def _train(model: torch.nn.Module, steps: int = 2, seed: int = 0) -> tuple[torch.optim.Optimizer, Any]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / 100))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 512, (2, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return opt, sched


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Recursive bit-exact equality: tensors by dtype, shape and bytes; containers by type."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)), where
        return
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b) or set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int, **kw: Any) -> CheckpointState:
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return CheckpointState(step=step, epoch=0.5, weights=weights, optimizer=opt.state_dict(),
                           scheduler=sched.state_dict(), rng=capture_rng_state(),
                           sampler={"epoch": 0, "batches": step}, extra={"global_step": step}, **kw)


def _tiny_state(step: int, *, rng: bool = True) -> CheckpointState:
    g = torch.Generator().manual_seed(step)
    return CheckpointState(step=step, weights={"w": torch.randn(8, 4, generator=g)},
                           optimizer={"state": {0: {"exp_avg": torch.randn(8, 4, generator=g)}},
                                      "param_groups": [{"lr": 0.1, "params": [0]}]},
                           scheduler={"last_epoch": step}, rng={"seed": step} if rng else None,
                           sampler={"batches": step})


def _visible(directory: Path) -> list[str]:
    """Entries of a task directory other than the hidden writer lock."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    s = CheckpointStore(tmp_path / "root", task_id="run")
    yield s
    s.close()


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_full_qwen2_is_bit_exact(store: CheckpointStore, tied: bool) -> None:
    torch.manual_seed(1)
    model = toy.tiny_qwen2(seed=0, tie_word_embeddings=tied)
    opt, sched = _train(model)
    state = _state(model, opt, sched, step=2)
    if tied:  # keep the sharing (as the engine's snapshot does): stored once, re-aliased on load
        emb = state.weights["model.embed_tokens.weight"]
        state.weights["lm_head.weight"] = emb
    draws_after_capture = (torch.rand(4), torch.randn(3))
    info = save_state(store, state, reason="interval", signals={"loss": 5.5})
    assert info is not None and info.tiers == frozenset(Tier) and info.loss == 5.5

    loaded = store.load("auto", mmap=False)
    assert loaded.info.step == 2 and loaded.warnings == []
    assert set(loaded.weights) == set(model.state_dict())
    assert_same(state.weights, loaded.weights, "weights")
    assert_same(opt.state_dict(), loaded.optimizer, "optimizer")
    assert_same(sched.state_dict(), loaded.scheduler, "scheduler")
    assert loaded.rng == json.loads(json.dumps(state.rng))
    restore_rng_state(loaded.rng)  # the random streams continue exactly where they were captured
    assert_same(draws_after_capture, (torch.rand(4), torch.randn(3)), "rng streams")
    if tied:
        assert loaded.weights["lm_head.weight"] is loaded.weights["model.embed_tokens.weight"]
        with safe_open(str(Path(info.path) / WEIGHTS_NAME), framework="pt") as f:
            assert "lm_head.weight" not in set(f.keys())
    assert loaded.sampler == {"epoch": 0, "batches": 2}
    assert loaded.extra == {"global_step": 2}

    # The loaded state continues training exactly like the live objects.
    model2 = toy.tiny_qwen2(seed=123, tie_word_embeddings=tied)
    model2.load_state_dict(loaded.weights)
    opt2, sched2 = _train(model2, steps=0)
    opt2.load_state_dict(loaded.optimizer)
    sched2.load_state_dict(loaded.scheduler)
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        ids = torch.arange(16).reshape(2, 8)
        m(input_ids=ids, labels=ids).loss.backward()
        o.step()
        s.step()
    assert_same(model.state_dict(), model2.state_dict(), "after one more step")


def test_round_trip_mmap_weights_are_read_only_views_of_the_file(store: CheckpointStore) -> None:
    state = _tiny_state(1)
    save_state(store, state, reason="r")
    loaded = store.load("step:1", tiers={Tier.WEIGHTS}, mmap=True)
    assert_same(state.weights, loaded.weights)
    assert loaded.optimizer is None and loaded.rng is None


def test_round_trip_lora_adapter_with_adamw_and_scheduler(store: CheckpointStore) -> None:
    from peft import get_peft_model_state_dict

    torch.manual_seed(2)
    model = toy.lora(toy.tiny_qwen2(seed=0))
    opt, sched = _train(model, steps=3)
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    state = CheckpointState(step=3, weights=adapter, optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                            rng=capture_rng_state(), sampler={"batches": 3})
    save_state(store, state, reason="interval")
    loaded = store.load("step:3")
    assert_same(adapter, loaded.weights, "adapter")
    assert all("lora_" in k for k in loaded.weights)
    assert_same(opt.state_dict(), loaded.optimizer, "optimizer")
    assert_same(sched.state_dict(), loaded.scheduler, "scheduler")
    assert loaded.rng == state.rng


def test_lora_second_checkpoint_writes_no_base_model_bytes(store: CheckpointStore) -> None:
    from peft import get_peft_model_state_dict

    model = toy.lora(toy.tiny_qwen2(seed=0))
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    opt, _ = _train(model, steps=1)
    for step in (1, 2):
        adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        save_state(store, CheckpointState(step=step, weights=adapter, optimizer=opt.state_dict()), reason="interval")
        _train(model, steps=1)
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapter.values())
    second = store.task_dir / "step-2"
    with safe_open(str(second / WEIGHTS_NAME), framework="pt") as f:
        keys = set(f.keys())
    assert keys == set(adapter)
    weights_size = (second / WEIGHTS_NAME).stat().st_size
    assert adapter_bytes <= weights_size < adapter_bytes + 16_384  # data + header only
    assert weights_size < base_bytes / 20
    assert not (store.task_dir / "blobs").exists()


def test_full_finetune_frozen_embedding_is_recorded_not_written(store: CheckpointStore) -> None:
    model = toy.tiny_qwen2(seed=0)
    emb = "model.embed_tokens.weight"
    model.get_input_embeddings().weight.requires_grad_(False)
    opt, sched = _train(model, steps=1)
    live = model.state_dict()
    state = _state(model, opt, sched, step=1)
    record = frozen_record(state.weights.pop(emb))
    assert record == {"checksum": record["checksum"], "dtype": "float32", "shape": list(live[emb].shape)}
    info = save_state(store, dataclasses.replace(state, frozen={emb: record}), reason="interval")
    assert info.frozen == {emb: record} and store.list()[0].frozen == {emb: record}
    manifest = json.loads((Path(info.path) / MANIFEST_NAME).read_text())
    assert manifest["frozen"] == {emb: record} and manifest["format_version"] == 2  # older readers refuse it
    with safe_open(str(Path(info.path) / WEIGHTS_NAME), framework="pt") as f:
        assert emb not in set(f.keys())
    emb_bytes = live[emb].numel() * 4
    assert manifest["files"][WEIGHTS_NAME]["size"] < sum(v.numel() * v.element_size() for v in live.values()) \
        - emb_bytes + 16_384

    loaded = store.load("step:1", tiers={Tier.WEIGHTS})
    assert emb not in loaded.weights and loaded.frozen == {emb: record}
    check_frozen(loaded, live)  # the model's own embedding matches: it takes the place of the weight not written
    assert loaded.weights[emb] is live[emb] and set(loaded.weights) == set(live)
    other = toy.tiny_qwen2(seed=1).state_dict()
    with pytest.raises(IncompatibleStateError, match=rf"differ from those step 1 was trained with .*{emb}"):
        check_frozen(store.load("step:1", tiers={Tier.WEIGHTS}), other)
    # The transitional form (the keys named, their records computed by the store) writes the same manifest record.
    state = _state(model, opt, sched, step=2, dedup_keys=frozenset({emb}))
    assert store.load(save_state(store, state, reason="interval").path, tiers={Tier.WEIGHTS}).frozen == {emb: record}


def test_manifest_lists_every_file_with_size_checksum_tier_rank(store: CheckpointStore) -> None:
    info = save_state(store, _tiny_state(5), reason="risk", signals={"loss": float("nan"), "grad_norm": float("inf")},
                      debug_info=[{"step": s, "loss": 1.0 / (s + 1)} for s in range(15)])
    manifest = json.loads((Path(info.path) / MANIFEST_NAME).read_text())  # strict JSON (no NaN literals)
    assert set(manifest["files"]) == {WEIGHTS_NAME, OPTIMIZER_NAME, OPTIMIZER_META_NAME, SAMPLER_NAME, "rng-rank0.json"}
    for name, entry in manifest["files"].items():
        assert entry["size"] == (Path(info.path) / name).stat().st_size
        assert entry["checksum"] == file_checksum(Path(info.path) / name)
    assert manifest["files"]["rng-rank0.json"]["rank"] == 0 and manifest["files"]["rng-rank0.json"]["tier"] == "state"
    assert manifest["files"][OPTIMIZER_NAME]["tier"] == "optimizer"
    assert manifest["signals"] == {"loss": "NaN", "grad_norm": "Infinity"}
    assert [d["step"] for d in manifest["debug_info"]] == list(range(5, 15))
    assert manifest["format_version"] == 1 and "torch" in manifest["versions"] and "frozen" not in manifest
    assert manifest["manifest_checksum"] == manifest_checksum(manifest)
    assert info.loss is None  # a NaN loss is not a loss to rank by
    assert sorted(p.name for p in Path(info.path).iterdir()) == sorted([*manifest["files"], MANIFEST_NAME])


def test_committed_step_is_not_rewritten(store: CheckpointStore) -> None:
    first = save_state(store, _tiny_state(1), reason="a")
    again = save_state(store, CheckpointState(step=1, weights={"w": torch.zeros(2)}), reason="b")
    assert again == first
    assert_same(store.load("step:1").weights, _tiny_state(1).weights)


def test_leftover_tmp_dirs_removed_on_open_except_own_session(tmp_path: Path) -> None:
    root = tmp_path / "root"
    s = CheckpointStore(root, task_id="run", session_id="old")
    save_state(s, _tiny_state(1), reason="a")
    s.close()
    stale = root / "run" / "step-2.tmp-old"
    own = root / "run" / "step-3.tmp-new"
    for d in (stale, own):
        d.mkdir()
        (d / WEIGHTS_NAME).write_bytes(b"partial")
    (root / "run" / "blobs").mkdir()  # a blob store of an earlier version, with an interrupted write
    (root / "run" / "blobs" / "abc.safetensors.tmp-123").write_bytes(b"x")
    s2 = CheckpointStore(root, task_id="run", session_id="new")
    assert not stale.exists() and own.exists()
    assert list((root / "run" / "blobs").iterdir()) == []
    assert [i.step for i in s2.list()] == [1]
    s3 = CheckpointStore(root, task_id="run", rank=1, world_size=2, session_id="other")  # not rank 0: no cleanup
    assert own.exists()
    s2.close()
    s3.close()


def test_two_ranks_commit_one_checkpoint(tmp_path: Path) -> None:
    stores = [CheckpointStore(tmp_path / "root", task_id="ddp", rank=r, world_size=2, session_id="s1") for r in (0, 1)]
    results: dict[int, Any] = {}

    def run(rank: int) -> None:
        state = _tiny_state(4) if rank == 0 else CheckpointState(step=4, rng={"seed": 100 + rank})
        results[rank] = save_state(stores[rank], state, reason="interval")

    threads = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[1] is None and results[0].step == 4 and results[0].world_size == 2
    directory = Path(results[0].path)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    assert manifest["files"]["rng-rank0.json"]["rank"] == 0 and manifest["files"]["rng-rank1.json"]["rank"] == 1
    assert not list(directory.glob("done-rank*"))
    assert stores[0].load("step:4", rank=1).rng == {"seed": 101}
    assert stores[1].load("step:4").rng == {"seed": 101}  # defaults to the store's own rank
    assert stores[0].load("step:4").rng == {"seed": 4}
    assert stores[0].verify("step:4") == []
    (directory / "rng-rank1.json").unlink()
    assert stores[0].verify("step:4") == ["rng-rank1.json (tier state, rank 1): file is missing"]
    for s in stores:
        s.close()


def test_missing_rank_times_out_and_commits_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "root", task_id="ddp", rank=0, world_size=3, session_id="s1", rank_timeout_s=0.3)
    with pytest.raises(DistributedError) as exc:
        save_state(store, _tiny_state(7), reason="interval")
    assert "rank(s) [1, 2] of 3 did not finish writing within 0.3 s" in str(exc.value)
    assert "nothing was committed" in str(exc.value)
    assert _visible(store.task_dir) == []
    assert store.list(include_unhealthy=True) == []
    store.close()


def test_session_id_required_for_several_ranks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="session_id=None is invalid with world_size > 1"):
        CheckpointStore(tmp_path, rank=0, world_size=2)
    with pytest.raises(ConfigError, match="rank=2, world_size=2"):
        CheckpointStore(tmp_path, rank=2, world_size=2, session_id="x")


def test_resolve_specs(store: CheckpointStore) -> None:
    for step, loss, healthy in ((10, 2.0, True), (20, 1.0, True), (30, 3.0, True), (40, 0.5, False)):
        save_state(store, _tiny_state(step), reason="r", healthy=healthy, signals={"loss": loss})
    # optimizer-less checkpoint: cheapest to recover
    save_state(store, CheckpointState(step=25, weights={"w": torch.zeros(8, 4)}), reason="mem", signals={"loss": 9.0})
    assert store.resolve("auto").step == 30  # 40 is unhealthy
    assert store.resolve("best").step == 20
    assert store.resolve("fastest").step == 25
    assert store.resolve("step:40").step == 40 and store.resolve("40").step == 40 and store.resolve(40).step == 40
    assert store.resolve(store.task_dir / "step-10").step == 10
    assert store.resolve(str(store.task_dir / "step-10")).step == 10
    assert [i.step for i in store.list()] == [30, 25, 20, 10]
    assert [i.step for i in store.list(include_unhealthy=True)] == [40, 30, 25, 20, 10]
    with pytest.raises(CheckpointNotFoundError) as exc:
        store.resolve("step:15")
    assert str(exc.value).endswith("available steps of task 'run': 10, 20, 25, 30, 40 (unhealthy).")


def test_resolve_errors_for_paths_and_empty_store(store: CheckpointStore, tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError,
                       match="no healthy committed checkpoint with weights; the store has no checkpoints"):
        store.resolve("auto")
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"plain is not a checkpoint directory \(no manifest.json\)"):
        store.resolve(plain)
    with pytest.raises(CheckpointNotFoundError, match="is neither 'auto', 'best', 'fastest', 'step:N' nor an existing"):
        store.resolve("lastest")
    with pytest.raises(CheckpointNotFoundError, match="ref 'step:x' is invalid"):
        store.resolve("step:x")


def test_resolve_names_a_trainer_or_deepspeed_checkpoint_folder_and_the_way(store: CheckpointStore,
                                                                          tmp_path: Path) -> None:
    native = tmp_path / "checkpoint-6"
    native.mkdir()
    (native / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointNotFoundError) as e:
        store.resolve(native)
    assert str(e.value).startswith(f"{native} is Trainer's own checkpoint folder, not one of this store: pass it to "
                                   "trainer.train(resume_from_checkpoint=...) directly (Trainer loads it itself; "
                                   "SmartCkptCallback saves into the store from there on); ")
    (native / "global_step6").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint-6 is DeepSpeed's and Trainer's own checkpoint"):
        store.resolve(native)


def _rewrite_manifest(directory: Path, fix_checksum: bool, **changes: Any) -> None:
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest.update(changes)
    if fix_checksum:
        manifest["manifest_checksum"] = manifest_checksum(manifest)
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_newer_format_version_is_refused(store: CheckpointStore) -> None:
    info = save_state(store, _tiny_state(1), reason="r")
    _rewrite_manifest(Path(info.path), fix_checksum=True, format_version=99)
    with pytest.raises(FormatVersionError, match="format_version=99 is newer than the version this library reads"):
        store.load("step:1")


def test_tampered_or_unparsable_manifest_is_refused(store: CheckpointStore) -> None:
    info = save_state(store, _tiny_state(1), reason="r")
    _rewrite_manifest(Path(info.path), fix_checksum=False, reason="edited")
    with pytest.raises(CorruptCheckpointError, match="manifest checksum mismatch"):
        store.load("step:1")
    assert store.verify("step:1")[0].startswith("manifest.json: ")
    assert store.list(include_unhealthy=True)[0].status == "corrupt"
    (Path(info.path) / MANIFEST_NAME).write_text('{"step": 1,')
    with pytest.raises(CorruptCheckpointError, match="the manifest is not valid JSON"):
        store.load("step:1")


def test_verify_reports_each_problem(store: CheckpointStore) -> None:
    info = save_state(store, _tiny_state(1), reason="r")
    directory = Path(info.path)
    assert store.verify("step:1") == []
    with open(directory / OPTIMIZER_NAME, "r+b") as f:
        f.truncate(10)
    (directory / SAMPLER_NAME).unlink()
    data = bytearray((directory / WEIGHTS_NAME).read_bytes())
    data[-1] ^= 0x01
    (directory / WEIGHTS_NAME).write_bytes(bytes(data))
    problems = store.verify("step:1")
    assert len(problems) == 3
    assert problems[0].startswith(f"{OPTIMIZER_NAME} (tier optimizer): size 10 bytes, manifest says")
    assert problems[1] == f"{SAMPLER_NAME} (tier state): file is missing"
    assert problems[2].startswith(f"{WEIGHTS_NAME} (tier weights): checksum mismatch")
    assert store.list(include_unhealthy=True)[0].status == "corrupt"
    with pytest.raises(CorruptCheckpointError, match="failed verification, nothing was loaded"):
        store.load("step:1", tiers={Tier.WEIGHTS})


def test_pin_and_delete(store: CheckpointStore) -> None:
    for step in (1, 2, 3):
        save_state(store, _tiny_state(step), reason="r")
    assert store.pin("step:2").pinned
    assert (store.task_dir / "step-2" / PINNED_MARKER).exists()
    with pytest.raises(DynamicCkptError, match=r"step 2 .* is pinned; pass force=True"):
        store.delete("step:2")
    store.delete("step:1")
    assert not (store.task_dir / "step-1").exists() and [i.step for i in store.list()] == [3, 2]

    store.delete("step:3", tiers={Tier.OPTIMIZER})
    info3 = store.resolve("step:3")
    assert info3.tiers == frozenset({Tier.WEIGHTS, Tier.STATE})
    assert not (store.task_dir / "step-3" / OPTIMIZER_NAME).exists()
    assert store.verify("step:3") == []
    assert store.load("step:3").optimizer is None

    store.delete("step:2", force=True)
    store.delete("step:3")
    assert store.list(include_unhealthy=True) == [] and sorted(p.name for p in store.task_dir.iterdir()) == [
        ".writer.lock"]


def test_concurrent_saves_from_threads_are_serialised(store: CheckpointStore) -> None:
    threads = [threading.Thread(target=save_state, args=(store, _tiny_state(s)), kwargs={"reason": "t"})
               for s in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [i.step for i in store.list()] == [6, 5, 4, 3, 2, 1]
    for step in range(1, 7):
        assert store.verify(step) == []
        assert_same(store.load(step).weights, _tiny_state(step).weights)


def test_entries_are_verified_with_their_own_checksum_algorithm(store: CheckpointStore) -> None:
    info = save_state(store, _tiny_state(1), reason="r")
    directory = Path(info.path)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    sampler = (directory / SAMPLER_NAME).read_bytes()
    manifest["files"][SAMPLER_NAME]["checksum"] = f"sha256:{hashlib.sha256(sampler).hexdigest()}"
    manifest["files"][WEIGHTS_NAME]["checksum"] = "crc99:00"
    manifest["manifest_checksum"] = manifest_checksum(manifest)
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    problems = store.verify("step:1")
    assert len(problems) == 1
    assert problems[0].startswith(f"{WEIGHTS_NAME} (tier weights): Unknown checksum algorithm 'crc99'")
    assert store.load("step:1", tiers={Tier.STATE}).sampler == {"batches": 1}  # sha256 entry still verifies


def test_verify_by_path_of_a_foreign_checkpoint_with_a_bad_manifest(store: CheckpointStore, tmp_path: Path) -> None:
    other = CheckpointStore(tmp_path / "other_root", task_id="x")
    info = save_state(other, _tiny_state(1), reason="r")
    other.close()
    (Path(info.path) / MANIFEST_NAME).write_text("[]")
    problems = store.verify(info.path)
    assert len(problems) == 1 and problems[0].endswith("the manifest is not a JSON object; the checkpoint is damaged.")


def test_replace_recommits_a_step_and_a_dir_without_manifest_is_overwritten(store: CheckpointStore) -> None:
    save_state(store, _tiny_state(1), reason="old timeline")
    new = CheckpointState(step=1, weights={"w": torch.ones(3)})
    info = save_state(store, new, reason="new timeline", replace=True)
    assert info.reason == "new timeline" and store.resolve("step:1").reason == "new timeline"
    assert_same(store.load("step:1").weights, {"w": torch.ones(3)})
    assert _visible(store.task_dir) == ["step-1"]
    (store.task_dir / "step-2").mkdir()  # e.g. a manifest deleted by hand
    (store.task_dir / "step-2" / WEIGHTS_NAME).write_bytes(b"junk")
    assert save_state(store, _tiny_state(2), reason="r").step == 2
    assert store.verify("step:2") == []


def test_save_failure_leaves_nothing_behind(store: CheckpointStore) -> None:
    from hf_dynamic_ckpt.errors import SaveError

    bad = CheckpointState(step=3, weights={"w": torch.zeros(2)}, optimizer={"state": {"f": lambda: 0}})
    with pytest.raises(SaveError, match="cannot be stored without pickle"):
        save_state(store, bad, reason="r")
    assert _visible(store.task_dir) == [] and store.list(include_unhealthy=True) == []


def test_cleanup_spares_temp_dirs_while_another_session_holds_the_task(tmp_path: Path) -> None:
    import subprocess
    import sys
    import textwrap

    from hf_dynamic_ckpt.errors import StoreLockedError

    live = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from hf_dynamic_ckpt.store import CheckpointStore
        store = CheckpointStore(sys.argv[1], task_id="run", session_id="live")
        (store.task_dir / "step-5.tmp-live").mkdir()  # a save of the live session in progress
        print("ready", flush=True)
        sys.stdin.readline()
        store.close()
        """), str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout is not None and live.stdout.readline().strip() == "ready"
        live_tmp = tmp_path / "run" / "step-5.tmp-live"
        with pytest.raises(StoreLockedError, match=r"session live, since .*give this run its own task_id"):
            CheckpointStore(tmp_path, task_id="run", session_id="newcomer")
        assert live_tmp.exists()
        assert live.stdin is not None
        live.stdin.write("end\n")  # the live session ends (or dies: the lock goes with the process)
        live.stdin.flush()
        assert live.wait(timeout=60) == 0
    finally:
        live.kill()
    third = CheckpointStore(tmp_path, task_id="run", session_id="after")
    assert not live_tmp.exists()
    third.close()


def test_abort_makes_a_save_waiting_for_other_ranks_give_up_now(tmp_path: Path) -> None:
    from hf_dynamic_ckpt.errors import DistributedError

    store = CheckpointStore(tmp_path / "root", task_id="ddp", rank=0, world_size=2, session_id="s1", rank_timeout_s=600)
    errors: list[BaseException] = []

    def save() -> None:
        try:
            save_state(store, _tiny_state(3), reason="interval")
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=save)
    thread.start()
    while not (store.task_dir / "step-3.tmp-s1" / "done-rank0.json").exists():  # rank 0 is waiting for rank 1
        thread.join(0.01)
    store.abort("rank 1 died")
    thread.join(30)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], DistributedError)
    assert "gave up waiting for rank(s) [1] of 2: rank 1 died (CheckpointStore.abort)" in str(errors[0])
    assert _visible(store.task_dir) == [] and store.list(include_unhealthy=True) == []
    store.clear_abort()
    store.close()
