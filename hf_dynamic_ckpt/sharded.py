"""Sharded training state (FSDP2, DeepSpeed ZeRO 1-3; docs/fsdp.md, docs/deepspeed.md): every rank saves its own
part as chunks of the global tensors (`store.shard_files`), without a collective; a resume reads on every rank the
blocks its part covers from whichever ranks' chunks hold them, so another world size (or ZeRO stage) reads the same
state. The ZeRO fragments are views of the live buffers narrowed from the addresses (DeepSpeed's own views exist
under stages 1 and 2 only, after the first step)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from .constants import ALL_TIERS, KEY_SHARDED, SHARD_OPTIMIZER_KEY, Tier
from .constants import SHARD_PART_OPTIMIZER as OPTIMIZER
from .constants import SHARD_PART_WEIGHTS as WEIGHTS
from .errors import ConfigError, IncompatibleStateError, SaveError
from .state import CachedWeights, StateSources, check_zero, is_dtensor, trainable_state_dict, zero_optimizer
from .store import LoadedCheckpoint
from .store.shard_files import ChunkReader, is_flat, sharded_table

MASTER = "master"  # the fp32 master weights among a ZeRO parameter's optimizer state (`state.<fqn>.master`)
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _state_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of a full fine-tune (no frozen parameter): state too, never partitioned."""
    params = dict(model.named_parameters())
    keys = set(model.state_dict()) - set(params) if all(p.requires_grad for p in params.values()) else set()
    return {name: b for name, b in model.named_buffers() if name in keys}


class ZeroExpected(dict):  # type: ignore[type-arg]
    """A ZeRO run's `{name: meta tensor of the global shape}` for the model check; its type tells `check_sharding`."""


def zero_expected(model: nn.Module) -> ZeroExpected:
    """`ZeroExpected` of `model`'s trainable parameters (stage 3: `ds_shape`) and a full fine-tune's buffers."""
    out = ZeroExpected((n, torch.empty(tuple(getattr(p, "ds_shape", p.shape)), device="meta"))
                       for n, p in model.named_parameters() if p.requires_grad)
    out.update((n, torch.empty(tuple(b.shape), device="meta")) for n, b in _state_buffers(model).items())
    return out


def check_sharding(step: int, manifest: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """`IncompatibleStateError` (before anything changes) unless a ZeRO checkpoint resumes under ZeRO (`expected` a
    `ZeroExpected`), an FSDP2 one into a sharded model, an unsharded one into an unsharded model."""
    extra = manifest.get("extra")
    table = extra.get(KEY_SHARDED) if isinstance(extra, dict) else None
    flat = isinstance(table, dict) and isinstance(table.get("ranks"), dict) and is_flat(table)
    zero = isinstance(expected, ZeroExpected)
    if flat != zero:
        where = "under DeepSpeed ZeRO" if flat else ("sharded by FSDP2" if table is not None else "without sharding")
        raise IncompatibleStateError(
            f"step {step} was saved {where} and this run {'trains under ZeRO' if zero else 'does not'}: resume it "
            "in the set-up that saved it (any ZeRO stage and number of processes for a ZeRO checkpoint), or export "
            "its weights (`hf-dynamic-ckpt export`) and start a new run from them.")
    live = any(is_dtensor(v) for v in expected.values())
    if not zero and table is not None and not live:
        raise IncompatibleStateError(
            f"step {step} was saved sharded (FSDP2: one file of shards per rank) and this model is not sharded: "
            "resume it with the fully_shard-ed model through SmartCheckpointer or RunOrchestrator.attach + resume "
            "(Trainer's resume_checkpoint does not read sharded checkpoints yet).")
    if live and table is None:
        raise IncompatibleStateError(
            f"step {step} was saved without sharding (one full copy by rank 0) and this model is sharded "
            "(fully_shard): resume it with the unsharded model it was saved from.")


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if is_dtensor(t) else t).detach()  # type: ignore[attr-defined]


def _reader(loaded: LoadedCheckpoint) -> ChunkReader:
    table = sharded_table(loaded.manifest)
    assert table is not None  # `check_sharding` ran: a sharded run's checkpoint is sharded
    return ChunkReader(Path(loaded.info.path), table)


