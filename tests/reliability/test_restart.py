"""The restart a user lives through, end to end: every ordinary restart works without a flag.

- SIGKILL of a Trainer run with persistent data-loader workers, then the same command at once
  (one process, and `torchrun` with 2 ranks): the orphaned workers still have the lock file open
  (they are frozen here so they outlive the restart for sure) and cannot block it.
- A notebook: `train()` raises, a new Trainer on the same output_dir and model resumes; several
  Trainers of one process each call `resume_checkpoint`.
- A store on a read-only mount: a typed error before the first step; resuming from it by path
  while saving into the run's own store; the CLI's read commands on it.
- The store root deleted mid-run: recreated at the next save, and `auto` resumes from what follows.
- A duplicate YAML key; an optimizer tier declaring one 1 GiB tensor (bounded memory, then refused
  before allocation when the model cannot hold it); one whose structure names another tensor (each
  failed read frees its 1 GiB before the retry and the weights-only fallback).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from store_helpers import read_only_command, replace_file, tree

from hf_dynamic_ckpt import SmartCkptConfig
from hf_dynamic_ckpt.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "integration" / "trainer_worker.py"
NOTEBOOK = Path(__file__).with_name("notebook_worker.py")
ARGS = ("--model", "lora", "--ga", "1", "--max_steps", "12", "--examples", "64", "--base_interval", "3")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run_worker(out: Path, tag: str, *args: str, expect_ok: bool = True, prefix: list[str] | None = None,
               ) -> tuple[dict, str]:
    """Run the Trainer worker; returns its result file and its stderr. Output goes to files, not pipes: a pipe
    would make this wait for the crashed run's orphaned workers too, which share it."""
    cmd = [*(prefix or []), sys.executable, str(WORKER), "--out", str(out), "--tag", tag, *args]
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{tag}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, timeout=300).returncode
    text = log.read_text()
    assert (rc == 0) == expect_ok, f"rc={rc}\n{text[-5000:]}"
    result = out / f"{tag}-rank0.json"
    return (json.loads(result.read_text()) if result.is_file() else {}), text


def holds(pid: int, path: Path) -> bool:
    try:
        return any(os.path.realpath(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def freeze_orphans(pids: list[int], lock: Path, *, required: bool = True) -> list[psutil.Process]:
    """Stop the crashed run's children that are still alive, so they keep their open files through the restart.

    `required`: at least one of them must have the lock file open (under torchrun the agent may have
    ended them already)."""
    frozen = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.suspend()
            frozen.append(p)
        except psutil.NoSuchProcess:
            continue
    assert not required or any(holds(p.pid, lock) for p in frozen), "no orphan of the crashed run has the lock open"
    return frozen


def thaw(frozen: list[psutil.Process]) -> None:
    for p in frozen:
        try:
            p.kill()
            p.resume()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("reference")
    ref, _ = run_worker(out, "ref", *ARGS, "--workers", "2")
    assert len(ref["losses"]) == 12
    return ref


@pytest.mark.integration
def test_sigkill_with_persistent_workers_then_an_immediate_restart(reference: dict, tmp_path: Path) -> None:
    crash, _ = run_worker(tmp_path, "crash", *ARGS, "--workers", "2", "--kill_at", "9", expect_ok=False)
    assert crash["killed"] and crash["losses"] == reference["losses"][:9]
    frozen = freeze_orphans(crash["children"], tmp_path / "run" / "smart_ckpt" / "default" / ".writer.lock")
    try:
        resumed, log = run_worker(tmp_path, "resume", *ARGS, "--workers", "2", "--resume", "auto")
    finally:
        thaw(frozen)
    assert resumed["resumed_from"] == 9
    assert resumed["losses"] == reference["losses"][9:]
    assert "took the writer lock over from pid" in log and "ended without releasing it" in log
    # smart_ckpt/saves counts the run's saves: the resumed run continues the count instead of starting at 1.
    before = crash["saves_logged"]
    after = [row for row in resumed["saves_logged"] if row[0] > 9]  # Trainer restores the earlier log history
    assert before[-1] == [8, 2] and after[0] == [10, 3]  # saves of steps 3 and 6 logged, then 3, 6 and 9
    counts = [n for _, n in before + after]
    assert counts == sorted(counts) and after[-1][1] > before[-1][1]


@pytest.mark.integration
@pytest.mark.distributed
def test_torchrun_sigkill_of_rank0_with_workers_then_an_immediate_restart(tmp_path: Path) -> None:
    def torchrun(out: Path, tag: str, *args: str, expect_ok: bool = True) -> list[dict]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
               "--out", str(out), "--tag", tag, *ARGS, "--max_steps", "8", "--workers", "2", *args]
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{tag}.log", "w") as f:  # a file, not a pipe: orphaned workers share it
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**ENV, "KILL_RANK": "0"},
                                timeout=300).returncode
        assert (rc == 0) == expect_ok, f"rc={rc}\n{(out / f'{tag}.log').read_text()[-6000:]}"
        return [json.loads((out / f"{tag}-rank{r}.json").read_text()) for r in range(2)]

    ref = torchrun(tmp_path / "ref", "ref")
    out = tmp_path / "crash"
    crash = torchrun(out, "crash", "--kill_at", "6", expect_ok=False)
    frozen = freeze_orphans(crash[0]["children"], out / "run" / "smart_ckpt" / "default" / ".writer.lock",
                            required=False)
    try:
        resumed = torchrun(out, "resume", "--resume", "auto")
    finally:
        thaw(frozen)
    for r in range(2):
        assert resumed[r]["resumed_from"] == 6
        assert resumed[r]["losses"] == ref[r]["losses"][6:]


