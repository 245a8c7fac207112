#!/usr/bin/env python
"""Save overhead, memory, resume and restart at the widths of Qwen2-7B and Llama-3-8B, inside real `Trainer` runs.

The other benchmarks use models of 1-60M parameters with toy widths; users fine-tune Qwen2-7B /
Llama-3-8B (hidden 3584-4096, intermediate 14336-18944, vocabulary 128-152k, untied). This one
builds those widths from their published config values (no download) with fewer layers, bf16
weights, random tokens (batch 1 x 64 by default), one training thread, and measures:

- **the trio** (`--repeats` times, interleaved, each run a fresh process): `none` (no saves),
  `native` (Trainer's `save_steps=k`), `smart` (`SmartCkptCallback(SmartCkptConfig(base_interval=k))`,
  default engine: a writer process). Reported: blocking per save (`SaveEvent.blocking_ms`) as a
  share of the run's median step; overhead per save against Trainer's, two ways: from Trainer's
  `train_runtime` ((run - none) / saves) and inside each run (what the save steps and the steps
  that ran during a write took beyond the run's median clean step, per save); step inflation while
  a write runs (median busy step / median clean step - 1; save steps excluded); the staging mode of
  every save (`buffered` = background write, `streaming` = memory was short and the save blocked
  for the whole write).
- **bytes per checkpoint per tier** (L0 weights, L1 optimizer, L2 RNG/data position/metadata) of
  Trainer's `checkpoint-P` and of the store's `step-P` of the same state.
- **peak memory** of the training process and of the writer process, read by this script: the
  peak RSS is the kernel's `VmHWM` (`/proc/<pid>/status`, every `--mem-interval` seconds); private
  (`Private_Clean + Private_Dirty`) and shared (`Shared_*`) apart are the largest samples of
  `/proc/<pid>/smaps_rollup`, read at most 5 % of the time (each read walks the page tables).
  (`ru_maxrss` of children is no use here: it counts the parent's pages at fork time.) The writer
  is the training process's child started by `multiprocessing`'s spawn; its "interpreter" is its
  private memory just before the first save it wrote (saves taken while it starts are written by
  a thread of the training process: the `staging` column names the writer of each save); "staging
  buffers" are the engine's snapshot buffers (`SaveEngine.buffer_bytes`).
- **resume** (one preparation run of P+2 steps with both Trainer's `save_steps=P` and ours, then
  `--repeats` x {fresh start, Trainer's native resume of `checkpoint-P`, `resume_checkpoint(trainer,
  "step:P")`}, interleaved, fresh processes): time from the `train` call (ours: from
  `resume_checkpoint`) to the end of the first resumed step (ours loads the optimizer state during
  that step); the goal reads that time less the same process's next step ("resume work": the step
  itself is seconds at these widths and would hide the resume), and the table also shows it less a
  fresh start's time to the end of its first step. The losses of the two resumed steps must equal
  the preparation run's, to the bit, for both.
- **restart** after a crash, from memory against disk, of the same checkpoint (`--parts restart`, not in the
  default parts; `--repeats` times, each in a fresh work directory): a run with the memory tier on
  (`runtime.memory_every=1`, a disk save at step P) waits after step P+1 for that disk save (a slot is skipped
  while one writes), polls the slots with the store API until the slot of step P+1 is committed and SIGKILLs its
  whole process group (its own session: the writer process dies too, so no watcher persists the slot); a fresh
  process then `resume_checkpoint(trainer, "auto")`s, which must restore step P+1 from the slot under `/dev/shm`
  (checked; the library copies the slot into the disk store in a background thread meanwhile); then, the store's
  pages dropped, a fresh process resumes `step:P+1` from that copy on disk. Both timed as the resume part's (from
  `resume_checkpoint` to the end of the first resumed step; also less the process's next step); their losses must
  be bit-equal. A restart also runs with `memory_every=1` (the same command). Two slots of a full fine-tune's state
  must fit in `/dev/shm` and the host memory beside the state and its snapshot buffers: with the 152k vocabulary
  (1.09B untied embedding parameters) one 7B-width layer is 1.32B parameters, a slot of ~7.9 GB (bf16 weights and
  moments) beside ~10.6 GB of training state and ~7.9 GB of buffers, more than a 24 GB machine holds (the tier turns
  itself off: "do not fit"), so there `--layers 1 --vocab 32000` (hidden and intermediate widths kept: 0.46B
  parameters, a 2.6 GiB checkpoint) measures it. `--vocab N` only changes the vocabulary (and
  the base weights' file name); the per-layer cost, which the widths set, stays. Run it alone: a pytest session of
  this repository under the same user removes, at its end, every slot directory made while it ran
  (`tests/conftest.py`), a live run's too (the crash run then ends unkilled, or the restart reads from disk).

Goals (each a ratio inside one run of this script): blocking per save < 1 % of a step (LoRA and full
fine-tune); overhead per save <= 0.2x Trainer's; resume <= 0.5x Trainer's; the writer's private
memory <= its staging buffers + its interpreter; restart from memory <= 0.5x the disk resume (cold) of the same
checkpoint. The last lines print each with met / not met.

Modes: `lora` (bf16 base, LoRA r=16 on all seven projections, fp32 adapter: PEFT's default) and
`full` (every weight trained in bf16, AdamW moments in bf16). `--layers auto` (default) takes as
many layers as this machine's memory holds for the mode (the smart run's peak: state + snapshot
buffers + two interpreters), up to `--max-layers` (default 2: the step time grows with the
layers). A few layers understate the stall's share of a step: the stall grows with the trained
parameters, per layer, while the step also carries the fixed cost of the 128-152k-vocabulary
head; `recipes/estimate_sizes.py --measured <json>` scales both to 28/32 layers. A full
fine-tune of one 7B-width layer is 1.3B parameters (the untied embeddings are 1.09B of them):
~11 GB of state and ~8 GB of snapshot buffers for the smart run, ~8 GB per checkpoint (up to
~40 GB of disk at once). On a 24 GB machine the engine's default `memory_margin` (15 % of RAM
kept free) makes those saves stream (block for the whole write): `--memory-margin 0.05` measures
the buffered path.

The base weights are generated once per (model, layers) into `<out>/base-<model>-<layers>.safetensors`
(normal(0, 0.02), norms 1, biases 0; ~20 s per 1.3B parameters) and every run loads them
(seconds), so all runs train the same model.

Run (the issue's measurement). Estimated from runs at these widths on 2 busy cores (a LoRA step of
2 layers 1.3-1.8 s, a full fine-tune step of 1 layer 6.2-8.0 s, its first 22 s; ~10 s to start each
run): per model ~10 min for LoRA and ~40 min for the full fine-tune with the defaults (3 repeats,
25 steps), plus ~1.5 min once to generate the base weights:

    python scripts/bench_real_width.py --model qwen2-7b --memory-margin 0.05 \
        --json bench_out/real_width/qwen2-7b.json
    python scripts/bench_real_width.py --model llama3-8b --memory-margin 0.05 \
        --json bench_out/real_width/llama3-8b.json
    python recipes/estimate_sizes.py --measured bench_out/real_width/qwen2-7b.json bench_out/real_width/llama3-8b.json

    python scripts/bench_real_width.py --mode full --parts restart --layers 1 --vocab 32000 --repeats 2
    python scripts/bench_real_width.py --mode lora --parts restart --repeats 2    # ~5 min per mode
    # BENCH_PROFILE_RESUME=DIR: a cProfile of each restart's resume_checkpoint, in DIR/<variant>.txt

    python scripts/bench_real_width.py --smoke      # toy widths, LoRA only, six runs of ~5-10 s each
    python scripts/bench_real_width.py --report bench_out/real_width/qwen2-7b.json   # its tables again

`--device cuda` runs the same on a GPU (`scripts/gpu_check.py` uses it for the absolute stall
and restore at Qwen2-7B width); memory then fits the layers to the GPU's free memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
MIB = 1024**2

# Published config.json values (Qwen/Qwen2-7B, meta-llama/Meta-Llama-3-8B); "smoke" is a toy width.
MODELS: dict[str, dict[str, Any]] = {
    "qwen2-7b": {"arch": "qwen2", "layers": 28, "config": {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
        "num_key_value_heads": 4}},
    "llama3-8b": {"arch": "llama", "layers": 32, "config": {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_key_value_heads": 8}},
    "smoke": {"arch": "qwen2", "layers": 2, "config": {
        "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2}},
}
LORA_R = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RESUMED_STEPS = 2  # the first resumed step checks weights, RNG and data order; the second the optimizer state
OVERHEAD_BYTES = 3 * GIB  # interpreters (training, writer), activations, allocator slack: for the layer fit
TIERS = ("weights", "optimizer", "state")


def set_vocab(model: str, vocab: int | None) -> None:
    """`--vocab N`: the model's vocabulary is N, not its config's (in this process; children get it in their spec).
    Only for a state that must fit this machine's memory several times over (`--parts restart`)."""
    if vocab:
        MODELS[model]["config"]["vocab_size"] = vocab