class ShardedState:
    """This rank's FSDP2 state (`fully_shard`-ed `model`; an Accelerate wrapper is unwrapped), local shards by FQN."""

    def __init__(self, model: nn.Module, optimizer: Any | None = None) -> None:
        self.model = model
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self._buffers = set(_state_buffers(model))
        self._chunks: dict[str, tuple[int, tuple[int, ...], dict[str, Any]]] = {}

    def expected(self) -> dict[str, torch.Tensor]:
        """L0 by name, global DTensors (walked per save: a DTensor has no data pointer for `CachedWeights`)."""
        out: dict[str, torch.Tensor] = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        return out | {n: b for n, b in self.model.named_buffers() if n in self._buffers}

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: _local(t) for n, t in self.expected().items()}

    def _optimizer(self) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict[str, Any]]]:
        """`({fqn: {name: tensor}}, param_groups with FQNs)`; not DCP's, which steps a state-less optimizer."""
        names, opt = {id(p): n for n, p in self.model.named_parameters()}, self.optimizer  # type: dict[int, str], Any
        state: dict[str, dict[str, torch.Tensor]] = {}
        groups = []
        for group in opt.param_groups if opt is not None else []:
            if any(id(p) not in names for p in group["params"]):
                raise SaveError("an optimizer parameter is not a parameter of the model: a sharded save names "
                                "optimizer state by the model's parameter names; optimize the model's parameters.")
            groups.append({**group, "params": [names[id(p)] for p in group["params"]]})
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor):
                        raise SaveError(f"optimizer state {names[id(p)]}.{key} is a {type(value).__name__}, not a "
                                        "tensor: sharded saves store tensor optimizer state only (Adam, AdamW, SGD).")
                    state.setdefault(names[id(p)], {})[key] = value
        return state, groups

    def optimizer_state_dict(self) -> dict[str, Any]:
        state, groups = self._optimizer()
        return {"state": {f: {k: _local(t) for k, t in per.items()} for f, per in state.items()},
                "param_groups": groups}

    def chunks(self) -> dict[str, dict[str, dict[str, Any]]]:
        optimizer = {SHARD_OPTIMIZER_KEY.format(fqn=f, name=k): t for f, per in self._optimizer()[0].items()
                     for k, t in per.items()}
        parts = {WEIGHTS: self.expected(), OPTIMIZER: optimizer}
        return {part: {key: self._chunk(key, t) for key, t in tensors.items()} for part, tensors in parts.items()}

    def _chunk(self, key: str, t: torch.Tensor) -> dict[str, Any]:
        """This rank's block of `t` (DCP's chunk, cached per live tensor: its mesh and placements decide it)."""
        cached = self._chunks.get(key)
        if cached is not None and cached[:2] == (id(t), tuple(t.shape)):
            return cached[2]
        local = _local(t)
        offset, size = [0] * t.dim(), list(t.shape)
        if is_dtensor(t):
            (chunk,) = t.__create_chunk_list__()  # type: ignore[attr-defined]
            offset, size = [int(o) for o in chunk.offsets], [int(s) for s in chunk.sizes]
            if size != list(local.shape):
                raise SaveError(f"a DTensor's local shard has shape {tuple(local.shape)} but its placement says "
                                f"{tuple(size)}: padded or uneven shards of this kind are not supported.")
        out = {"shape": list(t.shape), "offset": offset, "size": size, "dtype": str(local.dtype).removeprefix("torch.")}
        self._chunks[key] = (id(t), tuple(t.shape), out)
        return out

    def load(self, loaded: LoadedCheckpoint) -> None:
        """Read L0 (and L1 with `loaded.optimizer`'s `param_groups`) into the live shards; `loaded.weights` is then
        `None` (applied)."""
        from torch.distributed.checkpoint import state_dict as dcp

        check_sharding(loaded.info.step, loaded.manifest, self.expected())
        groups: Any = loaded.optimizer.get("param_groups") if isinstance(loaded.optimizer, dict) else None
        opt, options = self.optimizer if groups is not None else None, dcp.StateDictOptions(strict=False)
        # The live state keyed by FQN: a fresh optimizer makes it here (DCP steps it once with zero gradients).
        optim: Any = dcp.get_optimizer_state_dict(self.model, opt, options=options)["state"] if opt is not None else {}
        tensors = [(WEIGHTS, key, t) for key, t in self.expected().items()]
        tensors += [(OPTIMIZER, SHARD_OPTIMIZER_KEY.format(fqn=f, name=k), t) for f, per in optim.items()
                    for k, t in per.items()]
        with _reader(loaded) as reader, torch.no_grad():
            for part, key, t in tensors:
                reader.read_into(part, key, _local(t), self._chunk(key, t)["offset"])
        if opt is not None:
            dcp.set_optimizer_state_dict(self.model, opt, {"state": optim, "param_groups": groups}, options=options)
        loaded.weights = None