@pytest.mark.integration
def test_notebook_rerun_after_an_exception_and_several_trainers_in_one_process(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(NOTEBOOK), str(tmp_path)], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["raised"] == "a bug in a user callback at step 6"
    # The held save of step 6 was never written (its step's logging never came): step 4 is the restore point.
    assert out["resumed_from"] == 4
    assert out["resumed"] == out["reference"][4:]
    assert len(out["handover"]) == 1 and out["handover"][0].startswith("INFO: task 'default' under ")
    assert "this process already runs on it (session " in out["handover"][0]
    assert "that run is closed first (its writes in flight commit) and session " in out["handover"][0]
    assert all(line.startswith("INFO: ") for line in out["lock_lines"])  # never a warning, never an error
    assert out["hooks"] == 0  # the failed run's probes were removed when it was closed
    assert out["each"] == [[s, f"default-step-{s}"] for s, _ in out["each"]] and len(out["each"]) >= 3


@pytest.mark.integration
def test_a_read_only_store(reference: dict, tmp_path: Path) -> None:
    crash, _ = run_worker(tmp_path, "crash", *ARGS, "--kill_at", "6", expect_ok=False)
    psutil.wait_procs([psutil.Process(p) for p in crash["children"] if psutil.pid_exists(p)], timeout=60)
    root = tmp_path / "run" / "smart_ckpt"
    before = tree(root)  # once the orphaned writer process has closed the catalog
    # Training into it: a typed error before the first step, naming the root and the fixes.
    cmd = read_only_command(root, [sys.executable, str(WORKER), "--out", str(tmp_path), "--tag", "ro", *ARGS,
                                   "--resume", "auto"])
    if cmd is None:
        pytest.skip("no read-only mount possible here (needs root and mount namespaces)")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode != 0
    assert f"StoreNotWritableError: the store root {root} is not writable" in proc.stderr
    assert "Make it writable, or save to another root" in proc.stderr
    assert f"resume_checkpoint(trainer, '{root / 'default'}/step-<N>')" in proc.stderr
    assert "'loss'" not in proc.stdout + proc.stderr and not (tmp_path / "ro-rank0.json").exists()
    # Resuming from it by path while saving into this run's own store.
    other = tmp_path / "other"
    cmd = read_only_command(root, [sys.executable, str(WORKER), "--out", str(other), "--tag", "resume", *ARGS,
                                   "--resume", str(root / "default" / "step-6")])
    assert cmd is not None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    resumed = json.loads((other / "resume-rank0.json").read_text())
    assert resumed["resumed_from"] == 6 and resumed["losses"] == reference["losses"][6:]
    assert [e["step"] for e in resumed["events"] if e["error"] is None][:2] == [9, 12]
    assert (other / "run" / "smart_ckpt" / "default" / "step-12" / "manifest.json").is_file()
    # The command line's read verbs on it.
    script = textwrap.dedent(f"""
        set -e
        {sys.executable} -m hf_dynamic_ckpt.cli ls {root} --json > {tmp_path}/ls.json
        {sys.executable} -m hf_dynamic_ckpt.cli show {root} step:6 --json > {tmp_path}/show.json
        {sys.executable} -m hf_dynamic_ckpt.cli verify {root} --all > {tmp_path}/verify.txt 2>&1
        """)
    cmd = read_only_command(root, ["sh", "-c", script])
    assert cmd is not None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 6 in [row["step"] for row in json.loads((tmp_path / "ls.json").read_text())]
    assert json.loads((tmp_path / "show.json").read_text())["step"] == 6
    assert tree(root) == before
    assert crash["killed"]