# ----------------------------------------------------------------------------- the model, on paper
def param_counts(model: str, layers: int) -> dict[str, int]:
    """Parameters of the model with `layers` layers: base total, matmul (all but the input embedding), LoRA."""
    c = MODELS[model]["config"]
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    bias = h + 2 * kv if MODELS[model]["arch"] == "qwen2" else 0  # Qwen2 has q/k/v biases
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + bias + 2 * h
    lora = LORA_R * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i))
    return {"base": 2 * v * h + h + layers * layer, "matmul": v * h + layers * layer, "lora": layers * lora}


def state_bytes(model: str, layers: int, mode: str) -> tuple[int, int]:
    """(bytes the trained state needs where the model lives, bytes of the snapshot buffers) of the smart run."""
    n = param_counts(model, layers)
    if mode == "lora":  # bf16 base; fp32 adapter, its gradient and two AdamW moments; buffers: adapter + moments
        return 2 * n["base"] + 16 * n["lora"], 12 * n["lora"]
    return 8 * n["base"], 6 * n["base"]  # bf16 weights, gradients, two moments; buffers: weights + moments


def fit_layers(model: str, mode: str, device: str, max_layers: int) -> tuple[int, str]:
    """As many layers as the memory holds for the smart run of `mode` (at least 1), and why."""
    import psutil

    host = psutil.virtual_memory().available
    gpu = _gpu_free_bytes() if device == "cuda" else None
    best = 0
    for layers in range(1, min(max_layers, MODELS[model]["layers"]) + 1):
        live, staging = state_bytes(model, layers, mode)
        host_need = staging + OVERHEAD_BYTES + (0 if gpu is not None else live)
        if host_need > 0.9 * host or (gpu is not None and live + GIB > 0.9 * gpu):
            break
        best = layers
    live, staging = state_bytes(model, max(best, 1), mode)
    where = f"host {host / GIB:.1f} GiB available" + (f", GPU {gpu / GIB:.1f} GiB free" if gpu is not None else "")
    why = f"{max(best, 1)} layer(s): state {live / GIB:.1f} GiB + snapshot buffers {staging / GIB:.1f} GiB ({where})"
    if best == 0:
        why += "; does NOT fit, expect swapping, streamed saves or an OOM kill"
    return max(best, 1), why


def _gpu_free_bytes() -> int:
    import pynvml  # NVML: no CUDA context in this process

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)
    finally:
        pynvml.nvmlShutdown()


# ----------------------------------------------------------------------------- memory of other processes
def smaps_rollup(pid: int) -> dict[str, int] | None:
    """`/proc/<pid>/smaps_rollup` in bytes, plus `private` and `shared` sums; `None` once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    out["private"] = out.get("Private_Clean", 0) + out.get("Private_Dirty", 0)
    out["shared"] = out.get("Shared_Clean", 0) + out.get("Shared_Dirty", 0)
    return out


def writer_pid(pid: int) -> int | None:
    """The writer process of training process `pid`: its child started by multiprocessing's spawn."""
    import psutil

    try:
        for child in psutil.Process(pid).children():
            if any("spawn_main" in part for part in child.cmdline()):
                return int(child.pid)
    except psutil.Error:
        pass
    return None


def proc_status(pid: int) -> dict[str, int] | None:
    """The memory lines of `/proc/<pid>/status` in bytes (`VmHWM`: the kernel's peak RSS); `None` once gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key.startswith(("Vm", "Rss")) and len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out


class MemorySampler(threading.Thread):
    """Samples the memory of a training process and of its writer process until stopped.

    `/proc/<pid>/status` every `interval` (counters: cheap; `VmHWM` is the exact peak RSS);
    `smaps_rollup` (private and shared apart) at most 5 % of the time: the kernel walks every
    page table to answer it (~40 ms per 4 GiB resident here), on the core the writer runs on.
    """

    FIELDS = ("VmHWM", "RssAnon", "RssShmem", "Rss", "private", "shared")

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True, name="memory-sampler")
        self.pid, self.interval = pid, interval
        self.peaks: dict[str, dict[str, int]] = {"train": {}, "writer": {}}
        self.writer_series: list[tuple[float, int]] = []  # (wall time, smaps private bytes) of the writer
        self.samples = 0
        self._next_smaps: dict[int, float] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        writer = None
        while not self._halt.is_set():
            if not self._sample("train", self.pid):
                return
            if writer is None or not Path(f"/proc/{writer}").exists():
                writer = writer_pid(self.pid)
            if writer is not None:
                self._sample("writer", writer)
            self.samples += 1
            self._halt.wait(self.interval)

    def _sample(self, who: str, pid: int) -> bool:
        status = proc_status(pid)
        if status is None:
            return False
        self._peak(who, status)
        now = time.monotonic()
        if now >= self._next_smaps.get(pid, 0.0):
            mem = smaps_rollup(pid)
            cost = time.monotonic() - now
            self._next_smaps[pid] = now + max(self.interval, 20 * cost)
            if mem is not None:
                self._peak(who, mem)
                if who == "writer":
                    self.writer_series.append((time.time(), mem["private"]))
        return True

    def _peak(self, who: str, mem: dict[str, int]) -> None:
        for key in self.FIELDS:
            if key in mem:
                self.peaks[who][key] = max(self.peaks[who].get(key, 0), mem[key])

    def stop(self) -> None:
        self._halt.set()
        self.join()


# ----------------------------------------------------------------------------- the training child
def _build_base(spec: dict[str, Any]) -> None:
    """Write the base weights of (model, layers) as safetensors, one tensor in memory at a time."""
    import torch

    torch.set_num_threads(2)  # generating ~1.3B normals per layer-1 model: the one step worth two threads
    names = _model_shapes(spec["model"], spec["layers"])
    header: dict[str, Any] = {"__metadata__": {"model": spec["model"], "layers": str(spec["layers"]), "seed": "0"}}
    offset = 0
    for name, shape in names:
        size = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    gen = torch.Generator().manual_seed(0)
    path = Path(spec["base"])
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, shape in names:
            f.write(_init_tensor(name, shape, gen).view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)


def _init_tensor(name: str, shape: tuple[int, ...], gen: Any) -> Any:
    """One bf16 base weight, as the models' `_init_weights` makes it: normal(0, 0.02), norms 1, biases 0."""
    import torch

    if len(shape) > 1:
        return torch.empty(shape, dtype=torch.bfloat16, device=gen.device).normal_(0.0, 0.02, generator=gen)
    fill = torch.ones if name.endswith("norm.weight") else torch.zeros
    return fill(shape, dtype=torch.bfloat16, device=gen.device)