@dataclass
class Fragment:
    """One rank's run `[start, start + numel)` of a parameter's flattened elements, and its live views."""

    name: str
    shape: tuple[int, ...]
    start: int
    numel: int
    flat: int  # the flat fp32 partition (a sub-group under stage 3) it lies in
    at: int  # where in it
    master: torch.Tensor
    states: dict[str, torch.Tensor]
    weight: torch.Tensor | None  # stage 3: this rank's partition of the live parameter


def _flat_chunk(shape: Iterable[int], start: int, numel: int, dtype: torch.dtype) -> dict[str, Any]:
    shape = [int(n) for n in shape]
    return {"shape": [math.prod(shape)], "offset": [start], "size": [numel],
            "dtype": str(dtype).removeprefix("torch."), "tensor_shape": shape}


class ZeroState:
    """This rank's DeepSpeed ZeRO state (`engine.module`, the ZeRO optimizer or Accelerate's wrapper), with the
    interface of `ShardedState`; `ConfigError` for an optimizer that is not ZeRO's or a set-up `check_zero` refuses."""

    def __init__(self, model: nn.Module, optimizer: Any, *, rank: int) -> None:
        zero = zero_optimizer(optimizer)
        if zero is None:
            raise ConfigError(f"{type(optimizer).__name__} is not a DeepSpeed ZeRO optimizer.")
        check_zero(zero)
        self.model, self.zero, self.rank = model, zero, rank
        self.stage = 3 if hasattr(zero, "fp32_partitioned_groups_flat") else \
            2 if getattr(zero, "partition_gradients", False) else 1
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._buffers = _state_buffers(model)
        # The base optimizer's groups between steps (stages 1 and 2 swap the list inside its step)
        self._base_groups: list[dict[str, Any]] = list(zero.optimizer.param_groups)
        self.note_boundary()

    def note_boundary(self) -> None:
        """Remember the loss scaler at a step's end, for a capture inside the next step (`ZeroUpdateSeam`)."""
        scaler = getattr(self.zero, "loss_scaler", None)
        values = {k: getattr(scaler, k) for k in _SCALER_FIELDS if hasattr(scaler, k)}
        self._scaler = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in values.items()}

    @property
    def skipped_update(self) -> bool:
        """Whether the engine's last step skipped the update (an fp16 overflow: no partition was stepped)."""
        return bool(getattr(self.zero, "overflow", False))

    def flat_groups(self) -> list[torch.Tensor]:
        """The flat fp32 partitions of this rank (one per parameter group; per sub-group under stage 3)."""
        z = self.zero
        return list(z.fp32_partitioned_groups_flat if self.stage == 3 else z.single_partition_of_fp32_groups)

    def _param_groups(self) -> list[list[nn.Parameter]]:
        return list(self.zero.fp16_groups if self.stage == 3 else self.zero.bit16_groups)

    def trained_partitions(self) -> int:
        return sum(1 for params in self._param_groups() if any(p.requires_grad for p in params))

    def _group(self, fi: int) -> dict[str, Any]:
        """The base optimizer's hyper-parameter group of flat partition `fi` (stage 3: of its sub-group)."""
        index = self.zero.sub_group_to_group_id.get(fi, fi) if self.stage == 3 else fi
        return self._base_groups[index] if index < len(self._base_groups) else {}

    def _name(self, p: nn.Parameter) -> str:
        if id(p) not in self._names:
            raise ConfigError("a parameter DeepSpeed optimizes is not a parameter of the model given to "
                              "hf_dynamic_ckpt: pass the model the engine trains (engine.module).")
        return self._names[id(p)]

    def _states(self, flat: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in (self.zero.optimizer.state.get(flat) or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # not the step count: per group
                if value.shape != flat.shape:
                    raise ConfigError(f"optimizer state {name}.{key} has shape {tuple(value.shape)}, not the shape of "
                                      f"the flat fp32 partition {tuple(flat.shape)}: hf_dynamic_ckpt saves optimizers "
                                      "with per-element state under ZeRO (Adam, AdamW, SGD with momentum, ...).")
                out[key] = value
        return out

    def fragments(self) -> Iterator[Fragment]:
        """This rank's fragments of every trainable parameter (views of the live buffers), in group order."""
        flats = self.flat_groups()
        for fi, params in enumerate(self._param_groups()):
            for p in (p for p in params if p.requires_grad):
                ds: Any = p  # stage 3's partitioned parameter (ds_* attributes)
                weight = None
                if self.stage == 3:
                    group, at, _ = self.zero.grad_position[self.zero.get_param_id(p)]
                    per = int(ds.partition_numel())  # rank R holds the elements from R * per (the last: padding)
                    start = self.rank * per
                    numel = max(0, min(per, int(ds.ds_numel) - start))
                    if numel == 0:
                        continue
                    fi, at, shape, weight = int(group), int(at), tuple(ds.ds_shape), ds.ds_tensor.narrow(0, 0, numel)
                else:
                    mapping = getattr(p, "_hp_mapping", None)
                    if mapping is None:
                        continue  # no element of this parameter in this rank's partition
                    start, numel = int(mapping.lp_fragment_address.start), int(mapping.lp_fragment_address.numel)
                    at, shape = int(mapping.hp_fragment_address.start), tuple(p.shape)
                name = self._name(p)
                states = {k: v.narrow(0, at, numel) for k, v in self._states(flats[fi], name).items()}
                yield Fragment(name, shape, start, numel, fi, at, flats[fi].narrow(0, at, numel), states, weight)

    def _whole_weights(self) -> dict[str, torch.Tensor]:
        """What every rank holds whole, flattened: the trainable parameters under stages 1 and 2, the buffers."""
        params = {} if self.stage == 3 else {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        return {n: t.detach().reshape(-1) for n, t in (params | self._buffers).items()}

    def weights(self) -> dict[str, torch.Tensor]:  # stage 3 partitions; rank 0 adds what every rank holds whole
        out = self._whole_weights() if self.rank == 0 else {}
        return out | {f.name: f.weight for f in self.fragments() if f.weight is not None}

    def optimizer_state_dict(self) -> dict[str, Any]:
        groups, flats = [], self.flat_groups()
        for fi, params in enumerate(self._param_groups()):
            step = (self.zero.optimizer.state.get(flats[fi]) or {}).get("step")
            groups.append({**self._group(fi), "params": [self._name(p) for p in params if p.requires_grad],
                           "step": float(step) if step is not None else None})
        return {"state": {f.name: {MASTER: f.master, **f.states} for f in self.fragments()}, "param_groups": groups,
                "zero": {"stage": self.stage, "loss_scaler": dict(self._scaler)}}

    def chunks(self) -> dict[str, dict[str, dict[str, Any]]]:
        shapes = {n: t.shape for n, t in [*self.model.named_parameters(), *self._buffers.items()]}
        weights = {n: _flat_chunk(shapes[n], 0, t.numel(), t.dtype) for n, t in self._whole_weights().items()} \
            if self.rank == 0 else {}
        optimizer: dict[str, Any] = {}
        for f in self.fragments():
            run = partial(_flat_chunk, f.shape, f.start, f.numel)
            if f.weight is not None:
                weights[f.name] = run(f.weight.dtype)
            optimizer.update((SHARD_OPTIMIZER_KEY.format(fqn=f.name, name=k), run(t.dtype))
                             for k, t in {MASTER: f.master, **f.states}.items())
        return {WEIGHTS: weights, OPTIMIZER: optimizer}

    def expected(self) -> ZeroExpected:
        return zero_expected(self.model)

    def load(self, loaded: LoadedCheckpoint) -> None:
        """Write the checkpoint's state into the live model and partitions, each range straight into its partition;
        then `loaded.weights` is `None` (applied; `apply_optimizer_state` leaves a ZeRO optimizer to this load). With
        the optimizer tier (`loaded.optimizer` holds its `param_groups`): master weights and moments, step counts,
        hyper-parameters and loss scale; without it: the master weights from the weights, the moments as they are."""
        check_sharding(loaded.info.step, loaded.manifest, self.expected())
        optimizer = loaded.optimizer if isinstance(loaded.optimizer, dict) and "param_groups" in loaded.optimizer \
            else None
        with _reader(loaded) as reader:
            read, base = reader.read_into, self.zero.optimizer  # type: Callable[..., None], Any
            moments = {key.rsplit(".", 1)[1] for key in reader.keys(OPTIMIZER)} - {MASTER}
            # The state a fresh run has not made yet (torch optimizers make it at their first step): the saved
            # moments, uninitialised, and the step count; none when none was saved (as it was before the first update).
            created: dict[int, list[torch.Tensor]] = {}
            for fi, flat in enumerate(self.flat_groups() if optimizer is not None else []):
                if not moments:
                    base.state.pop(flat, None)
                    continue
                state = base.state[flat]
                for key in moments - set(state):
                    state[key] = torch.empty_like(flat, memory_format=torch.preserve_format)
                    created.setdefault(fi, []).append(state[key])
                if "step" not in state:
                    group = self._group(fi)
                    on_device = bool(group.get("fused") or group.get("capturable"))  # torch Adam's placement of it
                    state["step"] = torch.zeros((), dtype=torch.float32, device=flat.device if on_device else "cpu")
            params = dict(self.model.named_parameters())
            covered: dict[int, list[tuple[int, int]]] = {}
            if self.stage == 3:  # as DeepSpeed's own load: no parameter gathered while its partition is written
                self.zero.checkpoint_event_prologue()
            try:
                with torch.no_grad():
                    for name, live in self._whole_weights().items():
                        read(WEIGHTS, name, live)
                    for f in self.fragments():
                        if f.weight is not None:
                            read(WEIGHTS, f.name, f.weight, [f.start])
                        if optimizer is None:
                            f.master.copy_(f.weight if f.weight is not None else
                                           params[f.name].detach().reshape(-1).narrow(0, f.start, f.numel))
                            continue
                        for key, live in {MASTER: f.master, **f.states}.items():
                            read(OPTIMIZER, SHARD_OPTIMIZER_KEY.format(fqn=f.name, name=key), live, [f.start])
                        covered.setdefault(f.flat, []).append((f.at, f.at + f.numel))
            except BaseException:
                for t in (t for made in created.values() for t in made):  # no uninitialised moments behind a failure
                    t.zero_()
                raise
        for fi, made in created.items():  # what no fragment covers (the last rank's padding) is zero
            at = 0
            for lo, hi in [*sorted(covered.get(fi, [])), (made[0].numel(), made[0].numel())]:
                for t in made:
                    t.narrow(0, at, max(0, lo - at)).zero_()
                at = max(at, hi)
        if self.stage == 3:  # the persistent (small, never released) parameters gathered again from the partitions
            self.zero.checkpoint_event_epilogue()
        if optimizer is not None:
            self._load_groups(optimizer, step=loaded.info.step)
        loaded.weights = None

    def _load_groups(self, optimizer: dict[str, Any], *, step: int) -> None:
        saved = optimizer["param_groups"]
        if not isinstance(saved, list):
            raise IncompatibleStateError(f"step {step}: the optimizer tier has no ZeRO param_groups; it was not saved "
                                         "under DeepSpeed.")
        by_name = {name: g for g in saved if isinstance(g, dict) for name in g.get("params") or []}
        flats = self.flat_groups()
        for fi, params in enumerate(self._param_groups()):
            group = next((by_name[n] for n in (self._name(p) for p in params if p.requires_grad) if n in by_name), None)
            if group is None:
                continue
            count = (self.zero.optimizer.state.get(flats[fi]) or {}).get("step")
            if isinstance(group.get("step"), (int, float)) and isinstance(count, torch.Tensor):
                count.fill_(float(group["step"]))
            live = self._group(fi)
            for key, value in group.items():  # the hyper-parameters a schedule moves (lr, momentum, betas ...)
                if key not in ("params", "step") and key in live:
                    live[key] = tuple(value) if isinstance(live[key], tuple) else value
        scaler = getattr(self.zero, "loss_scaler", None)
        for key, value in ((optimizer.get("zero") or {}).get("loss_scaler") or {}).items():
            if key in _SCALER_FIELDS and hasattr(scaler, key):
                setattr(scaler, key, value)
        self.note_boundary()


class _StepHook:
    """A pre-hook on the wrapped torch optimizer's `step` (once per flat partition); `remove()` detaches it."""

    _hook: Callable[[Any, Any, Any], None]

    def __init__(self, zero: ZeroState) -> None:
        self._zero, self._handle = zero, zero.zero.optimizer.register_step_pre_hook(self._hook)

    def remove(self) -> None:
        self._handle.remove()


class ZeroGradSquares(_StepHook):
    """This rank's squared gradient norms per `bucket(name)` of parameters (of `buckets`), read from the ZeRO gradient
    partitions (docs/deepspeed.md, "Signals"; after the engine's clipping); `pop()` returns the sums since the last
    pop, the caller adds them across ranks."""

    def __init__(self, zero: ZeroState, bucket: Callable[[str], int], buckets: int) -> None:
        self._bucket, self._n = bucket, buckets
        self._sq: list[float] | None = None
        # (partition, bucket, offset, length) of every fragment, fixed once the engine exists: walked at the first step
        self._layout: list[tuple[int, int, int, int]] | None = None
        super().__init__(zero)

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        stepping = {id(t) for g in optimizer.param_groups for t in g["params"]}
        grads = {i: g for i, flat in enumerate(self._zero.flat_groups())
                 if id(flat) in stepping and (g := flat.grad) is not None}
        if self._layout is None and grads:
            self._layout = [(f.flat, self._bucket(f.name), f.at, f.numel) for f in self._zero.fragments()]
        pieces = [(b, grads[fi].narrow(0, at, numel)) for fi, b, at, numel in self._layout or [] if fi in grads]
        if pieces:
            norms = torch.stack(torch._foreach_norm([g for _, g in pieces], 2.0)).to(torch.float64).tolist()
            self._sq = self._sq or [0.0] * self._n
            for (b, _), v in zip(pieces, norms):
                self._sq[b] += v * v

    def pop(self) -> list[float] | None:  # `None` when no step ran
        out, self._sq = self._sq, None
        return out


class ZeroUpdateSeam(_StepHook):
    """Calls `before_update()` inside the engine's optimizer step, once per step, after the gradients are reduced and
    the global norm computed, before the first flat partition with elements and a gradient is updated (after
    `ZeroGradSquares`' hook, registered first; docs/deepspeed.md, "Signals"); `arm()` makes it fire at the next one."""

    def __init__(self, zero: ZeroState, before_update: Callable[[], None]) -> None:
        self._before_update, self._armed = before_update, True
        super().__init__(zero)

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
        if self._armed and any(t.numel() > 0 and t.grad is not None for g in optimizer.param_groups
                               for t in g["params"]):
            self._armed = False
            self._before_update()


def sources_for(model: nn.Module, *, rank: int, weights: Callable[[], Mapping[str, torch.Tensor]] | None,
                frozen_keys: Iterable[str], optimizer: Any | None, scheduler: Any | None, scaler: Any | None,
                sampler: Callable[[], dict[str, Any]] | None
                ) -> tuple[ShardedState | ZeroState | None, StateSources, frozenset[Tier]]:
    """`(sharded state or None, this rank's StateSources, its tiers)`: under ZeRO and FSDP2 every rank saves its
    shards of L0 and L1 (scheduler and scaler: rank 0), otherwise rank 0 alone saves L0 and L1."""
    main = rank == 0
    sharded = ZeroState(model, optimizer, rank=rank) if zero_optimizer(optimizer) is not None else \
        ShardedState(model, optimizer) if any(is_dtensor(p) for p in model.parameters()) else None
    kept: dict[str, Any] = {"scheduler": scheduler, "scaler": scaler} if main else {}
    if sharded is not None:
        source = SimpleNamespace(state_dict=sharded.optimizer_state_dict) if optimizer is not None else None
        sources = StateSources(weights=sharded.weights, optimizer=source,  # type: ignore[arg-type]
                               sampler=sampler, **kept)
        return sharded, sources, ALL_TIERS if main or optimizer is not None else frozenset({Tier.WEIGHTS, Tier.STATE})
    weights = weights or CachedWeights(model, partial(trainable_state_dict, model))
    sources = StateSources(weights=weights if main else None, frozen_keys=frozenset(frozen_keys),
                           optimizer=optimizer if main else None, sampler=sampler, **kept)
    if not main:
        return None, sources, frozenset({Tier.STATE})
    untrained = optimizer is None and scheduler is None and scaler is None  # no optimizer tier (or not trained at all)
    return None, sources, ALL_TIERS - {Tier.OPTIMIZER} if untrained else ALL_TIERS
