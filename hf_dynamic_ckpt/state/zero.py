"""DeepSpeed ZeRO (stages 1, 2 and 3) state as a save reads it and a resume writes it: every rank's fragments.

ZeRO keeps, per parameter group, one flat fp32 buffer of the master weights partitioned over the
data-parallel ranks, and the optimizer's moments as flat buffers of the same layout; under stage 3
the model's own (bf16 / fp32) parameters are partitioned the same way (`param.ds_tensor`). Of every
parameter each rank therefore holds one contiguous run of its flattened elements (a *fragment*):

- stages 1 and 2: `param._hp_mapping`, the mapping DeepSpeed itself keeps for its universal
  checkpoints and `safe_get_full_fp32_param` (where the fragment starts in the flattened parameter,
  and where it lies in the rank's flat fp32 partition);
- stage 3: `optimizer.grad_position[param_id]` (the sub-group and offset of the parameter's
  partition in the flat fp32 buffer), `param.partition_numel()` (rank R holds the flattened elements
  from `R * partition_numel`; the last rank's tail is padding).

A save stores, per trainable parameter, its fragment of the fp32 master weights and of each moment
(`state.<fqn>.master`, `state.<fqn>.exp_avg`, ...), and of the live weights under stage 3 (stages 1
and 2 hold the whole parameters on every rank: rank 0 stores them whole), as 1-D chunks of the
flattened parameter in the sharded layout of `store.shard_files` (one safetensors file per rank and
tier, the chunk table in the manifest, `"tensor_shape"` naming the parameter's shape). The optimizer
step count and the hyper-parameters are per group (JSON, rank 0).

Why the engine's tensors and not DeepSpeed's own checkpointing: `engine.save_checkpoint` pickles
Python objects (the loss scaler, the config) into `torch.save` files, blocks every rank until they
are written, and its files are tied to the world size and ZeRO stage that wrote them (another one
needs DeepSpeed's offline universal-checkpoint conversion). `safe_get_local_fp32_param` and its
family exist for stage 3 only and return copies. The fragments are views of the live buffers (the
snapshot copies them, as any save's tensors), need no collective, and a fragment of a parameter
means the same under every stage and world size: a resume reads the ranges its own fragments
cover, from whichever ranks' files hold them.

Refused at `attach` (`ConfigError`, see `check_zero`): NVMe offload of the optimizer state (the
moments are not in memory), and an optimizer whose state is not per element (a moment that is not a
flat buffer of the partition's size is named).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, IncompatibleStateError
from ..store import LoadedCheckpoint

logger = logging.getLogger(__name__)

MASTER = "master"
"""Name of the fp32 master weights among a parameter's optimizer state (`state.<fqn>.master`)."""
KEY_GROUPS = "param_groups"
KEY_ZERO = "zero"
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
APPLIED_OPTIMIZER = "_applied_optimizer"
"""`loaded.extra` key set by a ZeRO load: the optimizer tier is in the live optimizer already (not a lost tier)."""


def applied_optimizer(loaded: LoadedCheckpoint) -> bool:
    """Whether the sharded load put the optimizer tier into the live optimizer itself (ZeRO)."""
    return bool(loaded.extra.get(APPLIED_OPTIMIZER))


def zero_optimizer(optimizer: Any) -> Any | None:
    """The ZeRO optimizer inside `optimizer` (an Accelerate wrapper is unwrapped), or `None` when it is not one."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if candidate is not None and (hasattr(candidate, "single_partition_of_fp32_groups")
                                      or hasattr(candidate, "fp32_partitioned_groups_flat")):
            return candidate
    return None


def zero_stage(zero: Any) -> int:
    """3 for `DeepSpeedZeroOptimizer_Stage3`, else 2 when gradients are partitioned too, else 1."""
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        return 3
    return 2 if getattr(zero, "partition_gradients", False) else 1


def check_zero(zero: Any) -> None:
    """Refuse the ZeRO set-ups a save from here cannot read (`ConfigError`, naming the way)."""
    if getattr(zero, "swap_optimizer", False) or getattr(zero, "params_in_nvme_and_cpu", False) \
            or getattr(zero, "optimizer_swapper", None) is not None:
        raise ConfigError("hf_dynamic_ckpt does not support DeepSpeed ZeRO with NVMe offload (offload_optimizer / "
                          "offload_param device 'nvme'): the optimizer state is not in memory for a save to read. "
                          "Offload to 'cpu' (supported) or keep the state on the device.")
    if getattr(zero, "offload_optimizer", False) and getattr(zero, "partial_offload", 1.0) != 1.0:
        raise ConfigError("hf_dynamic_ckpt does not support DeepSpeed ZeRO-3 with partial optimizer offload "
                          f"(offload_optimizer.ratio={zero.partial_offload}): the state of the sub-groups kept on the "
                          "device lives in a second optimizer this library does not read. Offload all of it (ratio 1) "
                          "or none.")


class ZeroExpected(dict):  # type: ignore[type-arg]
    """What a ZeRO run's resume checks the saved weights against: `{name: meta tensor of the global shape}` of the
    trainable parameters (and the buffers of a full fine-tune); its type tells the check that the run is ZeRO's."""