@pytest.mark.integration
def test_a_store_root_deleted_mid_run_is_recreated_and_resumed_from(reference: dict, tmp_path: Path) -> None:
    crash, log = run_worker(tmp_path, "crash", *ARGS, "--delete_store_at", "5", "--kill_at", "10",
                            expect_ok=False)
    assert log.count("was deleted while this run was writing it; recreated it") == 1
    ok = [e["step"] for e in crash["events"] if e["error"] is None]
    assert ok[-2:] == [6, 9]  # every save after the deletion committed
    assert all(e["error"] is None for e in crash["events"] if e["step"] > 5)
    resumed, _ = run_worker(tmp_path, "resume", *ARGS, "--resume", "auto")
    assert resumed["resumed_from"] == 9
    assert resumed["losses"] == reference["losses"][9:]


def test_a_duplicate_yaml_key_names_the_key_and_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_config.yaml"
    path.write_text("base_interval: 10\nstorage_levels:\n  level_1: {compression: zstd}\nbase_interval: 20\n")
    with pytest.raises(ConfigError) as exc:
        SmartCkptConfig.from_yaml(path)
    assert str(exc.value) == (f"{path}: key 'base_interval' is given twice, on line 1 and line 4; keep one (YAML "
                              "would silently use the last).")
    path.write_text("storage_levels:\n  level_1:\n    compression: zstd\n    compression: none\n")
    with pytest.raises(ConfigError, match="key 'compression' is given twice, on line 3 and line 4"):
        SmartCkptConfig.from_yaml(path)
    path.write_text("base_interval: 10\nstorage_levels:\n  level_1: {compression: zstd, compression_level: 1}\n")
    assert SmartCkptConfig.from_yaml(path).base_interval == 10


_WRITE_1GIB = """
import sys, torch
torch.set_num_threads(1)
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore, SaveRequest
big = torch.randn(1 << 28)  # one honest 1 GiB fp32 tensor: incompressible, so stored raw in its frames
store = CheckpointStore(sys.argv[1], task_id="run", compression_threads=1)
store.save(CheckpointState(step=1, weights={"w": torch.zeros(8, 4)}, optimizer={
    "state": {0: {"exp_avg": big}}, "param_groups": [{"lr": 0.1, "params": [0]}]}),
    SaveRequest(step=1, reason="honest"))
store.close()
"""

_PEAK = """
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":")) << 10

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
"""
"""What the memory scripts below measure with: this process's RSS and its peak since `reset_peak()`."""

_LOAD_1GIB = _PEAK + """
import json, sys, torch
from hf_dynamic_ckpt.config import FallbackStrategy
from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.run.resume import plan_resume
from hf_dynamic_ckpt.store import CheckpointStore


store = CheckpointStore(sys.argv[1], task_id="run", cleanup=False)
out = {}
reset_peak(); base = status("VmRSS")
loaded = plan_resume(store, "auto", fallback=FallbackStrategy.FULL, expected={"w": torch.empty(8, 4)}).loaded
out["refused_peak"] = status("VmHWM") - base
out["optimizer"] = loaded.optimizer is not None
out["warnings"] = loaded.warnings
reset_peak(); base = status("VmRSS")
state = store.load("step:1", tiers={Tier.OPTIMIZER}, mmap=False)
out["load_peak"] = status("VmHWM") - base
out["held"] = status("VmRSS") - base
out["numel"] = state.optimizer["state"][0]["exp_avg"].numel()
print(json.dumps(out))
"""