def _model_shapes(model: str, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, from a model built on the meta device."""
    import torch

    with torch.device("meta"):
        m = _new_model(model, layers)
    return [(n, tuple(p.shape)) for n, p in m.state_dict().items()]


def _new_model(model: str, layers: int) -> Any:
    import transformers

    arch = MODELS[model]["arch"]
    config_cls, model_cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[arch]
    config = config_cls(**MODELS[model]["config"], num_hidden_layers=layers, tie_word_embeddings=False,
                        max_position_embeddings=4096)
    return model_cls(config)


def _load_model(spec: dict[str, Any]) -> Any:
    """The bf16 base model on `spec["device"]`, wrapped with LoRA in `lora` mode: from the base file on
    CPU; on CUDA generated in place, which takes less than reading the file would (same seed, same order)."""
    import torch
    from accelerate import init_empty_weights
    from safetensors import safe_open

    from examples import toy

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with init_empty_weights(include_buffers=False):  # parameters on `meta`: no init, filled from the file
            model = _new_model(spec["model"], spec["layers"])
    finally:
        torch.set_default_dtype(previous)
    if spec["base"] is None:
        gen = torch.Generator(device=spec["device"]).manual_seed(0)
        state = {name: _init_tensor(name, tuple(t.shape), gen) for name, t in model.state_dict().items()}
    else:
        with safe_open(spec["base"], framework="pt", device=spec["device"]) as f:
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    model.load_state_dict(state, assign=True, strict=True)
    del state
    model.to(spec["device"])  # the rotary buffers
    model.train()
    if spec["mode"] == "lora":
        model = toy.lora(model, r=LORA_R, target_modules=LORA_TARGETS, seed=0)
    return model


# The one place this script reads below the public API: nothing public says whether a background
# write is running (`SaveEngine.busy`), how large the snapshot buffers are (`buffer_bytes`), or which
# writer wrote a save (`SaveHandle.writer`: the writer process, or a thread while it was starting).
def _engine(callback: Any) -> Any:
    """The callback's save engine (`None` before training starts)."""
    checkpointer = callback.run
    return checkpointer.engine if checkpointer is not None else None


def _note_writers(callback: Any, labels: dict[str, str]) -> None:
    """Record which writer took each save still in flight ("process", or a thread while the process
    starts); the event drops its handle once the save is settled, so this runs at every step."""
    checkpointer = callback.run
    for event in checkpointer.events if checkpointer is not None else ():
        writer = getattr(getattr(event, "handle", None), "writer", None)
        if writer is not None:
            labels[str(event.step)] = writer


def child(spec: dict[str, Any]) -> None:
    """One training run in this fresh process; writes its measurements to `spec["result"]`."""
    set_vocab(spec["model"], spec.get("vocab"))
    if spec["role"] == "base":
        _build_base(spec)
        return
    import torch

    torch.set_num_threads(1)
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint

    variant, out, cuda = spec["variant"], Path(spec["out"]), spec["device"] == "cuda"
    prep = Path(spec["prep"]) if spec.get("prep") else None
    restart = variant in ("restart_memory", "restart_disk")  # after `crash`: from its memory slot, from disk
    if variant == "crash" or restart:  # the library's INFO lines (the memory tier off, a slot persisted): output.txt
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    # The preparation run's Trainer saves the restore point only; ours may save more often (more stall samples).
    native_every = spec["prep_steps"] if variant == "prep" else spec["k"]
    smart_every = (spec["prep_interval"] or spec["prep_steps"]) if variant in (
        "prep", "ours_resume", "crash") or restart else spec["k"]
    resumed_end = (spec["restart_step"] if restart else spec["prep_steps"]) + RESUMED_STEPS
    max_steps = resumed_end if variant in ("prep", "native_resume", "ours_resume") or restart else {"fresh": 1}.get(
        variant, spec["steps"])  # `crash` is killed long before its last step
    model = _load_model(spec)
    dataset = toy.random_token_dataset(num_examples=max(max_steps, spec["steps"]) * spec["batch"], seq_len=spec["seq"],
                                       vocab_size=MODELS[spec["model"]]["config"]["vocab_size"], seed=1)
    marks: dict[str, Any] = {"steps": [], "gaps": {}, "step_end_wall": {}, "losses": [], "writers": {},
                             "trainer_saves": []}
    smart: Any = None
    inner = model.base_model.model if spec["mode"] == "lora" else model

    def record_loss(module: Any, inputs: Any, output: Any) -> None:
        if module.training:
            marks["losses"].append(output.loss.detach().double().item().hex())

    inner.register_forward_hook(record_loss)

    def crash_once_committed(step: int) -> None:
        """The crash run, as the step after `step` begins (the slot of `step` was just taken): once that slot is
        committed (polled with the public store API), write the result and SIGKILL the whole process group, the
        writer process too, so no watcher persists the slot. A slot skipped (a disk save still writing): the next."""
        from hf_dynamic_ckpt.store import CheckpointStore
        from hf_dynamic_ckpt.store.slots import slots_dir

        tier, engine, t = smart.run.memory, _engine(smart), time.perf_counter()
        if not tier.on:
            raise RuntimeError(f"the memory tier is off: {tier.off_reason}")
        while True:
            busy = engine.busy  # before the listing: a write that ends in between is listed
            slots = CheckpointStore(slots_dir(root, smart_config.task_id), task_id=smart_config.task_id,
                                    read_only=True)
            try:
                found = {i.step for i in slots.list(include_unhealthy=True, include_abandoned=True)}
            finally:
                slots.close()
            if step in found:
                break
            if not busy:
                return
            if time.perf_counter() - t > 600:
                raise RuntimeError(f"the slot of step {step} was not committed within 600 s")
            time.sleep(0.05)
        params = list(model.parameters())
        Path(spec["result"]).write_text(json.dumps({
            **marks, "slot_step": step, "global_step": step, "slot_wait_s": time.perf_counter() - t,
            "slot_bytes": tier.bytes, "slots_skipped": tier.skipped, "params": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad)}))
        os.killpg(0, signal.SIGKILL)

    class Timer(TrainerCallback):
        """Per step: its time (on_step_begin -> on_step_end), the gap to the next step (where a save
        of it is taken), and whether a background write was running when it began."""

        begin = 0.0
        end: float | None = None
        busy = False

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.begin = time.perf_counter()
            marks.setdefault("first_step", time.time())
            if self.end is not None:
                marks["gaps"][state.global_step] = self.begin - self.end
            engine = _engine(smart) if smart is not None else None
            self.busy = bool(engine is not None and engine.busy)
            if engine is not None:  # the buffers are released when training ends: their size is read here
                marks["buffer_bytes"] = max(marks.get("buffer_bytes", 0), engine.buffer_bytes)
                _note_writers(smart, marks["writers"])
            if variant == "crash" and state.global_step > spec["prep_steps"]:  # the slot of the step before: taken
                crash_once_committed(state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if cuda:
                torch.cuda.synchronize()  # a step's time is the GPU's, not the time to queue it
            self.end = time.perf_counter()
            marks.setdefault("first_step_end", time.time())
            marks["step_end_wall"][state.global_step] = time.time()
            marks["steps"].append((state.global_step, self.end - self.begin, self.busy))
            if variant == "crash" and state.global_step == spec["prep_steps"] + 1:
                # The slot of this step is due when the next begins, and skipped while the disk save of the step
                # before is still writing (seconds for GBs): a long run's slots come long after its disk save.
                started, engine = time.perf_counter(), _engine(smart)
                while engine.busy and time.perf_counter() - started < 600:
                    time.sleep(0.05)
                marks["disk_wait_s"] = time.perf_counter() - started
                self.end = time.perf_counter()
            if smart is not None and smart.run is not None and state.global_step == 1:
                # The writer process starts after the first step; saves before it is up write synchronously. A run
                # of days saves first long after; this one saves within seconds, so it waits for the writer here.
                started = time.perf_counter()
                smart.run.engine.start(wait_s=120)
                marks["writer_start_s"] = time.perf_counter() - started
                self.end = time.perf_counter()

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks["trainer_saves"].append(state.global_step)  # Trainer's own saves (rotation deletes folders)

    native_saves = variant in ("native", "prep")
    targs = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=spec["batch"], max_steps=max_steps,
        use_cpu=not cuda, bf16=True, report_to=[], logging_strategy="no", disable_tqdm=True, learning_rate=1e-4,
        seed=0, dataloader_num_workers=0, save_strategy="steps" if native_saves else "no", save_steps=native_every,
        save_total_limit=3,  # rotation as ours keeps the newest 3: a 7B-width full fine-tune writes ~8 GB per save
    )
    callbacks: list[Any] = [Timer()]
    if variant in ("tier_on", "tier_off"):  # the memory tier alone: no disk save before the final one
        smart_every = 10**6
    if variant in ("smart", "prep", "ours_resume", "tier_on", "tier_off", "crash") or restart:
        root = (prep if (variant == "ours_resume" or restart) and prep is not None else out) / "smart_ckpt"
        extra = {"memory_margin": spec["memory_margin"]} if spec.get("memory_margin") is not None else {}
        extra["memory_tier"] = variant != "tier_off"
        if variant == "crash" or restart:  # a slot every step: the crash loses no step (a restart: the same command)
            extra["memory_every"] = 1
        if spec.get("overlap_snapshot") is not None:
            extra["overlap_snapshot"] = spec["overlap_snapshot"]
        engine = {"engine": spec["engine"]} if spec.get("engine") else {}
        smart_config = SmartCkptConfig(base_interval=smart_every, root=str(root), runtime=extra, **engine)
        smart = SmartCkptCallback(smart_config)
        callbacks.insert(0, smart)
    trainer = Trainer(model=model, args=targs, train_dataset=dataset, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)
    phases: dict[str, float] = {}  # where a resume's time goes: seconds per phase

    def timed(owner: Any, name: str, label: str) -> None:
        """Add the time of every call of `owner.<name>` to `phases[label]`."""
        original = getattr(owner, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - t

        setattr(owner, name, wrapper)

    if variant in ("native_resume", "ours_resume") or restart:  # Trainer's loading (ours: its second read of weights)
        timed(trainer, "_load_from_checkpoint", "Trainer loads the weights")
        timed(trainer, "_load_optimizer_and_scheduler", "Trainer loads optimizer + scheduler")
        timed(trainer, "_load_rng_state", "Trainer loads the RNG")
    if variant == "ours_resume" or restart:
        from hf_dynamic_ckpt.integrations import trainer as trainer_module
        from hf_dynamic_ckpt.run import resume as resume_module
        from hf_dynamic_ckpt.store import slots as slots_module

        # Inside resume_checkpoint: its weights file goes into Trainer's folder by a hard link, a copy from /dev/shm.
        timed(trainer_module, "_write_weights", "of which: the weights into Trainer's folder (link, or copy)")
        timed(resume_module, "read_optimizer_tier", "L1 read + decode (background thread)")
        timed(smart, "_apply_resumed_optimizer", "wait for L1 + load it (before the first update)")
        timed(slots_module, "persist_newest", "persist the slot to disk (background thread)")
    slot_ms: list[float] = []
    if variant == "tier_on":  # the training thread's time per memory slot (the snapshot), from the engine's handle
        from hf_dynamic_ckpt.engine import SaveEngine

        save = SaveEngine.save

        def save_timed(self: Any, *a: Any, **kw: Any) -> Any:
            handle = save(self, *a, **kw)
            if kw.get("memory") and not handle.skipped:
                slot_ms.append(handle.blocking_ms)
            return handle

        SaveEngine.save = save_timed  # type: ignore[method-assign]
    start = time.time()
    marks["resume_start"] = start
    if variant == "ours_resume" or restart:
        ref = "auto" if variant == "restart_memory" else f"step:{spec['restart_step' if restart else 'prep_steps']}"
        label = "resume_checkpoint: choose, read + verify L0, link"
        phases[label], t = 0.0, time.perf_counter()  # listed before the phases inside it
        if prof_dir := os.environ.get("BENCH_PROFILE_RESUME"):  # where the resume's time goes: top 25 by own time
            import cProfile
            import pstats

            prof = cProfile.Profile()
            path = prof.runcall(resume_checkpoint, trainer, ref)
            phases[label] = time.perf_counter() - t
            with open(Path(prof_dir) / f"{variant}.txt", "a") as f:
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(25)
        else:
            path = resume_checkpoint(trainer, ref)
            phases[label] = time.perf_counter() - t
        if restart:  # the slot of the killed run from host memory; then the same step from the disk store
            from hf_dynamic_ckpt.store.slots import slots_dir

            loaded, where = smart.resumed_from, slots_dir(root, smart_config.task_id)
            marks["resumed_path"] = str(loaded.info.path)
            from_memory = Path(loaded.info.path).is_relative_to(where)
            if loaded.info.step != spec["restart_step"] or from_memory != (variant == "restart_memory"):
                raise RuntimeError(f"{variant} resumed step {loaded.info.step} from {loaded.info.path}, not step "
                                   f"{spec['restart_step']} from {'memory' if variant == 'restart_memory' else 'disk'}")
    elif variant == "native_resume":
        assert prep is not None
        path = str(prep / "trainer" / f"checkpoint-{spec['prep_steps']}")
    else:
        path = None
    result = trainer.train(resume_from_checkpoint=path)
    res: dict[str, Any] = {**marks, "phases": phases, "wall_s": time.time() - start,
                           "train_s": float(result.metrics["train_runtime"]),
                           "global_step": trainer.state.global_step, "optim": str(targs.optim)}
    res["params"] = sum(p.numel() for p in model.parameters())
    res["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if smart is not None:
        events = [e for e in smart.run.events if e.error is None] if smart.run is not None else []
        res["events"] = [{"step": e.step, "reason": e.reason, "blocking_ms": e.blocking_ms, "bytes": e.bytes,
                          "write_ms": e.write_ms, "staging": e.staging, "path": e.path, "end": e.reason == "train_end",
                          "writer": marks["writers"].get(str(e.step))} for e in events]
        res.setdefault("buffer_bytes", 0)
        tier = smart.run.memory if smart.run is not None else None
        if variant in ("tier_on", "crash") and tier is not None:
            res["tier"] = {"slot_ms": slot_ms, "every": tier.every, "saves": tier.saves, "skipped": tier.skipped,
                           "bytes": tier.bytes, "off": tier.off_reason}
    Path(spec["result"]).write_text(json.dumps(res))


# ----------------------------------------------------------------------------- running children
class RunFailed(RuntimeError):
    """A run's process failed (its output is in the message); the mode it belongs to is given up."""


class Runner:
    """Starts each run in a fresh interpreter and samples its memory meanwhile."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                    "TOKENIZERS_PARALLELISM": "false",
                    # Bytecode cached as an installed package has it, even where PYTHONDONTWRITEBYTECODE is set.
                    "PYTHONPYCACHEPREFIX": str(work / "pycache")}
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)

    def run(self, spec: dict[str, Any], label: str, *, killed: bool = False) -> dict[str, Any]:
        """One run; `killed`: it SIGKILLs its own process group (its own session: this script lives on)."""
        result = Path(spec["out"]) / "result.json"
        result.parent.mkdir(parents=True, exist_ok=True)
        result.unlink(missing_ok=True)
        spec = {**spec, "result": str(result)}
        started = time.time()
        proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=killed)
        sampler = MemorySampler(proc.pid, self.args.mem_interval)
        sampler.start()
        output, _ = proc.communicate()
        sampler.stop()
        (Path(spec["out"]) / "output.txt").write_text(output)  # the child's log (INFO lines of the library)
        if proc.returncode not in ((0, -signal.SIGKILL) if killed else (0,)) or not result.exists():
            raise RunFailed(f"{label} failed (exit status {proc.returncode}):\n{output[-6000:]}")
        res: dict[str, Any] = json.loads(result.read_text())
        res["process_s"] = time.time() - started
        res["memory"] = sampler.peaks
        res["writer_series"] = sampler.writer_series
        res["mem_samples"] = sampler.samples
        return res

    def base_file(self, model: str, layers: int) -> Path:
        """The base weights of (model, layers[, vocab]), generated once and reused while the file exists."""
        vocab = f"-v{self.args.vocab}" if self.args.vocab else ""
        path = self.work / f"base-{model}-{layers}{vocab}.safetensors"
        if not path.exists():
            t0 = time.time()
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(
                {"role": "base", "model": model, "layers": layers, "vocab": self.args.vocab, "base": str(path)})],
                env=self.env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RunFailed(f"generating {path.name} failed:\n{proc.stderr[-4000:]}")
            print(f"generated {path.name} ({path.stat().st_size / GIB:.2f} GiB) in {time.time() - t0:.0f} s",
                  flush=True)
        return path


def _spec(args: argparse.Namespace, mode: str, layers: int, base: Path | None, variant: str, out: Path,
          prep: Path | None = None) -> dict[str, Any]:
    engine = None
    if variant == "smart_thread":  # the writer comparison: the same run with the thread writer
        variant, engine = "smart", "thread"
    elif variant == "smart" and args.compare_writers:
        engine = "process"
    return {"role": "run", "engine": engine, "model": args.model, "vocab": args.vocab, "mode": mode, "layers": layers,
            "variant": variant, "out": str(out),
            "base": str(base) if base else None, "steps": args.steps, "k": args.k, "seq": args.seq, "batch": args.batch,
            "device": args.device, "prep_steps": args.prep_steps, "prep_interval": args.prep_interval,
            "prep": str(prep) if prep else None,
            "memory_margin": args.memory_margin,
            "overlap_snapshot": {"auto": None, "true": True, "false": False}[args.overlap_snapshot]}


def _drop_cache(paths: Iterable[Path]) -> None:
    """Ask the kernel to drop these files' cached pages (no root needed; dirty pages are written first)."""
    for path in paths:
        for f in [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file()):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_mode(runner: Runner, args: argparse.Namespace, mode: str, layers: int) -> dict[str, Any]:
    """The trio and the resume of one mode; every run's result, by part and variant."""
    base = runner.base_file(args.model, layers) if args.device == "cpu" else None
    root = runner.work / f"{args.model}-{mode}-{layers}"
    shutil.rmtree(root, ignore_errors=True)
    trio: dict[str, list[dict[str, Any]]] = {"none": [], "native": [], "smart": []}
    if args.compare_writers:
        trio["smart_thread"] = []
    if "trio" in args.parts:
        for rep in range(args.repeats):
            for variant in trio:
                out = root / f"{variant}-{rep}"
                r = runner.run(_spec(args, mode, layers, base, variant, out), f"{mode} {variant} #{rep}")
                shutil.rmtree(out, ignore_errors=True)  # checkpoints of a full fine-tune are GBs each
                trio[variant].append(r)
                saves = _save_steps(r)
                blocking = [round(e["blocking_ms"], 1) for e in r.get("events", []) if not e["end"]]
                print(f"[{mode} #{rep}] {variant}: train {r['train_s']:.1f} s, median step "
                      f"{_median_step(r):.3f} s, saves {saves}" + (f", blocking ms {blocking}" if blocking else "")
                      + f", process {r['process_s']:.0f} s", flush=True)
    tier: dict[str, list[dict[str, Any]]] = {"tier_off": [], "tier_on": []}
    if "tier" in args.parts:  # the memory tier's per-step cost: the same run without it, interleaved
        for rep in range(args.repeats):
            for variant in tier:
                out = root / f"{variant}-{rep}"
                r = runner.run(_spec(args, mode, layers, base, variant, out), f"{mode} {variant} #{rep}")
                shutil.rmtree(out, ignore_errors=True)
                tier[variant].append(r)
                t = r.get("tier") or {}
                print(f"[{mode} #{rep}] {variant}: median step {_median_cycle(r):.3f} s" + (
                    f", {t['saves']} slots of {(t['bytes'] or 0) / 2**20:.1f} MiB (every {t['every']}, "
                    f"{t['skipped']} skipped), blocking median {statistics.median(t['slot_ms'] or [0]):.2f} ms"
                    if t else ""), flush=True)
        off = statistics.median(_median_cycle(r) for r in tier["tier_off"])
        on = statistics.median(_median_cycle(r) for r in tier["tier_on"])
        blocking = statistics.median(ms for r in tier["tier_on"] for ms in (r.get("tier") or {}).get("slot_ms") or [0])
        print(f"[{mode}] memory tier: median step {on:.3f} s on / {off:.3f} s off = {on / off:.3f}x; slot blocking "
              f"{blocking:.2f} ms = {100 * blocking / 1e3 / off:.2f} % of a step (goal for LoRA: <= 1 %)", flush=True)
    resume: dict[str, Any] = {"fresh": [], "native_resume": [], "ours_resume": []}
    if "resume" in args.parts:
        prep = root / "prep"
        resume["prep"] = runner.run(_spec(args, mode, layers, base, "prep", prep), f"{mode} prep")
        resume["bytes"] = {"native": tier_bytes_native(prep / "trainer" / f"checkpoint-{args.prep_steps}"),
                           "ours": tier_bytes_ours(prep / "smart_ckpt", args.prep_steps)}
        print(f"[{mode}] prep: {args.prep_steps + RESUMED_STEPS} steps, bytes {resume['bytes']}", flush=True)
        for rep in range(args.repeats):
            for variant in ("fresh", "native_resume", "ours_resume")[1 if args.no_fresh else 0:]:
                if args.cold:
                    _drop_cache([prep / "trainer", prep / "smart_ckpt"])
                out = root / f"{variant}-{rep}"
                r = runner.run(_spec(args, mode, layers, base, variant, out, prep), f"{mode} {variant} #{rep}")
                shutil.rmtree(out, ignore_errors=True)
                resume[variant].append(r)
                print(f"[{mode} #{rep}] {variant}: to first step end {r['first_step_end'] - r['resume_start']:.2f} s, "
                      f"process {r['process_s']:.0f} s", flush=True)
        if not args.keep:
            shutil.rmtree(prep, ignore_errors=True)
    restart: dict[str, list[dict[str, Any]]] = {"crash": [], "restart_memory": [], "restart_disk": [], "bytes": []}
    if "restart" in args.parts:
        for rep in range(args.repeats):
            _restart_repeat(runner, args, mode, layers, base, root / f"restart-{rep}", rep, restart)
    return {"layers": layers, "trio": trio, "resume": resume, "tier": tier, "restart": restart}


def _restart_repeat(runner: Runner, args: argparse.Namespace, mode: str, layers: int, base: Path | None, work: Path,
                    rep: int, restart: dict[str, list[dict[str, Any]]]) -> None:
    """One repeat of the restart part in a fresh `work`: a run killed with its slot newer than its disk save, then
    the same checkpoint from host memory (`auto`) and, after the store's pages are dropped, from the disk store."""
    from hf_dynamic_ckpt import SmartCkptConfig
    from hf_dynamic_ckpt.store.slots import remove_slots

    crash = work / "crash"
    shutil.rmtree(work, ignore_errors=True)
    try:
        c = runner.run(_spec(args, mode, layers, base, "crash", crash), f"{mode} crash #{rep}", killed=True)
        if "slot_step" not in c:
            raise RunFailed(f"{mode} crash #{rep} ended without a slot newer than its disk save (memory tier: "
                            f"{c.get('tier')}):\n{(crash / 'output.txt').read_text()[-6000:]}")
        runs = {"crash": c}
        for variant in ("restart_memory", "restart_disk"):
            _drop_cache([crash / "smart_ckpt"])  # cold: the disk store's pages (the slots are memory: never dropped)
            spec = {**_spec(args, mode, layers, base, variant, work / variant, crash), "restart_step": c["slot_step"]}
            runs[variant] = runner.run(spec, f"{mode} {variant} #{rep}")
        restart["bytes"].append(tier_bytes_ours(crash / "smart_ckpt", c["slot_step"]))
    finally:  # a failed restart would leave GBs in /dev/shm
        remove_slots(crash / "smart_ckpt", SmartCkptConfig().task_id)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for variant, r in runs.items():
        restart[variant].append(r)
    m, d = (runs[v]["first_step_end"] - runs[v]["resume_start"] for v in ("restart_memory", "restart_disk"))
    print(f"[{mode} #{rep}] restart of step {c['slot_step']} ({_fmt_bytes(sum(restart['bytes'][-1].values()))}): "
          f"from memory {m:.2f} s, from disk (cold) {d:.2f} s to the first step's end = {m / d:.3f}x; losses "
          f"bit-equal: {'yes' if runs['restart_memory']['losses'] == runs['restart_disk']['losses'] else 'NO'}",
          flush=True)


def tier_bytes_native(path: Path) -> dict[str, int]:
    """Bytes of a Trainer checkpoint folder by tier (weights files, optimizer + scheduler, the rest)."""
    out = dict.fromkeys(TIERS, 0)
    for f in (p for p in path.rglob("*") if p.is_file()):
        if f.suffix == ".safetensors" or f.name in ("pytorch_model.bin", "adapter_model.bin"):
            tier = "weights"
        else:
            tier = "optimizer" if f.name in ("optimizer.pt", "scheduler.pt", "scaler.pt") else "state"
        out[tier] += f.stat().st_size
    return out


def tier_bytes_ours(store: Path, step: int) -> dict[str, int]:
    """Bytes of the store's checkpoint of `step` by tier, from its manifest's file table (plus the manifest)."""
    matches = [p for p in store.glob(f"*/step-{step}") if p.is_dir()]
    if not matches:
        return dict.fromkeys(TIERS, 0)
    manifest_path = matches[0] / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    out = dict.fromkeys(TIERS, 0)
    for entry in manifest.get("files", {}).values():
        out[entry.get("tier", "state")] += int(entry.get("size", 0))
    out["state"] += manifest_path.stat().st_size
    return out


# ----------------------------------------------------------------------------- numbers from results
def _median_cycle(res: dict[str, Any]) -> float:
    """Median time from one step's end to the next's (the step and what runs between steps: a held save)."""
    ends = {int(k): v for k, v in res["step_end_wall"].items()}
    return statistics.median(ends[s] - ends[s - 1] for s in ends if s > 2 and s - 1 in ends)


def _median_step(res: dict[str, Any], skip: Sequence[int] = ()) -> float:
    times = [t for s, t, _ in res["steps"] if s > 2 and s not in skip] or [t for _, t, _ in res["steps"]]
    return statistics.median(times)


def _save_steps(res: dict[str, Any]) -> list[int]:
    """The steps a run saved at: ours from its save events (the save at training end, after Trainer's
    `train_runtime`, left out), Trainer's from its `on_save` calls (its last step's save included)."""
    if "events" in res:
        return [e["step"] for e in res["events"] if not e["end"]]
    return list(res.get("trainer_saves", []))


def within_run_ms(res: dict[str, Any]) -> float | None:
    """Overhead per save inside one run (ms): save steps (with the gap after them, where the save is
    taken) and steps during a write, beyond the run's median clean step."""
    gaps = {int(s): g for s, g in res["gaps"].items()}
    total = {s: t + gaps[s] for s, t, _ in res["steps"] if s in gaps}
    busy = {s for s, _, b in res["steps"] if b}
    saves = {s for s in _save_steps(res) if s in total}
    clean = [t for s, t in total.items() if s > 2 and s not in saves and s not in busy]
    if not saves or not clean:
        return None
    median = statistics.median(clean)
    return 1e3 * sum(t - median for s, t in total.items() if s in saves or (s in busy and s > 2)) / len(saves)


def inflation(res: dict[str, Any]) -> tuple[float | None, int]:
    """(median step while a write ran / median other step - 1, steps while a write ran); save steps excluded."""
    saves = set(_save_steps(res))
    kept = [(t, b) for s, t, b in res["steps"] if s > 2 and s not in saves]
    busy, clean = [t for t, b in kept if b], [t for t, b in kept if not b]
    if not busy or not clean:
        return None, len(busy)
    return statistics.median(busy) / statistics.median(clean) - 1.0, len(busy)


def spread(values: Sequence[float], fmt: str = "{:.3g}") -> str:
    """`median [min-max]` (just the value for one)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def _med(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def summarize(mode: str, data: dict[str, Any]) -> dict[str, Any]:
    """The figures of one mode the tables and the goals read."""
    trio, resume = data["trio"], data["resume"]
    s: dict[str, Any] = {"mode": mode, "layers": data["layers"]}
    if trio["smart"]:
        none_s = [r["train_s"] for r in trio["none"]]
        per_save: dict[str, list[float]] = {"native": [], "smart": []}
        for variant in per_save:
            for rep, r in enumerate(trio[variant]):
                n = len(_save_steps(r))
                if n and rep < len(none_s):  # against the `none` run of the same repeat (interleaved)
                    per_save[variant].append((r["train_s"] - none_s[rep]) / n)
        smart = trio["smart"]
        steps = [_median_step(r, _save_steps(r)) for r in smart]
        blocking = [e["blocking_ms"] for r in smart for e in r["events"] if not e["end"]]
        shares = [e["blocking_ms"] / 1e3 / _median_step(r, _save_steps(r)) for r in smart for e in r["events"]
                  if not e["end"]]
        within = {v: [within_run_ms(r) for r in trio[v]] for v in ("native", "smart")}
        infl = [inflation(r) for r in smart]
        s.update({
            "train_s": {v: [r["train_s"] for r in rs] for v, rs in trio.items()},
            "saves": {v: len(_save_steps(rs[0])) for v, rs in trio.items() if rs},
            "median_step_s": steps, "blocking_ms": blocking, "blocking_share": shares,
            "per_save_s": per_save, "within_ms": within,
            "per_save_ratio": _ratio(_med(per_save["smart"]), _med(per_save["native"])),
            "within_ratio": _ratio(_med(within["smart"]), _med(within["native"])),
            "inflation": [i for i, _ in infl], "busy_steps": sum(n for _, n in infl),
            # How each save was staged and who wrote it: "buffered/process" is the design's path.
            "staging": sorted({f"{e['staging'] or '-'}/{e.get('writer') or '-'}" for r in smart for e in r["events"]
                               if not e["end"]}),
            "write_ms": [e["write_ms"] for r in smart for e in r["events"] if not e["end"] and e["write_ms"]],
            "buffer_bytes": max(r["buffer_bytes"] for r in smart),
            "memory": {v: [r["memory"] for r in rs] for v, rs in trio.items()},
            "writer_interpreter": [_writer_interpreter(r) for r in smart],
            "params": smart[0]["params"], "trainable": smart[0]["trainable"], "optim": smart[0]["optim"],
        })
        s["writer_private_peak"] = [m["writer"].get("private") for m in s["memory"]["smart"]]
    if trio.get("smart_thread"):  # the writer comparison: process (`smart`) against thread, interleaved
        none_s = [r["train_s"] for r in trio["none"]]
        s["writers"] = {w: {"inflation": [inflation(r)[0] for r in trio[v]],
                            "per_save_s": [(r["train_s"] - none_s[i]) / max(1, len(_save_steps(r)))
                                           for i, r in enumerate(trio[v]) if i < len(none_s)],
                            "blocking_ms": [e["blocking_ms"] for r in trio[v] for e in r["events"] if not e["end"]],
                            "median_step_s": [_median_step(r, _save_steps(r)) for r in trio[v]]}
                        for w, v in (("process", "smart"), ("thread", "smart_thread"))}
    if resume["ours_resume"]:
        prep = resume["prep"]
        expected = prep["losses"][-RESUMED_STEPS:]
        t = {v: [r["first_step_end"] - r["resume_start"] for r in resume[v]]
             for v in ("fresh", "native_resume", "ours_resume")}
        begin = {v: [r["first_step"] - r["resume_start"] for r in resume[v]] for v in ("native_resume", "ours_resume")}
        fresh = _med(t["fresh"])
        over = {v: [x - fresh for x in t[v]] if fresh is not None else [] for v in ("native_resume", "ours_resume")}
        # The work of a resume: to the end of the first resumed step less the run's next step (a steady step
        # of the same process), so what ours defers into the first step is counted and the step itself is not.
        second = {v: [r["steps"][1][1] for r in resume[v]] for v in ("native_resume", "ours_resume")}
        work = {v: [x - y for x, y in zip(t[v], second[v])] for v in ("native_resume", "ours_resume")}
        s["resume"] = {
            "to_step_end_s": t, "to_step_begin_s": begin, "over_fresh_s": over, "second_step_s": second,
            "work_s": work, "ratio_work": _ratio(_med(work["ours_resume"]), _med(work["native_resume"])),
            "ratio_over_fresh": _ratio(_med(over["ours_resume"]), _med(over["native_resume"])),
            "ratio_literal": _ratio(_med(t["ours_resume"]), _med(t["native_resume"])),
            "exact": {v: [r["losses"] == expected for r in resume[v]] for v in ("native_resume", "ours_resume")},
            "phases": {v: {label: [r.get("phases", {}).get(label, 0.0) for r in resume[v]]
                           for label in dict.fromkeys(k for r in resume[v] for k in r.get("phases", {}))}
                       for v in ("native_resume", "ours_resume")},
            "bytes": resume["bytes"],
            "prep_blocking_ms": [e["blocking_ms"] for e in prep.get("events", []) if not e["end"]],
            "prep_median_step_s": _median_step(prep, _save_steps(prep)),
            "prep_staging": sorted({f"{e['staging'] or '-'}/{e.get('writer') or '-'}" for e in prep.get("events", [])
                                    if not e["end"]}),
        }
        s.setdefault("params", prep["params"])
        s.setdefault("trainable", prep["trainable"])
    restart = data.get("restart") or {}
    if restart.get("restart_disk"):
        variants = ("restart_memory", "restart_disk")
        t = {v: [r["first_step_end"] - r["resume_start"] for r in restart[v]] for v in variants}
        second = {v: [r["steps"][1][1] for r in restart[v]] for v in variants}  # as the resume part's work
        work = {v: [x - y for x, y in zip(t[v], second[v])] for v in variants}
        s["restart"] = {
            "to_step_end_s": t, "second_step_s": second, "work_s": work,
            "ratios": [m / d for m, d in zip(*t.values())],
            "ratio_literal": _ratio(_med(t["restart_memory"]), _med(t["restart_disk"])),
            "ratio_work": _ratio(_med(work["restart_memory"]), _med(work["restart_disk"])),
            "exact": [m["losses"] == d["losses"] for m, d in zip(*(restart[v] for v in variants))],
            "step": [c["slot_step"] for c in restart["crash"]], "bytes": restart["bytes"],
            "phases": {v: {label: [r.get("phases", {}).get(label, 0.0) for r in restart[v]]
                           for label in dict.fromkeys(k for r in restart[v] for k in r.get("phases", {}))}
                       for v in variants},
        }
        s.setdefault("params", restart["crash"][0]["params"])
        s.setdefault("trainable", restart["crash"][0]["trainable"])
    return s


def _writer_interpreter(res: dict[str, Any]) -> int | None:
    """The writer process's private bytes just before the first save it wrote; `None` when it was
    still starting then (its last two samples before differ by more than 1 MiB: still importing).
    Saves taken while it starts are written by a thread of the training process instead."""
    saves = [e for e in res.get("events", []) if not e["end"]]
    events = [e for e in saves if e.get("writer") == "process"] or [e for e in saves if e.get("writer") is None]
    if not events:
        return None
    before = res["step_end_wall"].get(str(events[0]["step"]))
    series = [p for t, p in res["writer_series"] if before is None or t <= before]
    if len(series) < 2 or abs(series[-1] - series[-2]) > MIB:
        return None
    return max(series)


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b; `None` unless b > 0 (a baseline within noise of zero or below it gives no ratio)."""
    return a / b if a is not None and b is not None and b > 0 else None


# ----------------------------------------------------------------------------- printing
def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"


def print_report(args: argparse.Namespace, summaries: list[dict[str, Any]],
                 started: float | None) -> list[tuple[str, bool | None, str]]:
    import torch

    print()
    here = ("" if started is None else  # --report: the machine that ran it is not necessarily this one
            f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
            f"total {time.time() - started:.0f} s, ")
    print(f"{args.model} widths ({json.dumps(MODELS[args.model]['config'])}), device {args.device}, {here}"
          f"1 training thread, batch {args.batch} x {args.seq} tokens, {args.steps} steps, save every {args.k}, "
          f"{args.repeats} repeat(s) interleaved (median [min-max])")
    writers = [s for s in summaries if "writers" in s]
    if writers:
        print("\nwriter thread vs process (the same runs, interleaved) | mode | step inflation during writes: "
              "process / thread | training time per save (s): process / thread | blocking per save (ms): "
              "process / thread")
        for s in writers:
            w = s["writers"]
            print(f"| {s['mode']} | {spread(w['process']['inflation'], '{:+.1%}')} / "
                  f"{spread(w['thread']['inflation'], '{:+.1%}')} | {spread(w['process']['per_save_s'])} / "
                  f"{spread(w['thread']['per_save_s'])} | {spread(w['process']['blocking_ms'])} / "
                  f"{spread(w['thread']['blocking_ms'])} |")
    trio = [s for s in summaries if "train_s" in s]
    if trio:
        print("\n| mode | layers | params (trainable) | median step s | train s: none / native / smart | saves "
              "native / smart | smart blocking ms per save | blocking / median step | overhead per save s: native / "
              "smart (ratio) | within-run ms: native / smart (ratio) | inflation during writes (steps) | staging | "
              "write s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for s in trio:
            ts = s["train_s"]
            print(f"| {s['mode']} | {s['layers']} | {s['params'] / 1e9:.2f}B ({s['trainable'] / 1e6:.1f}M) | "
                  f"{spread(s['median_step_s'])} | {_med(ts['none']):.1f} / {_med(ts['native']):.1f} / "
                  f"{_med(ts['smart']):.1f} | {s['saves'].get('native', 0)} / {s['saves'].get('smart', 0)} | "
                  f"{spread(s['blocking_ms'])} | {spread(s['blocking_share'], '{:.2%}')} | "
                  f"{spread(s['per_save_s']['native'])} / {spread(s['per_save_s']['smart'])} "
                  f"({_num(s['per_save_ratio'])}) | {spread(s['within_ms']['native'])} / "
                  f"{spread(s['within_ms']['smart'])} ({_num(s['within_ratio'])}) | "
                  f"{spread(s['inflation'], '{:+.1%}')} ({s['busy_steps']}) | {','.join(s['staging'])} | "
                  f"{spread([w / 1e3 for w in s['write_ms']])} |")
        print("\n| mode | run | train peak RSS (VmHWM) | private | shared | writer peak RSS (VmHWM) | private | "
              "shared | writer interpreter (private) | staging buffers |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for s in trio:
            for variant, mems in s["memory"].items():
                def peak(who: str, key: str, mems: list[dict[str, Any]] = mems) -> str:
                    values = [m[who].get(key) for m in mems if m[who]]
                    return _fmt_bytes(max(values)) if values else "-"
                smart = variant == "smart"
                interp = _med(s["writer_interpreter"]) if smart else None
                print(f"| {s['mode']} | {variant} | {peak('train', 'VmHWM')} | {peak('train', 'private')} | "
                      f"{peak('train', 'shared')} | {peak('writer', 'VmHWM')} | {peak('writer', 'private')} | "
                      f"{peak('writer', 'shared')} | {_fmt_bytes(interp) if smart else '-'} | "
                      f"{_fmt_bytes(s['buffer_bytes']) if smart else '-'} |")
    res = [s for s in summaries if "resume" in s]
    if res:
        print("\n| mode | tier | Trainer checkpoint | ours | ours / Trainer |")
        print("|---|---|---|---|---|")
        for s in res:
            b = s["resume"]["bytes"]
            for tier in (*TIERS, "total"):
                n = sum(b["native"].values()) if tier == "total" else b["native"][tier]
                o = sum(b["ours"].values()) if tier == "total" else b["ours"][tier]
                print(f"| {s['mode']} | {tier} | {_fmt_bytes(n)} | {_fmt_bytes(o)} | {_num(_ratio(o, n))} |")
        print("\n| mode | fresh: to step end s | native: to step begin / end s | ours: to step begin / end s | "
              "ratio (to step end) | next step s: native / ours | resume work s: native / ours | ratio (work) | "
              "over fresh s: native / ours (ratio) | losses bit-equal: native / ours |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for s in res:
            r = s["resume"]
            t, b, o, ex = r["to_step_end_s"], r["to_step_begin_s"], r["over_fresh_s"], r["exact"]
            w, nx = r["work_s"], r["second_step_s"]
            print(f"| {s['mode']} | {spread(t['fresh'])} | {spread(b['native_resume'])} / {spread(t['native_resume'])}"
                  f" | {spread(b['ours_resume'])} / {spread(t['ours_resume'])} | {_num(r['ratio_literal'])} | "
                  f"{spread(nx['native_resume'])} / {spread(nx['ours_resume'])} | {spread(w['native_resume'])} / "
                  f"{spread(w['ours_resume'])} | {_num(r['ratio_work'])} | {spread(o['native_resume'])} / "
                  f"{spread(o['ours_resume'])} ({_num(r['ratio_over_fresh'])}) | "
                  f"{sum(ex['native_resume'])}/{len(ex['native_resume'])} / {sum(ex['ours_resume'])}/"
                  f"{len(ex['ours_resume'])} |")
        if any(s["resume"].get("phases", {}).get(v) for s in res for v in ("native_resume", "ours_resume")):
            print("\n| mode | resume | where its time goes: s per phase, median [min-max] (the L1 read overlaps the "
                  "first step) |")
            print("|---|---|---|")
            for s in res:
                for v, phases in s["resume"].get("phases", {}).items():
                    if phases:
                        print(f"| {s['mode']} | {v.split('_')[0]} | "
                              + "; ".join(f"{label} {spread(values)}" for label, values in phases.items()) + " |")
    rst = [s for s in summaries if "restart" in s]
    if rst:
        print("\nrestart after a crash (SIGKILL of the process group: no watcher), the same checkpoint each repeat: "
              "the killed run's memory slot with resume_checkpoint(trainer, 'auto'), then from the disk store with "
              "its pages dropped (cold)")
        print("| mode | layers | params (trainable) | checkpoint | from memory: to first step end s | from disk "
              "(cold) s | ratio (per repeat) | less the next step s: memory / disk (ratio) | losses bit-equal |")
        print("|---|---|---|---|---|---|---|---|---|")
        for s in rst:
            r = s["restart"]
            t, w = r["to_step_end_s"], r["work_s"]
            size = _med([sum(b.values()) for b in r["bytes"]])
            print(f"| {s['mode']} | {s['layers']} | {s['params'] / 1e9:.2f}B ({s['trainable'] / 1e6:.1f}M) | "
                  f"{_fmt_bytes(size)} (step {r['step'][0]}) | {spread(t['restart_memory'])} | "
                  f"{spread(t['restart_disk'])} | {_num(r['ratio_literal'])} "
                  f"({', '.join(f'{x:.3f}' for x in r['ratios'])}) | {spread(w['restart_memory'])} / "
                  f"{spread(w['restart_disk'])} ({_num(r['ratio_work'])}) | "
                  f"{sum(r['exact'])}/{len(r['exact'])} |")
        print("\n| mode | restart | where its time goes: s per phase, median [min-max] (the L1 read and the slot's "
              "copy to disk run in background threads) |")
        print("|---|---|---|")
        for s in rst:
            for v, phases in s["restart"]["phases"].items():
                print(f"| {s['mode']} | {v.split('_')[1]} | "
                      + "; ".join(f"{label} {spread(values)}" for label, values in phases.items()) + " |")
    goals = evaluate_goals(summaries)
    print("\nGoals (each a ratio measured in this run):")
    for name, met, detail in goals:
        verdict = "met" if met else "not met" if met is not None else "not measured"
        print(f"  [{verdict:>12}] {name}: {detail}")
    return goals


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def evaluate_goals(summaries: list[dict[str, Any]]) -> list[tuple[str, bool | None, str]]:
    """(goal, met or None when not measured, the numbers) per goal and mode."""
    goals: list[tuple[str, bool | None, str]] = []
    for s in summaries:
        mode = s["mode"]
        if "train_s" in s:
            worst = max(s["blocking_share"]) if s["blocking_share"] else None
            med = _med(s["blocking_share"])
            goals.append((f"{mode}: blocking per save < 1 % of a step (median save)",
                          None if med is None else med < 0.01,
                          f"median {_pct(med)}, worst {_pct(worst)} ({spread(s['blocking_ms'])} ms per save, "
                          f"staging {','.join(s['staging'])})"))
            for key, what in (("per_save_ratio", "train time"), ("within_ratio", "within-run excess")):
                ratio = s[key]
                goals.append((f"{mode}: overhead per save <= 0.2x Trainer's ({what})",
                              None if ratio is None else ratio <= 0.2, f"{_num(ratio)}x"))
            interp, peak, staging = _med(s["writer_interpreter"]), _med(s["writer_private_peak"]), s["buffer_bytes"]
            ok = None if interp is None or peak is None else peak <= staging + interp
            detail = (f"peak {_fmt_bytes(peak)} vs {_fmt_bytes(staging)} + {_fmt_bytes(interp)}" if interp is not None
                      else "the writer process was still starting at the first save (no interpreter baseline)")
            goals.append((f"{mode}: writer private memory <= staging buffers + interpreter", ok, detail))
        if "resume" in s:
            r = s["resume"]
            exact = all(r["exact"]["ours_resume"]) and all(r["exact"]["native_resume"])
            ratio = r["ratio_work"]
            goals.append((f"{mode}: resume to the first step <= 0.5x Trainer's (to its end, less a steady step)",
                          None if ratio is None else ratio <= 0.5 and exact,
                          f"{_num(ratio)}x; with the step: {_num(r['ratio_literal'])}x; over a fresh start: "
                          f"{_num(r['ratio_over_fresh'])}x; losses bit-equal: {'yes' if exact else 'NO'}"))
        if "restart" in s:
            r = s["restart"]
            exact, t = all(r["exact"]), r["to_step_end_s"]
            goals.append((f"{mode}: restart from memory <= 0.5x disk resume (cold, same checkpoint; to the first "
                          "step's end)", None if r["ratio_literal"] is None else r["ratio_literal"] <= 0.5 and exact,
                          f"{_num(r['ratio_literal'])}x (medians {_med(t['restart_memory']):.2f} s / "
                          f"{_med(t['restart_disk']):.2f} s); less the next step: {_num(r['ratio_work'])}x; losses "
                          f"bit-equal: {'yes' if exact else 'NO'}"))
    return goals


# ----------------------------------------------------------------------------- main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2-7b", choices=sorted(MODELS))
    p.add_argument("--mode", default="both", choices=["lora", "full", "both"])
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size instead of the config's (a smaller state: see --parts restart)")
    p.add_argument("--layers", default="auto", help="decoder layers, or 'auto': as many as memory holds, up to "
                                                     "--max-layers")
    p.add_argument("--max-layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--k", type=int, default=4, help="save every k steps (both Trainer's and ours)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prep-steps", type=int, default=3, help="the resume's restore point")
    p.add_argument("--prep-interval", type=int, default=None,
                   help="ours saves every this many steps in the preparation run (default: --prep-steps)")
    p.add_argument("--parts", default="trio,resume", help="comma list of trio, resume, tier, restart")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--memory-margin", type=float, default=None, help="runtime.memory_margin (default: its)")
    p.add_argument("--overlap-snapshot", default="auto", choices=["auto", "true", "false"],
                   help="runtime.overlap_snapshot of our runs (auto: the default, CUDA parameters of >= 32 MiB only)")
    p.add_argument("--mem-interval", type=float, default=0.2, help="seconds between memory samples")
    p.add_argument("--compare-writers", action="store_true",
                   help="also run ours with the thread writer (variant smart_thread) beside the process writer")
    p.add_argument("--cold", action="store_true", help="drop the checkpoints' cached pages before each resume")
    p.add_argument("--no-fresh", action="store_true", help="leave out the fresh start (the 'over fresh' column)")
    p.add_argument("--out", default="bench_out/real_width", help="work directory (base weights are kept here)")
    p.add_argument("--keep", action="store_true", help="keep the preparation runs' checkpoints")
    p.add_argument("--json", default=None, help="also write every figure here (recipes/estimate_sizes.py --measured)")
    p.add_argument("--smoke", action="store_true",
                   help="toy widths, LoRA only unless --mode is given, 1 repeat, no fresh start: six runs")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="print the tables and goals of an earlier run's --json again, and run nothing")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    if "--smoke" in sys.argv[1:]:  # defaults only: flags given next to --smoke still apply
        p.set_defaults(model="smoke", mode="lora", steps=8, k=3, repeats=1, prep_steps=2, no_fresh=True)
    args = p.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    if args.report:
        return report(Path(args.report))
    args.parts = [x for x in args.parts.split(",") if x]
    set_vocab(args.model, args.vocab)
    work = Path(args.out).absolute()
    work.mkdir(parents=True, exist_ok=True)
    runner = Runner(args, work)
    started = time.time()
    summaries = []
    raw: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for mode in (["lora", "full"] if args.mode == "both" else [args.mode]):
        if args.layers == "auto":
            layers, why = fit_layers(args.model, mode, args.device, args.max_layers)
            print(f"[{mode}] --layers auto: {why}", flush=True)
        else:
            layers = int(args.layers)
        try:
            raw[mode] = run_mode(runner, args, mode, layers)
        except RunFailed as e:  # an OOM kill of the full fine-tune must not lose the LoRA results
            failed[mode] = str(e)
            print(f"[{mode}] FAILED, going on without it: {e}", flush=True)
            continue
        summaries.append(summarize(mode, raw[mode]))
        write_json(args, summaries, evaluate_goals(summaries), raw, failed)  # kept as each mode ends
    goals = print_report(args, summaries, started)
    write_json(args, summaries, goals, raw, failed)
    if args.json:
        print(f"\nwrote {args.json}")
    for mode, error in failed.items():
        print(f"\n[{mode}] FAILED: {error.splitlines()[0]}")
    return 1 if failed else 0


def report(path: Path) -> int:
    """`--report JSON`: the tables and goals of a finished (or interrupted) run, from its `--json`."""
    data = json.loads(path.read_text())
    keys = ("model", "device", "batch", "seq", "steps", "k", "repeats")
    args = argparse.Namespace(**{key: data[key] for key in keys})
    set_vocab(args.model, data["config"]["vocab_size"])  # a run with --vocab shows its own
    print(f"{path}: {', '.join(s['mode'] for s in data['summaries']) or 'no mode'} finished"
          + "".join(f"; {mode} FAILED: {error.splitlines()[0]}" for mode, error in data["failed"].items()))
    print_report(args, data["summaries"], None)
    return 1 if data["failed"] else 0


def write_json(args: argparse.Namespace, summaries: list[dict[str, Any]], goals: list[tuple[str, bool | None, str]],
               raw: dict[str, Any], failed: dict[str, str]) -> None:
    """Every figure, for `recipes/estimate_sizes.py --measured` and for a later look (`--json`)."""
    if not args.json:
        return
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "model": args.model, "arch": MODELS[args.model]["arch"], "config": MODELS[args.model]["config"],
        "full_layers": MODELS[args.model]["layers"], "device": args.device,
        "batch": args.batch, "seq": args.seq, "steps": args.steps, "k": args.k, "repeats": args.repeats,
        "summaries": summaries, "goals": [{"goal": g, "met": m, "detail": d} for g, m, d in goals],
        "failed": failed, "runs": raw,
    }, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