def zero_expected(model: nn.Module) -> ZeroExpected:
    """`ZeroExpected` of `model` (stage 3 parameters report their global shape as `ds_shape`), known before the
    DeepSpeed engine exists (Trainer's `resume_checkpoint`)."""
    params = list(model.named_parameters())
    out = ZeroExpected((name, torch.empty(tuple(getattr(p, "ds_shape", p.shape)), device="meta"))
                       for name, p in params if p.requires_grad)
    if all(p.requires_grad for _, p in params):
        names = set(model.state_dict().keys()) - {name for name, _ in params}
        out.update((name, torch.empty(tuple(b.shape), device="meta")) for name, b in model.named_buffers()
                   if name in names)
    return out


@dataclass
class Fragment:
    """One rank's run of a parameter's flattened elements: `[start, start + numel)`, and its live views."""

    name: str
    shape: tuple[int, ...]
    start: int
    numel: int
    flat: int  # index of the flat fp32 partition (sub-group under stage 3) the fragment lies in
    at: int  # where in it
    master: torch.Tensor
    states: dict[str, torch.Tensor]
    weight: torch.Tensor | None  # stage 3: the rank's partition of the live parameter


def _flat_chunk(shape: tuple[int, ...], start: int, numel: int, dtype: torch.dtype) -> dict[str, Any]:
    total = 1
    for n in shape:
        total *= int(n)
    return {"shape": [total], "offset": [int(start)], "size": [int(numel)],
            "dtype": str(dtype).removeprefix("torch."), "tensor_shape": [int(n) for n in shape]}


