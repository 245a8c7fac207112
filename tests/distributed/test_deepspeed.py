"""DeepSpeed ZeRO under Trainer on 2 processes (torchrun, gloo, `DS_ACCELERATOR=cpu`): save, crash, resume exactly.

Both ranks run `tests/integration/trainer_worker.py --deepspeed STAGE`. Rank 1 SIGKILLs itself after step 7
(once the saves of steps 3 and 6 are committed on every rank); the same command with `resume_checkpoint(trainer,
"auto")` continues from step 6 and must give the uninterrupted run's losses and final weights bit for bit. Every
rank writes its own fragments of the partitioned state (`optimizer-rank<R>.safetensors`; under stage 3 also
`weights-rank<R>.safetensors`); nothing DeepSpeed would pickle is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import trainer_torchrun
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

ARGS = ("--max_steps", "8", "--ga", "2")


def torchrun(out: Path, tag: str, *args: str, expect_ok: bool = True, nproc: int = 2) -> list[dict]:
    return trainer_torchrun(out, tag, *args, expect_ok=expect_ok, nproc=nproc, env={"DS_ACCELERATOR": "cpu"},
                            timeout=600)


def _store_files(run: Path) -> list[str]:
    return sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file())


def crash_and_resume(base: Path, stage: int, model: str) -> tuple[list[dict], list[dict], Path]:
    """The uninterrupted run, the run killed after step 7 (in ``base/crash``, kept), and its resume in a copy."""
    args = (*ARGS, "--deepspeed", str(stage), "--model", model)
    ref = torchrun(base / "ref", "ref", *args, "--final", str(base / "ref" / "final.safetensors"), "--wait_writer")
    crash = torchrun(base / "crash", "crash", *args, "--kill_at", "7", expect_ok=False)
    assert all(c["killed"] for c in crash)
    shutil.copytree(base / "crash", base / "resume")
    resumed = torchrun(base / "resume", "resume", *args, "--resume", "auto",
                       "--final", str(base / "resume" / "final.safetensors"))
    return ref, resumed, base / "resume" / "run" / "smart_ckpt" / "default"


def assert_exact(base: Path, ref: list[dict], resumed: list[dict]) -> None:
    for r in range(2):
        assert resumed[r]["resumed_from"] == 6
        n = len(resumed[r]["losses"])
        assert n > 0 and resumed[r]["losses"] == ref[r]["losses"][-n:]
    assert ref[0]["losses"] != ref[1]["losses"]  # the ranks saw different data
    for r in range(2):  # snapshots into the writer's buffers (ZeRO's fp32 partitions require grad), none streamed
        staged = [(e["step"], e["staging"]) for e in ref[r]["events"]]
        assert staged and all(how == "buffered" for _, how in staged), staged
    want, got = load_file(base / "ref" / "final.safetensors"), load_file(base / "resume" / "final.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.fixture(scope="module")
def zero2_lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], list[dict], Path]:
    base = tmp_path_factory.mktemp("zero2_lora")
    return (base, *crash_and_resume(base, 2, "lora"))


@pytest.fixture(scope="module")
def zero3_full(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], list[dict], Path]:
    base = tmp_path_factory.mktemp("zero3_full")
    return (base, *crash_and_resume(base, 3, "full"))


@pytest.mark.slow  # the default run's time: ZeRO-3 here and the ZeRO-2 loop (test_deepspeed_accelerate) stay in it
def test_zero2_lora_killed_rank_resumes_exactly(zero2_lora: tuple[Path, list[dict], list[dict], Path]) -> None:
    base, ref, resumed, store = zero2_lora
    assert_exact(base, ref, resumed)
    step6 = store / "step-6"
    names = {p.name for p in step6.iterdir()}
    # Stage 2: rank 0 stores the whole adapter (every rank holds it); each rank its fragments of the fp32
    # master weights and moments.
    assert {"weights-rank0.safetensors", "optimizer-rank0.safetensors", "optimizer-rank1.safetensors"} <= names
    adapter = load_file(step6 / "weights-rank0.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    moments = load_file(step6 / "optimizer-rank1.safetensors")
    assert {k.rsplit(".", 1)[1] for k in moments} == {"master", "exp_avg", "exp_avg_sq"}
    manifest = json.loads((step6 / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert not [f for f in _store_files(store.parent) if f.endswith((".pt", ".pth", ".bin", ".pkl"))]
    assert not list((base / "resume" / "run").glob("**/global_step*"))  # DeepSpeed's own save never ran


def test_zero3_full_killed_rank_resumes_exactly(zero3_full: tuple[Path, list[dict], list[dict], Path]) -> None:
    base, ref, resumed, store = zero3_full
    assert_exact(base, ref, resumed)
    step6 = store / "step-6"
    # Stage 3: the model's parameters are partitioned too: each rank stores its partition of every one, as a run
    # of the flattened parameter whose place the manifest's chunk table records.
    w0, w1 = load_file(step6 / "weights-rank0.safetensors"), load_file(step6 / "weights-rank1.safetensors")
    manifest = json.loads((step6 / "manifest.json").read_text())
    chunks = manifest["extra"]["sharded"]["ranks"]
    emb = "model.embed_tokens.weight"
    c0, c1 = chunks["0"]["weights"][emb], chunks["1"]["weights"][emb]
    assert c0["tensor_shape"] == c1["tensor_shape"] == [128, 32]
    assert (c0["offset"], c0["size"], c1["offset"], c1["size"]) == ([0], [2048], [2048], [2048])
    assert w0[emb].shape == w1[emb].shape == (2048,)
    final = load_file(base / "resume" / "final.safetensors")[emb].reshape(-1)
    assert not torch.equal(final[:2048], w0[emb])  # step 6's partition, trained on since


def test_zero3_corrupt_optimizer_partition_of_one_rank_resumes_degraded_on_every_rank(
        zero3_full: tuple[Path, list[dict], list[dict], Path]) -> None:
    base = zero3_full[0]
    out = base / "corrupt"
    shutil.copytree(base / "crash", out)
    part = out / "run" / "smart_ckpt" / "default" / "step-6" / "optimizer-rank1.safetensors"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    resumed = torchrun(out, "resume", *ARGS, "--deepspeed", "3", "--model", "full", "--resume", "auto")
    for r in range(2):
        assert resumed[r]["resumed_from"] == 6  # the weights are intact: no fallback to step 3
        assert [w for w in resumed[r]["warnings"] if "optimizer state of step 6 is lost" in w], resumed[r]["warnings"]
        assert len(resumed[r]["losses"]) == 4 and resumed[r]["global_step"] == 8


@pytest.mark.slow  # the default run's time: preemption is the same agreed path as under DDP (test_trainer_ddp)
def test_zero2_sigterm_on_one_rank_saves_on_all_and_continues_exactly(
        zero2_lora: tuple[Path, list[dict], list[dict], Path]) -> None:
    base, ref = zero2_lora[:2]
    args = (*ARGS, "--deepspeed", "2", "--model", "lora", "--base_interval", "100")
    stopped = torchrun(base / "term", "term", *args, "--sigterm_at", "4", expect_ok=False)
    assert all(r["exit_code"] == 143 for r in stopped)  # 128 + SIGTERM on every rank: the job is requeued
    for r in range(2):
        assert [e["step"] for e in stopped[r]["events"] if e["reason"].startswith("emergency")] == [5]
    resumed = torchrun(base / "term", "resume", *args, "--resume", "auto")
    for r in range(2):
        assert resumed[r]["resumed_from"] == 5
        n = len(resumed[r]["losses"])
        assert n > 0 and resumed[r]["losses"] == ref[r]["losses"][-n:]


@pytest.mark.slow  # needs the ZeRO-2 run above
def test_zero_stores_verify_and_export_the_gathered_weights(zero2_lora: tuple[Path, list[dict], list[dict], Path],
                                                            zero3_full: tuple[Path, list[dict], list[dict], Path],
                                                            tmp_path: Path) -> None:
    from hf_dynamic_ckpt.cli import main as cli
    from hf_dynamic_ckpt.export import export_checkpoint

    # The uninterrupted runs' last save (train_end, step 8) holds their final weights: the export gathers every
    # rank's fragments into whole tensors (no process group, no DeepSpeed) and must give them bit for bit.
    for (base, *_), fmt, name in ((zero2_lora, "peft", "adapter_model.safetensors"),
                                  (zero3_full, "hf", "model.safetensors")):
        root = base / "ref" / "run" / "smart_ckpt"
        assert cli(["verify", str(root)]) == 0
        out = tmp_path / fmt
        export_checkpoint(root, "step:8", out, format=fmt)
        exported, final = load_file(out / name), load_file(base / "ref" / "final.safetensors")
        # PEFT's file names an adapter weight without the adapter ("lora_A.weight", not "lora_A.default.weight").
        want = {k.replace(".default", "") if fmt == "peft" else k: v for k, v in final.items()}
        assert want and set(want) <= set(exported)
        assert all(torch.equal(exported[k], v) for k, v in want.items())


@pytest.mark.slow
def test_trainer_native_deepspeed_checkpoint_resumes_directly_and_the_store_goes_on(
        zero2_lora: tuple[Path, list[dict], list[dict], Path]) -> None:
    # Trainer's own save_steps (DeepSpeed's global_stepN pickles) beside the store: passing its folder straight to
    # trainer.train is Trainer's resume (what resume_checkpoint's error for such a folder says to do); the callback
    # stays out of its way and saves into the store from there on.
    base, ref = zero2_lora[:2]
    args = (*ARGS, "--deepspeed", "2", "--model", "lora", "--native_save_steps", "3")
    torchrun(base / "native", "crash", *args, "--kill_at", "7", expect_ok=False)
    assert (base / "native" / "run" / "checkpoint-6" / "global_step6").is_dir()
    resumed = torchrun(base / "native", "resume", *args, "--resume_native", "checkpoint-6")
    for r in range(2):
        n = len(resumed[r]["losses"])
        assert resumed[r]["resumed_from"] is None and n > 0 and resumed[r]["losses"] == ref[r]["losses"][-n:]
    assert (base / "native" / "run" / "smart_ckpt" / "default" / "step-8").is_dir()  # train_end, after the resume


def elastic(tmp_path: Path, stage: int, before: int, after: int, ga: int) -> None:
    """Killed after step 7 on `before` processes (accumulation `ga`), resumed with the same command on `after`."""
    args = ("--max_steps", "8", "--deepspeed", str(stage), "--model", "full", "--dropout", "0")
    ref = torchrun(tmp_path / "ref", "ref", *args, "--ga", str(ga), "--final", str(tmp_path / "ref.safetensors"),
                   nproc=before)
    torchrun(tmp_path / "run", "crash", *args, "--ga", str(ga), "--kill_at", "7", expect_ok=False, nproc=before)
    res = torchrun(tmp_path / "run", "res", *args, "--ga", str(ga), "--resume", "auto",
                   "--final", str(tmp_path / "res.safetensors"), nproc=after)[0]
    assert res["resumed_from"] == 6 and res["ga"] == ga * before // after and res["global_step"] == 8
    for step in ("7", "8"):
        (want, want_norm), (got, got_norm) = ref[0]["log"][step][:2], res["log"][step][:2]
        assert abs(got - want) <= 1e-5 * abs(want) and abs(got_norm - want_norm) <= 1e-4 * abs(want_norm)
    want_w, got_w = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "res.safetensors")
    assert want_w.keys() == got_w.keys()
    assert max(float((want_w[k] - got_w[k]).abs().max()) for k in want_w) <= 1e-5


@pytest.mark.slow  # the default run's time: the elastic plan is the DDP one (test_elastic), the ZeRO reads as here
def test_zero2_killed_on_two_processes_continues_on_one_with_the_same_global_batch(tmp_path: Path) -> None:
    # The fragments do not depend on the partitioning: one process reads both ranks' files. The accumulation that
    # keeps the global batch (2 x 4 x 2 -> 1 x 4 x 4) goes into DeepSpeed's config too. Without dropout the only
    # difference is the order of the reduction: the logged losses and the final weights agree to rounding.
    elastic(tmp_path, 2, 2, 1, ga=2)


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "before", "after", "ga"), [(3, 2, 1, 2), (2, 1, 2, 4), (3, 1, 2, 4)])
def test_zero_elastic_both_ways(tmp_path: Path, stage: int, before: int, after: int, ga: int) -> None:
    elastic(tmp_path, stage, before, after, ga)


@pytest.mark.slow
def test_zero1_full_killed_rank_resumes_exactly(tmp_path: Path) -> None:
    ref, resumed, _ = crash_and_resume(tmp_path, 1, "full")
    assert_exact(tmp_path, ref, resumed)


@pytest.mark.slow
def test_zero2_checkpoint_resumes_under_zero3(tmp_path: Path) -> None:
    # A fragment means the same under every stage: the ZeRO-2 save of step 6 continues under ZeRO-3. The first
    # step's forward passes read the restored weights (bit-equal losses); the reductions of another stage may
    # round differently afterwards.
    args = (*ARGS, "--model", "full")
    ref = torchrun(tmp_path / "ref", "ref", *args, "--deepspeed", "2")
    torchrun(tmp_path / "run", "crash", *args, "--deepspeed", "2", "--kill_at", "7", expect_ok=False)
    resumed = torchrun(tmp_path / "run", "resume", *args, "--deepspeed", "3", "--resume", "auto")
    for r in range(2):
        assert resumed[r]["resumed_from"] == 6
        got, want = resumed[r]["losses"], ref[r]["losses"][-len(resumed[r]["losses"]):]
        assert got[:2] == want[:2]
        assert all(abs(float.fromhex(a) - float.fromhex(b)) <= 1e-4 * abs(float.fromhex(b)) for a, b in zip(got, want))


@pytest.fixture(scope="module")
def ddp_layer_norms(tmp_path_factory: pytest.TempPathFactory) -> list[list]:
    out = tmp_path_factory.mktemp("ddp_norms")
    return torchrun(out, "ddp", "--max_steps", "4", "--model", "lora", "--dropout", "0", "--record_layer_norms")[0][
        "layer_norms"]


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_per_lora_layer_gradient_norms_under_zero_equal_ddps(tmp_path: Path, stage: int,
                                                             ddp_layer_norms: list[list]) -> None:
    # The gradients never reach `.grad` under ZeRO: each rank's partition of them is read when the engine hands
    # it to the optimizer, its squares per LoRA layer are added across ranks. The same data and weights give the
    # norms DDP measures on the whole gradients.
    zero = torchrun(tmp_path, "zero", "--max_steps", "4", "--model", "lora", "--dropout", "0", "--record_layer_norms",
                    "--deepspeed", str(stage))[0]["layer_norms"]
    assert len(zero) == len(ddp_layer_norms) == 4
    for (norm, layers), (want_norm, want_layers) in zip(zero, ddp_layer_norms):
        assert abs(norm - want_norm) <= 1e-5 * want_norm
        assert layers.keys() == want_layers.keys() and len(layers) == 4  # 2 layers x (q_proj, v_proj)
        assert all(abs(layers[k] - v) <= 1e-5 * v for k, v in want_layers.items())


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "model"), [(2, "lora"), (2, "full"), (3, "full")])
def test_zero_rollback_is_agreed_and_exact(tmp_path: Path, stage: int, model: str) -> None:
    # A gradient explosion on rank 0's data at step 6. The policy decides inside the engine's step, before the first
    # partition is updated: the capture of step 5 is step 5's state. Every rank goes back to it in the running
    # process (the partitions read back in place) and skips step 6's batches; the same as resuming step 5 without
    # them. Full fine-tunes: two optimizer groups (decay / no decay), so several partitions and, under ZeRO-2, the
    # base optimizer's group list swapped for the one being stepped while the capture is taken.
    args = ("--deepspeed", str(stage), "--model", model, "--ga", "1", "--max_steps", "10", "--examples", "96",
            "--base_interval", "3", "--poison", "6:grad@0")
    rolled = torchrun(tmp_path / "rb", "rb", *args, "--on_anomaly", "rollback")
    for r in range(2):
        assert [x[:2] for x in rolled[r]["rollbacks"]] == [[6, 5]] and rolled[r]["global_step"] == 10
    assert "cannot be captured" not in rolled[0]["stderr"]
    ref = torchrun(tmp_path / "ref", "ref", *args, "--reference_skip", "6:6", "--resume",
                   str(tmp_path / "rb" / "run" / "smart_ckpt" / "default" / "step-5"))
    for r in range(2):
        assert ref[r]["resumed_from"] == 5 and rolled[r]["losses"][6:] == ref[r]["losses"]