@pytest.mark.integration
def test_an_l1_tensor_declared_at_1_gib_is_decoded_in_bounded_memory_or_refused_before_allocation(
        tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-c", textwrap.dedent(_WRITE_1GIB), str(tmp_path)], check=True, env=ENV,
                   timeout=300)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_LOAD_1GIB), str(tmp_path)], capture_output=True,
                          text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    gib = 1 << 30
    # Refused from the header: this model's parameters hold 32 elements; nothing was allocated.
    assert out["optimizer"] is False and out["refused_peak"] < 64 << 20, out
    assert any("tensor 'optimizer/state/0/exp_avg' declares shape [268435456] (268435456 elements), more than any "
               "state of this model's parameters holds (64)" in w for w in out["warnings"]), out["warnings"]
    # Loaded without a bound: the decoded tensor once, not the tensor plus the file's mapped pages.
    assert out["numel"] == 1 << 28 and out["held"] >= gib
    assert out["load_peak"] <= 1.1 * gib, out


_LOAD_UNNAMED_1GIB = _PEAK + """
import json, sys
from hf_dynamic_ckpt.config import FallbackStrategy
from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.errors import CorruptCheckpointError
from hf_dynamic_ckpt.run.resume import plan_resume, read_optimizer_tier
from hf_dynamic_ckpt.store import CheckpointStore


def store_load():
    try:
        store.load("step:1", tiers={Tier.OPTIMIZER}, mmap=False)
    except CorruptCheckpointError as e:
        return str(e)
    return None

def resume_read():
    return read_optimizer_tier(store, store.resolve("step:1"), 0, None).lost

def restore_plan():
    plan = plan_resume(store, "step:1", fallback=FallbackStrategy.FULL)
    return plan.loaded.info.step, plan.loaded.optimizer is not None, plan.degraded, plan.loaded.warnings

store = CheckpointStore(sys.argv[1], task_id="run", cleanup=False)
out = {}
for name, path in [("store", store_load), ("resume_read", resume_read), ("plan_resume", restore_plan)]:
    reset_peak(); base = status("VmRSS")
    out[name] = path()
    out[name + "_peak"] = status("VmHWM") - base
print(json.dumps(out))
"""


@pytest.mark.integration
def test_an_l1_tensor_the_structure_does_not_name_is_freed_before_each_retry_and_fallback(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-c", textwrap.dedent(_WRITE_1GIB), str(tmp_path)], check=True, env=ENV,
                   timeout=300)
    step = tmp_path / "run" / "step-1"
    structure = (step / "optimizer.json").read_text()
    assert structure.count('"optimizer/state/0/exp_avg"') == 1
    # The file stays honest and verified; only the structure names another tensor, found out after the decode.
    replace_file(step, "optimizer.json", structure.replace('/exp_avg"', '/exp_avg_sq"').encode())
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_LOAD_UNNAMED_1GIB), str(tmp_path)],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    why = "State structure refers to tensor 'optimizer/state/0/exp_avg_sq', which the tensor file does not hold"
    assert why in out["store"] and why in out["resume_read"], out
    step_used, has_optimizer, degraded, warnings = out["plan_resume"]
    assert (step_used, has_optimizer, degraded) == (1, False, True), out
    assert warnings[0].startswith("resuming from weights only: optimizer state of step 1 is lost"), warnings
    assert why in warnings[0]
    # Every read, retries and fallbacks included, frees what it decoded before the next: one tensor at a time.
    gib = 1 << 30
    for name in ("store", "resume_read", "plan_resume"):
        assert out[name + "_peak"] <= 1.1 * gib, (name, out)