class ZeroState:
    """The save-side (and resume-side) view of a model trained under DeepSpeed ZeRO on this rank.

    The same interface as `state.shards.ShardedState` (FSDP2): `weights` is the L0 source, `optimizer_source`
    the L1 source, `chunks()` this rank's chunk table, `expected()` the weights' names and global shapes.

    Args:
        model (`nn.Module`): the model DeepSpeed trains (not the engine; `engine.module`).
        optimizer: the ZeRO optimizer, or Accelerate's wrapper of it.
        rank (`int`): this rank in the data-parallel group.
    """

    def __init__(self, model: nn.Module, optimizer: Any, *, rank: int) -> None:
        zero = zero_optimizer(optimizer)
        if zero is None:
            raise ConfigError(f"{type(optimizer).__name__} is not a DeepSpeed ZeRO optimizer.")
        check_zero(zero)
        self.model, self.zero, self.rank = model, zero, rank
        self.stage = zero_stage(zero)
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._buffers = self._persistent_buffers() if all(p.requires_grad for p in model.parameters()) else {}
        # The base optimizer's groups as they are between steps: inside its step stages 1 and 2 swap the list for
        # the one group being stepped (a capture taken there, `ZeroUpdateSeam`, reads the hyper-parameters here).
        self._base_groups: list[dict[str, Any]] = list(zero.optimizer.param_groups)
        self._scaler_state: dict[str, Any] = {}
        self.note_boundary()

    def note_boundary(self) -> None:
        """Remember the loss scaler at the end of a step: the engine updates it before the first partition's step,
        so a capture inside that step (`ZeroUpdateSeam`) stores the one of the state it captures."""
        scaler = getattr(self.zero, "loss_scaler", None)
        self._scaler_state = {k: _number(getattr(scaler, k)) for k in _SCALER_FIELDS if hasattr(scaler, k)}

    @property
    def skipped_update(self) -> bool:
        """Whether the engine's last step skipped the update (an fp16 overflow: no partition was stepped)."""
        return bool(getattr(self.zero, "overflow", False))

    def _group(self, fi: int) -> dict[str, Any]:
        """The base optimizer's hyper-parameter group of flat partition `fi` (stage 3: of its sub-group's group)."""
        index = self.zero.sub_group_to_group_id.get(fi, fi) if self.stage == 3 else fi
        return self._base_groups[index] if index < len(self._base_groups) else {}

    def _persistent_buffers(self) -> dict[str, torch.Tensor]:
        # Full fine-tuning: the persistent buffers are state too (not partitioned under any stage).
        params = {name for name, _ in self.model.named_parameters()}
        keys = set(self.model.state_dict().keys()) - params
        return {name: b for name, b in self.model.named_buffers() if name in keys}

    # -- the fragments ------------------------------------------------------------------------
    def flat_groups(self) -> list[torch.Tensor]:
        """The flat fp32 partitions of this rank (one per parameter group; per sub-group under stage 3)."""
        z = self.zero
        return list(z.fp32_partitioned_groups_flat if self.stage == 3 else z.single_partition_of_fp32_groups)

    def trained_partitions(self) -> int:
        """How many flat partitions hold trainable parameters (the same on every rank)."""
        return sum(1 for params in self._param_groups() if any(p.requires_grad for p in params))

    def _param_groups(self) -> list[list[nn.Parameter]]:
        z = self.zero
        return list(z.fp16_groups if self.stage == 3 else z.bit16_groups)

    def _name(self, p: nn.Parameter) -> str:
        name = self._names.get(id(p))
        if name is None:
            raise ConfigError("a parameter DeepSpeed optimizes is not a parameter of the model given to "
                              "hf_dynamic_ckpt: pass the model the engine trains (engine.module).")
        return name

    def _states(self, flat: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        state = self.zero.optimizer.state.get(flat) or {}
        out: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue  # the step count: per group (`param_groups`)
            if value.shape != flat.shape:
                raise ConfigError(f"optimizer state {name}.{key} has shape {tuple(value.shape)}, not the shape of "
                                  f"the flat fp32 partition {tuple(flat.shape)}: hf_dynamic_ckpt saves optimizers "
                                  "with per-element state under ZeRO (Adam, AdamW, SGD with momentum, ...).")
            out[key] = value
        return out

    def fragments(self) -> Iterator[Fragment]:
        """This rank's fragments of every trainable parameter (views of the live buffers), in group order."""
        flats = self.flat_groups()
        for gi, params in enumerate(self._param_groups()):
            for p in params:
                fi = gi
                if not p.requires_grad:
                    continue
                name = self._name(p)
                ds: Any = p  # stage 3's partitioned parameter (ds_* attributes)
                if self.stage == 3:
                    group, offset, _ = self.zero.grad_position[self.zero.get_param_id(p)]
                    per = int(ds.partition_numel())
                    start = self.rank * per
                    numel = max(0, min(per, int(ds.ds_numel) - start))
                    if numel == 0:
                        continue
                    shape = tuple(int(n) for n in ds.ds_shape)
                    at, weight, fi = int(offset), ds.ds_tensor.narrow(0, 0, numel), int(group)
                else:
                    mapping = getattr(p, "_hp_mapping", None)
                    if mapping is None:
                        continue  # no element of this parameter in this rank's partition
                    start, numel = int(mapping.lp_fragment_address.start), int(mapping.lp_fragment_address.numel)
                    at, weight, shape = int(mapping.hp_fragment_address.start), None, tuple(p.shape)
                flat = flats[fi]
                states = {k: v.narrow(0, at, numel) for k, v in self._states(flat, name).items()}
                yield Fragment(name, shape, start, numel, fi, at, flat.narrow(0, at, numel), states, weight)

    # -- L0 -----------------------------------------------------------------------------------
    def _whole_weights(self) -> dict[str, torch.Tensor]:
        """Stages 1 and 2 (rank 0): the whole trainable parameters, flattened; and the buffers (any stage)."""
        out: dict[str, torch.Tensor] = {}
        if self.stage != 3:
            out.update((name, p.detach().reshape(-1)) for name, p in self.model.named_parameters() if p.requires_grad)
        out.update((name, b.detach().reshape(-1)) for name, b in self._buffers.items())
        return out

    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's L0: under stage 3 its partition of every trainable parameter; rank 0 adds what every rank
        holds whole (the parameters under stages 1 and 2, the buffers), flattened."""
        out = self._whole_weights() if self.rank == 0 else {}
        if self.stage == 3:
            out.update((f.name, f.weight) for f in self.fragments() if f.weight is not None)
        return out

    # -- L1 -----------------------------------------------------------------------------------
    def optimizer_state_dict(self) -> dict[str, Any]:
        """`{"state": {fqn: {"master" | moment: fragment}}, "param_groups": [...], "zero": {...}}`."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        for f in self.fragments():
            state[f.name] = {MASTER: f.master, **f.states}
        groups = []
        base = self.zero.optimizer
        flats = self.flat_groups()
        for gi, params in enumerate(self._param_groups()):
            hyper = {k: v for k, v in self._group(gi).items() if k != "params"}
            step = (base.state.get(flats[gi]) or {}).get("step")
            groups.append({**hyper, "params": [self._name(p) for p in params if p.requires_grad],
                           "step": float(step) if step is not None else None})
        zero = {"stage": self.stage, "loss_scaler": dict(self._scaler_state)}
        return {"state": state, KEY_GROUPS: groups, KEY_ZERO: zero}

    @property
    def optimizer_source(self) -> _OptimizerView:
        """What `StateSources.optimizer` gets: an object whose `state_dict()` is `optimizer_state_dict()`."""
        return _OptimizerView(self)

    # -- chunks and the model check -------------------------------------------------------------
    def chunks(self) -> dict[str, dict[str, dict[str, Any]]]:
        """This rank's chunk table: `{"weights": {key: chunk}, "optimizer": {key: chunk}}` (JSON)."""
        weights: dict[str, dict[str, Any]] = {}
        optimizer: dict[str, dict[str, Any]] = {}
        shapes = self._shapes()
        if self.rank == 0:
            for name, t in self._whole_weights().items():
                weights[name] = _flat_chunk(shapes.get(name, tuple(t.shape)), 0, t.numel(), t.dtype)
        for f in self.fragments():
            if f.weight is not None:
                weights[f.name] = _flat_chunk(f.shape, f.start, f.numel, f.weight.dtype)
            for key, t in {MASTER: f.master, **f.states}.items():
                optimizer[f"state.{f.name}.{key}"] = _flat_chunk(f.shape, f.start, f.numel, t.dtype)
        return {"weights": weights, "optimizer": optimizer}

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        out = {name: tuple(int(n) for n in getattr(p, "ds_shape", p.shape)) for name, p in
               self.model.named_parameters()}
        out.update((name, tuple(b.shape)) for name, b in self._buffers.items())
        return out

    def expected(self) -> ZeroExpected:
        """The L0 names with their global shapes (`meta` tensors), for the model check of a resume."""
        return zero_expected(self.model)

    # -- resume -----------------------------------------------------------------------------------
    def _create_state(self, moments: set[str]) -> dict[int, list[torch.Tensor]]:
        """Create the optimizer state a fresh run has not yet (torch optimizers make it at their first step): the
        saved moments in each flat partition's layout, uninitialised (the load writes them; `zero_uncovered`
        zeroes what no fragment covers), and the step count. Returns the moments created, per flat partition."""
        base = self.zero.optimizer
        created: dict[int, list[torch.Tensor]] = {}
        if not moments:  # saved before the optimizer's first step: its state is the fresh one (none)
            for flat in self.flat_groups():
                base.state.pop(flat, None)
            return created
        for gi, flat in enumerate(self.flat_groups()):
            state = base.state[flat]
            for key in moments - set(state):
                state[key] = torch.empty_like(flat, memory_format=torch.preserve_format)
                created.setdefault(gi, []).append(state[key])
            if "step" not in state:
                group = self._group(gi)
                on_device = bool(group.get("fused") or group.get("capturable"))  # torch Adam's placement of it
                state["step"] = torch.zeros((), dtype=torch.float32, device=flat.device if on_device else "cpu")
        return created

    def load(self, read_into: Callable[[str, str, int, int, torch.Tensor], None], optimizer: dict[str, Any] | None,
             *, step: int, moments: set[str] | None = None) -> None:
        """Write a checkpoint's state into the live buffers.

        Args:
            read_into: `read_into(part, key, start, stop, out)` writes the elements `[start, stop)` of the flattened
                tensor `key` of `part` (`"weights"` / `"optimizer"`) into `out`, from whichever ranks' chunks hold
                them (`store.shard_files.FlatReader.read_into`).
            optimizer: the rank-0 part of L1 (`param_groups`, `zero`), or `None` when L1 was lost (then only the
                weights are restored: the master weights from them, the moments stay as they are).
            moments: the names of the per-element optimizer state the checkpoint holds (`exp_avg`, ...): created
                where the live optimizer has not made them yet.

        Raises:
            `IncompatibleStateError`: the checkpoint lacks a parameter, a moment, or a range this rank needs.
        """
        created = self._create_state(set(moments or ())) if optimizer is not None else {}
        params = {name: p for name, p in self.model.named_parameters()}
        covered: dict[int, list[tuple[int, int]]] = {}
        if self.stage == 3:  # as DeepSpeed's own load: no parameter gathered while its partition is written
            self.zero.checkpoint_event_prologue()
        try:
            with torch.no_grad():
                for name, live in self._whole_weights().items():  # stages 1 and 2: the parameters; the buffers
                    read_into("weights", name, 0, live.numel(), live)
                for f in self.fragments():
                    stop = f.start + f.numel
                    if f.weight is not None:
                        read_into("weights", f.name, f.start, stop, f.weight)
                    if optimizer is None:
                        source = f.weight if f.weight is not None else \
                            params[f.name].detach().reshape(-1).narrow(0, f.start, f.numel)
                        f.master.copy_(source)
                        continue
                    read_into("optimizer", f"state.{f.name}.{MASTER}", f.start, stop, f.master)
                    for key, live in f.states.items():
                        read_into("optimizer", f"state.{f.name}.{key}", f.start, stop, live)
                    covered.setdefault(f.flat, []).append((f.at, f.at + f.numel))
        except BaseException:
            for tensors in created.values():  # never leave uninitialised moments behind a failed load
                for t in tensors:
                    t.zero_()
            raise
        zero_uncovered(created, covered)
        if self.stage == 3:  # the persistent (small, never released) parameters gathered again from the partitions
            self.zero.checkpoint_event_epilogue()
        if optimizer is not None:
            self._load_groups(optimizer, step=step)

    def _load_groups(self, optimizer: dict[str, Any], *, step: int) -> None:
        saved = optimizer.get(KEY_GROUPS)
        if not isinstance(saved, list):
            raise IncompatibleStateError(f"step {step}: the optimizer tier has no ZeRO param_groups; it was not saved "
                                         "under DeepSpeed.")
        by_name = {name: g for g in saved if isinstance(g, dict) for name in g.get("params") or []}
        base, flats = self.zero.optimizer, self.flat_groups()
        for gi, params in enumerate(self._param_groups()):
            names = [self._name(p) for p in params if p.requires_grad]
            group = next((by_name[n] for n in names if n in by_name), None)
            if group is None:
                continue
            count = (base.state.get(flats[gi]) or {}).get("step")
            value = group.get("step")
            if isinstance(value, (int, float)) and isinstance(count, torch.Tensor):
                count.fill_(float(value))
            live = self._group(gi)
            if live:  # the hyper-parameters a schedule moves (lr, momentum, betas ...)
                for key, saved_value in group.items():
                    if key in ("params", "step") or key not in live:
                        continue
                    live[key] = tuple(saved_value) if isinstance(live[key], tuple) else saved_value
        scaler = getattr(self.zero, "loss_scaler", None)
        for key, value in ((optimizer.get(KEY_ZERO) or {}).get("loss_scaler") or {}).items():
            if key in _SCALER_FIELDS and scaler is not None and hasattr(scaler, key):
                setattr(scaler, key, value)
        self.note_boundary()


def zero_uncovered(created: dict[int, list[torch.Tensor]], covered: dict[int, list[tuple[int, int]]]) -> None:
    """Zero the elements of the flat moments `created` (per flat partition) that no range of `covered` (per flat
    partition, `[lo, hi)`) holds: what a resume's load leaves unwritten (the last rank's padding)."""
    for fi, tensors in created.items():
        at, end = 0, tensors[0].numel()
        for lo, hi in [*sorted(covered.get(fi, [])), (end, end)]:
            if lo > at:
                for t in tensors:
                    t.narrow(0, at, lo - at).zero_()
            at = max(at, hi)


def _number(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


class ZeroGradSquares:
    """This rank's squared gradient norms per bucket of parameters (e.g. per LoRA layer), taken from the ZeRO
    gradient partitions when the engine hands them to the optimizer.

    Under ZeRO the gradients never sit in `param.grad` where a training loop's callbacks could read them: they
    are reduced into each rank's flat fp32 partition, and the engine steps the optimizer inside
    `accelerator.backward`. A pre-hook on the wrapped torch optimizer's `step` (called once per flat partition)
    reads the gradient fragment of every parameter in that partition and adds its squares to the parameter's
    bucket; `pop()` returns the sums since the last pop. The ranks' sums add up to the full gradients' squares
    (each element lies in one rank's partition); the caller adds them across ranks. They are the gradients the
    optimizer steps with: after the engine's clipping, which scales every gradient alike (`GradProbe` rescales
    them with the pre-clip norm).

    Args:
        zero (`ZeroState`): the run's ZeRO view.
        bucket (`Callable[[str], int]`): a parameter's bucket from its name.
        buckets (`int`): how many buckets.
    """

    def __init__(self, zero: ZeroState, bucket: Callable[[str], int], buckets: int) -> None:
        self._zero, self._bucket, self._n = zero, bucket, buckets
        self._sq: list[float] | None = None
        # (partition, bucket, offset, length) of every fragment: the partitions' layout is fixed once the engine
        # exists (a load writes into it), so the walk over the parameters runs at the first step only.
        self._layout: list[tuple[int, int, int, int]] | None = None
        self._handle = zero.zero.optimizer.register_step_pre_hook(self._hook)

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        flats = self._zero.flat_groups()
        stepping = {id(t) for g in optimizer.param_groups for t in g["params"]}
        wanted = {i for i, flat in enumerate(flats) if id(flat) in stepping and flat.grad is not None}
        if not wanted:
            return
        if self._layout is None:
            self._layout = [(f.flat, self._bucket(f.name), f.at, f.numel) for f in self._zero.fragments()]
        pieces: list[tuple[int, torch.Tensor]] = []
        for flat, bucket, at, numel in self._layout:
            if flat in wanted:
                grad = flats[flat].grad
                assert grad is not None
                pieces.append((bucket, grad.narrow(0, at, numel)))
        if not pieces:
            return
        norms = torch.stack(torch._foreach_norm([g for _, g in pieces], 2.0)).to(torch.float64).tolist()
        sq = self._sq if self._sq is not None else [0.0] * self._n
        for (b, _), v in zip(pieces, norms):
            sq[b] += v * v
        self._sq = sq

    def pop(self) -> list[float] | None:
        """The squares per bucket since the last call (`None` when no step ran)."""
        out, self._sq = self._sq, None
        return out

    def remove(self) -> None:
        self._handle.remove()


class ZeroUpdateSeam:
    """Calls `before_update()` inside the engine's optimizer step, once per step: after the gradients are reduced
    and the global norm is computed, before the first flat partition is updated (the state of the previous step
    is still whole: the moment a pre-update capture needs, which no training-loop callback sees under ZeRO).

    A pre-hook on the wrapped torch optimizer's `step` (DeepSpeed calls it once per flat partition, with that
    partition as its only parameter); it fires at the first call that steps a partition with elements and a
    gradient, after `ZeroGradSquares`' hook (registered before it) has read that partition's gradient. `arm()`
    once the step has ended makes it fire at the next one.

    Args:
        zero (`ZeroState`): the run's ZeRO view.
        before_update (`Callable[[], None]`): what runs there.
    """

    def __init__(self, zero: ZeroState, before_update: Callable[[], None]) -> None:
        self._zero, self._before_update = zero, before_update
        self._armed = True
        self._handle = zero.zero.optimizer.register_step_pre_hook(self._hook)

    @property
    def norm(self) -> float | None:
        """The engine's global gradient norm of this step (unscaled, before clipping), once its step computed it."""
        value = getattr(self._zero.zero, "_global_grad_norm", None)
        return None if value is None else float(value)

    @property
    def clip(self) -> float | None:
        """The engine's clipping threshold (`gradient_clipping`; `None` when it does not clip)."""
        value = float(getattr(self._zero.zero, "clip_grad", 0.0) or 0.0)
        return value if value > 0 else None

    def arm(self) -> None:
        self._armed = True

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._armed:
            return
        stepping = [t for g in optimizer.param_groups for t in g["params"]]
        if any(t.numel() > 0 and t.grad is not None for t in stepping):
            self._armed = False
            self._before_update()

    def remove(self) -> None:
        self._handle.remove()


class _OptimizerView:
    """`StateSources.optimizer` of a ZeRO run (the engine only calls `state_dict()`)."""

    def __init__(self, zero: ZeroState) -> None:
        self._zero = zero
        self.param_groups = zero.zero.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self._zero.optimizer_state_dict()
