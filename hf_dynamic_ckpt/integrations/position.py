"""The exact data position of a run on any number of processes (docs/accelerate.md, "Exact data position and RNG";
docs/elastic.md). Invariants: the saved RNG goes back only once the resumed epoch's first batch is fetched; a
complete epoch's position is the next one's start `(epoch + 1, 0)`; every loader the run iterates is part of the
position (`LoaderSeeds`); on another world size the global batch is kept (`plan_batch`) and the position is kept in
samples of the epoch's order (`rescale_batches_seen`), a rank the checkpoint had not starts from rank 0's state, and
what cannot be kept is said.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, SeedableRandomSampler

from .. import distributed as dist
from ..errors import CorruptCheckpointError, GlobalBatchError, weights_overwritten
from ..state import capture_rng_state, restore_rng_state, state_b64, state_unb64
from ..store import LoadedCheckpoint

logger = logging.getLogger(__name__)

POSITION_VERSION = 1
KEY_EPOCH = "epoch"
KEY_BATCHES_SEEN = "batches_seen"
KEY_SKIP = "skip"  # batches a rollback still has to leave out (`rollback_skip_batches`)
KEY_EPOCH_START_RNG = "epoch_start_rng"  # one entry per rank (rank 0 writes the sampler file)
KEY_EPOCH_START_GENERATOR = "epoch_start_generator"
KEY_WORLD_SIZE = "world_size"
KEY_DEALT = "dealt"  # the ranks read different batches of one order (Accelerate's sharding or dispatching)
KEY_LOADERS = "loaders"  # {name: {"iterator": bool, "iteration": int}} of the other loaders the run iterates
KEY_BATCH = "batch"  # the `BatchGeometry`
KEY_DRAWS_RANDOM = "draws_random"  # `StepRandomness.seen`: a step drew random numbers on this rank


# ---------------------------------------------------------------------------- batch geometry
@dataclass(frozen=True)
class BatchGeometry:

    per_device: int
    world_size: int
    accumulation: int

    @property
    def global_batch(self) -> int:
        return self.per_device * self.world_size * self.accumulation

    def describe(self) -> str:
        return (f"{self.world_size} process(es) x {self.per_device} per device x {self.accumulation} accumulation "
                f"= {self.global_batch}")

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> BatchGeometry | None:
        """`None`: saved without one, or not three positive integers."""
        fields = [value.get(f.name) for f in dataclasses.fields(cls)] if isinstance(value, dict) else [None]
        ints = [v for v in fields if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        return cls(*ints) if len(ints) == len(fields) else None


@dataclass(frozen=True)
class BatchPlan:
    """The accumulation a resume trains with, and the line that says so."""

    accumulation: int
    note: str | None = None  # INFO: the world size changed, the global batch is kept
    warning: str | None = None  # WARNING: the global batch changes (keep_global_batch=false)


def plan_batch(saved: BatchGeometry, now: BatchGeometry, *, keep: bool = True, step: int | None = None,
               position_in: str = "steps") -> BatchPlan:
    """The accumulation a run resumed with geometry `now` trains with: on the saving world size `now`'s own (as
    Trainer resumes, transformers#43708), on another the `saved` global batch unless not `keep`, else a
    `GlobalBatchError` naming the settings that would keep it. `position_in`: `"steps"` (Trainer) or `"samples"`."""
    at = f"step {step}" if step is not None else "the checkpoint"
    if now.world_size == saved.world_size:  # the run's own settings, as Trainer resumes them
        return BatchPlan(now.accumulation)
    if not keep and now.global_batch != saved.global_batch:
        if position_in == "samples":
            stays = "the step count and the learning-rate schedule's position stay in optimizer steps, the data " \
                "position in samples of its order"
        else:
            stays = "the step count, the learning-rate schedule's position, max_steps and the data position stay in " \
                "optimizer steps"
            if step is not None:
                stays += f"; the data continues at sample {step * now.global_batch} of its order (the interrupted " \
                    f"run had read {step * saved.global_batch})"
        return BatchPlan(now.accumulation, warning=(
            f"{at} was saved with a global batch of {saved.describe()} and is resumed with {now.describe()} "
            "(runtime.keep_global_batch=false): every optimizer step from here on averages "
            f"{now.global_batch} samples instead of {saved.global_batch}; {stays}"))
    per_rank_step = now.per_device * now.world_size
    if saved.global_batch % per_rank_step:
        raise GlobalBatchError(
            f"{at} was saved with a global batch of {saved.describe()}; with {now.world_size} process(es) x "
            f"{now.per_device} per device no gradient accumulation gives {saved.global_batch} samples per step. "
            f"{_ways(saved.global_batch, now.world_size)}; or accept another global batch with "
            "runtime.keep_global_batch=false.")
    accumulation = saved.global_batch // per_rank_step
    kept = dataclasses.replace(now, accumulation=accumulation)
    changed = f"; gradient_accumulation_steps {now.accumulation} -> {accumulation}" \
        if accumulation != now.accumulation else ""
    return BatchPlan(accumulation, note=f"{at} was saved by {saved.describe()} and is resumed by {kept.describe()}"
                                        f"{changed}: the same samples per optimizer step")


def _ways(global_batch: int, world_size: int) -> str:
    if global_batch % world_size:
        sizes = [w for w in range(1, global_batch + 1) if global_batch % w == 0]
        return (f"{global_batch} samples do not divide over {world_size} process(es): resume on a process count "
                f"that divides it ({', '.join(map(str, sizes[:8]))}{', ...' if len(sizes) > 8 else ''})")
    per_rank = global_batch // world_size
    pairs = [f"{b} x {per_rank // b}" for b in range(per_rank, 0, -1) if per_rank % b == 0][:6]
    return (f"Keep it with per_device_train_batch_size x gradient_accumulation_steps = {per_rank}, e.g. "
            f"{', '.join(pairs)}")


class StepRandomness:
    """Sticky: a step's forward and backward drew random numbers on this rank (the generators at `begin` vs `end`)."""

    def __init__(self) -> None:
        self.seen = False
        self._at_begin: list[torch.Tensor] | None = None

    @staticmethod
    def _states() -> list[torch.Tensor]:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        return [torch.get_rng_state(), *([torch.cuda.get_rng_state()] if cuda else [])]

    def begin(self) -> None:
        if not self.seen:
            self._at_begin = self._states()

    def end(self) -> None:
        before, self._at_begin = self._at_begin, None
        if before is not None and not self.seen:
            after = self._states()
            self.seen = len(before) != len(after) or not all(torch.equal(a, b) for a, b in zip(before, after))


def world_change_note(saved_world: int, world: int, draws_random: bool | None) -> str | None:
    """What a change of world size does not keep (`None`: the same world size, or steps drawing no random numbers)."""
    if saved_world == world or draws_random is False:
        return None
    why = "its steps draw random numbers (dropout)" if draws_random else \
        "the checkpoint does not say whether its steps draw random numbers"
    return (f"saved by {saved_world} process(es), resumed by {world}, and {why}: each rank draws its own masks, so "
            "the masks of the resumed run differ from the interrupted one's (the samples of each step do not)")


def resume_batch(loaded: LoadedCheckpoint, now: BatchGeometry | None, *, world: int, keep: bool,
                 say: logging.Logger | None, read_into: bool, position_in: str = "steps",
                 data: bool = True) -> BatchPlan | None:
    """The batch plan of a resume of `loaded` by geometry `now` on `world` processes (`None` where either records
    none), after `say` (rank 0's logger, else `None`) said what a change of world size keeps. `data`: the run tracks
    a data position. A loader that does not deal its batches keeps a step's samples on any number of processes.
    Raises `GlobalBatchError` as `plan_batch` (saying the weights were overwritten when the resume had `read_into`)."""
    sampler, step, saved_world = loaded.sampler or {}, loaded.info.step, loaded.info.world_size
    saved, dealt = BatchGeometry.from_json(sampler.get(KEY_BATCH)), bool(sampler.get(KEY_DEALT, True))
    plan, tell = None, say.log if say is not None else (lambda *_: None)
    if saved is not None and now is not None:
        if not dealt:
            saved, now = dataclasses.replace(saved, world_size=1), dataclasses.replace(now, world_size=1)
        try:
            plan = plan_batch(saved, now, keep=keep, step=step, position_in=position_in)
        except GlobalBatchError as e:
            if not read_into:
                raise
            raise GlobalBatchError(f"{e}{weights_overwritten(f'the weights of step {step}')}") from None
        if plan.warning or plan.note:
            tell(logging.WARNING if plan.warning else logging.INFO, "smart_ckpt: %s", plan.warning or plan.note)
    elif saved_world != world and data:
        tell(logging.WARNING, "smart_ckpt: %s", f"step {step} was saved by {saved_world} process(es) and is resumed "
             f"by {world}, and it does not record its global batch: keep the per-device batch x processes x "
             "gradient_accumulation_steps as it was")
    note = world_change_note(saved_world, world, sampler.get(KEY_DRAWS_RANDOM)) if dealt else None
    if note is not None:  # with every rank reading every batch, a rank continuing rank 0's stream draws its masks
        tell(logging.WARNING, "smart_ckpt: %s", f"step {step} was {note}")
    return plan


# ---------------------------------------------------------------------------- data position
def rank_rngs() -> list[Any]:
    """Every rank's RNG now (a collective), restored with `restore_rank_rng`."""
    return dist.all_gather_json(capture_rng_state())


def restore_rank_rng(ranks: list[Any]) -> None:
    """This rank's RNG of `ranks` goes back; a rank the checkpoint had not takes rank 0's (as its RNG continues
    rank 0's)."""
    if (rng := ranks[dist.rank()] if dist.rank() < len(ranks) else ranks[0]) is not None:
        restore_rng_state(rng)


def _generator(dataloader: Any) -> torch.Generator | None:
    """The generator that orders the epoch (Accelerate's synchronized one, else the sampler's)."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    samplers = (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None))
    gens = [getattr(dataloader, "synchronized_generator", None), *(getattr(s, "generator", None) for s in samplers)]
    return next((gen for gen in gens if isinstance(gen, torch.Generator)), None)


def deals_batches(dataloader: Any) -> bool:
    """`dataloader` was prepared by Accelerate: its ranks read different batches (sharded or dispatched)."""
    return isinstance(dataloader, DataLoaderShard | DataLoaderDispatcher)


def per_device_batch(dataloader: Any) -> int | None:
    """Samples per batch on one rank, `None` when the loader does not say (a batch sampler without a size)."""
    total = getattr(dataloader, "total_batch_size", None) if deals_batches(dataloader) else None
    if isinstance(total, int) and total > 0:  # accelerate: per-device x processes (split batches: the full batch)
        return max(1, total // dist.world_size())
    size = getattr(dataloader, "batch_size", None)
    if not isinstance(size, int):
        size = getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def rescale_batches_seen(seen: int, saved: BatchGeometry, now: BatchGeometry, *, dealt: bool) -> tuple[int, int]:
    """`seen` batches per rank of `saved` as batches per rank of `now`, and the samples of the order it repeats: the
    position in samples (a batch of a `dealt` loader spans every rank) rounded down to a whole batch of `now`."""
    width_saved, width_now = (g.per_device * (g.world_size if dealt else 1) for g in (saved, now))
    return divmod(seen * width_saved, width_now)


def order_note(dataloader: Any, *, saved_generator: bool) -> str | None:
    """Why the epoch order of a dealing `dataloader` differs between two numbers of processes (`None`: it does not)."""
    sampler = getattr(dataloader, "sampler", None)  # the sampler that orders the epoch's samples
    batch_sampler = sampler if isinstance(sampler, torch.utils.data.BatchSampler) else \
        getattr(dataloader, "batch_sampler", None)
    sampler = getattr(getattr(batch_sampler, "batch_sampler", batch_sampler), "sampler", None)  # under a shard
    if not isinstance(sampler, torch.utils.data.RandomSampler):
        return None  # sequential (or a custom sampler, which orders as it orders)
    if isinstance(sampler, SeedableRandomSampler) or (saved_generator and _generator(dataloader) is not None):
        return None
    return ("the sampler draws the epoch's order from the main random stream (a shuffling DataLoader without a "
            "generator: accelerate gives it one only with more than one process), so the order differs from the "
            "interrupted run's and the rest of the epoch reads some samples again and skips others; for the same "
            "order on any number of processes use Accelerator(dataloader_config=DataLoaderConfiguration("
            "use_seedable_sampler=True)) or DataLoader(..., generator=torch.Generator().manual_seed(seed))")


def _gen_b64(gen: torch.Generator | None) -> str | None:
    return None if gen is None else state_b64(gen.get_state())


def _set_gen(gen: torch.Generator | None, state: str | None) -> None:
    if gen is not None and state is not None:
        gen.set_state(state_unb64(state))


def persistent_workers(dataloader: Any) -> bool:
    return bool(getattr(dataloader, "persistent_workers", False)) and int(getattr(dataloader, "num_workers", 0)) > 0


def has_iterator(dataloader: Any) -> bool:
    inner = getattr(dataloader, "base_dataloader", dataloader)
    return getattr(inner, "_iterator", None) is not None


class LoaderSeeds:
    """The persistent loaders whose iterators a resumed run creates without drawing from the main generator where
    the uninterrupted run had them (`lend` a throwaway generator until the iterator exists, `settle`). `record` (a
    save) says per loader whether its iterator existed and its `iteration`; `arm` (a resume) and `resume(name,
    loader)` (first met) put both back; loaders not met yet are recorded as the checkpoint had them."""

    def __init__(self) -> None:
        self._due: dict[str, dict[str, Any]] = {}
        self._lent: dict[int, tuple[Any, Callable[[], None]]] = {}

    def record(self, loaders: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        out = {name: dict(entry) for name, entry in self._due.items()}
        for name, loader in loaders.items():
            if loader is not None and name not in self._due:
                at = getattr(loader, "iteration", None)
                out[name] = {"iterator": has_iterator(loader), **({"iteration": at} if isinstance(at, int) else {})}
        return out

    def arm(self, recorded: Mapping[str, Any] | None) -> None:
        self._due = {str(name): dict(entry) for name, entry in (recorded or {}).items() if isinstance(entry, dict)}

    def resume(self, name: str, loader: Any) -> None:
        entry = self._due.pop(name, None)
        if entry is None or loader is None:
            return
        if isinstance(entry.get("iteration"), int) and isinstance(getattr(loader, "iteration", None), int):
            loader.iteration = entry["iteration"]
        if entry.get("iterator"):
            self.lend(loader)

    def lend(self, loader: Any) -> None:
        """Until its iterator exists, `loader` (persistent) draws its workers' base seed from a throwaway generator."""
        if persistent_workers(loader) and not has_iterator(loader) and id(loader) not in self._lent:
            inner = getattr(loader, "base_dataloader", loader)  # accelerate's loaders wrap a torch DataLoader
            self._lent[id(loader)] = (loader, functools.partial(setattr, inner, "generator", inner.generator))
            inner.generator = torch.Generator()

    def settle(self) -> None:
        for key, (loader, put_back) in list(self._lent.items()):
            if has_iterator(loader):
                put_back()
                del self._lent[key]

    def give_back(self) -> None:
        """Every lent generator goes back; loaders not met yet stay due."""
        for _, put_back in self._lent.values():
            put_back()
        self._lent.clear()


class ResumableLoader:
    """Iterate the accelerator's prepared `dataloader` one epoch per `iter()`, tracking an exact position."""

    def __init__(self, accelerator: Any, dataloader: Any) -> None:
        self.accelerator, self.dataloader, self.epoch, self.batches_seen, self._skip = accelerator, dataloader, 0, 0, 0
        self._epoch_start_rngs: list[Any] = []  # empty: the epoch's iterator does not exist yet
        self._epoch_start_gen: str | None = None
        self._source: Any = None  # what the running epoch iterates (the loader, or its skipping copy)
        self._boundary: dict[str, Any] | None = None
        self._pending_rng: dict[str, Any] | None = None
        self.on_batch: Callable[[], None] | None = None  # with each batch handed out, once the resumed RNG is in
        self.seeds = LoaderSeeds()

    def other_loaders(self) -> dict[str, Any]:
        """The other loaders the accelerator prepared, named by their order of preparation."""
        others = [dl for dl in getattr(self.accelerator, "_dataloaders", None) or [] if dl is not self.dataloader]
        return {f"prepared-{i}": dl for i, dl in enumerate(others)}

    def __len__(self) -> int:
        return len(self.dataloader)

    def length(self) -> int | None:
        """`None` for an iterable dataset."""
        try:
            return len(self.dataloader)
        except TypeError:
            return None

    def position(self) -> dict[str, Any]:
        """JSON-able position now: epoch, batches handed out in it, the epoch-start RNG of every rank (before an
        epoch's iterator exists, or once its last batch is out: that (the next) epoch's start, the generator now)."""
        length, seen, src = self.length(), self.batches_seen, self._source  # complete: the epoch's last batch is out
        complete = seen > 0 and (getattr(src, "end_of_dataloader", False) or (length is not None and seen >= length))
        if self._epoch_start_rngs and not complete:  # (armed by `resume_from`: not complete)
            epoch, starts, gen = self.epoch, list(self._epoch_start_rngs), self._epoch_start_gen
        else:
            epoch = self.epoch + 1 if self._epoch_start_rngs else self.epoch
            seen, starts, gen = 0, [], _gen_b64(_generator(self.dataloader))
        geometry = self.geometry()
        return {"version": POSITION_VERSION, KEY_EPOCH: epoch, KEY_BATCHES_SEEN: seen,
                KEY_WORLD_SIZE: dist.world_size(), KEY_BATCH: geometry.to_json() if geometry is not None else None,
                KEY_DEALT: deals_batches(self.dataloader), KEY_EPOCH_START_GENERATOR: gen, KEY_EPOCH_START_RNG: starts,
                KEY_SKIP: self._skip, KEY_LOADERS: self.seeds.record(self.other_loaders())}

    def geometry(self) -> BatchGeometry | None:
        per_device = per_device_batch(self.dataloader)
        accumulation = int(getattr(self.accelerator, "gradient_accumulation_steps", 1) or 1)
        return None if per_device is None else BatchGeometry(per_device, dist.world_size(), accumulation)

    def mark_boundary(self) -> None:
        """Remember the position at an optimizer-step boundary: a pre-anomaly capture holds the last completed step
        while the loader has handed out the next step's batches."""
        self._boundary = self.position()

    def boundary_position(self) -> dict[str, Any]:
        return dict(self._boundary) if self._boundary is not None else self.position()

    def resume_from(self, position: dict[str, Any], *, rng: dict[str, Any] | None) -> None:
        """Arm the next `iter()` to continue exactly after `position` (what `position()` returned); `rng` (this
        rank's at the save) goes back once the resumed epoch's first batch is fetched."""
        try:
            epoch, seen = int(position[KEY_EPOCH]), int(position[KEY_BATCHES_SEEN])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"data position {position!r:.200} has no integer {KEY_EPOCH!r}/"
                                         f"{KEY_BATCHES_SEEN!r}; the sampler state of this checkpoint is corrupt.") \
                from e
        self.seeds.arm(position.get(KEY_LOADERS) if isinstance(position.get(KEY_LOADERS), dict) else None)
        for name, loader in self.other_loaders().items():  # prepared already: met now
            self.seeds.resume(name, loader)
        skip = position.get(KEY_SKIP)
        self._skip = skip if isinstance(skip, int) and skip > 0 else 0
        starts = list(position.get(KEY_EPOCH_START_RNG) or [])
        gen = position.get(KEY_EPOCH_START_GENERATOR)
        saved_world = position.get(KEY_WORLD_SIZE) if isinstance(position.get(KEY_WORLD_SIZE), int) else len(starts)
        seen = self._rescale(epoch, seen, position, saved_world=saved_world or dist.world_size())
        length = self.length()
        if starts and length is not None and seen >= length:  # the epoch was complete: the next one's start
            epoch, seen, starts, gen = epoch + 1, 0, [], None
        self.epoch, self.batches_seen, self._boundary, self._source = epoch, seen if starts else 0, None, None
        self._epoch_start_rngs, self._epoch_start_gen = starts, gen if starts else None
        self._pending_rng = rng if starts else None
        if not starts:  # saved before the epoch's iterator existed: the saved RNG is what creating it will draw from
            _set_gen(_generator(self.dataloader), gen)
            if rng is not None:
                restore_rng_state(rng)

    def _rescale(self, epoch: int, seen: int, position: dict[str, Any], *, saved_world: int) -> int:
        """`seen` (batches per rank of the saved run) on this run's geometry; rank 0 says what is not kept."""
        world, say = dist.world_size(), dist.rank() == 0
        saved, now = BatchGeometry.from_json(position.get(KEY_BATCH)), self.geometry()
        dealt = bool(position.get(KEY_DEALT, deals_batches(self.dataloader)))
        if saved_world != world and dealt and say:
            why = order_note(self.dataloader, saved_generator=position.get(KEY_EPOCH_START_GENERATOR) is not None)
            if why is not None:
                logger.warning("data position: saved by %d process(es), resumed by %d, and %s", saved_world, world,
                               why)
        if saved is None or now is None:
            if saved_world != world and say:
                logger.warning("data position: saved by %d process(es) without its batch geometry, resumed by %d: "
                               "each rank skips the %d batch(es) of epoch %d a rank had read, which is another "
                               "position in the epoch's order", saved_world, world, seen, epoch)
            return seen
        if (saved.per_device, saved.world_size) == (now.per_device, now.world_size):
            return seen
        batches, repeated = rescale_batches_seen(seen, saved, now, dealt=dealt)
        if say:
            width = now.per_device * (now.world_size if dealt else 1)
            logger.info("data position: %d batch(es) per rank of %s = sample %d of epoch %d's order; resumed as %d "
                        "batch(es) per rank of %s", seen, saved.describe(), batches * width + repeated, epoch,
                        batches, now.describe())
            if repeated:
                logger.warning("data position: sample %d of epoch %d's order is not a whole batch of %d sample(s) "
                               "on %d process(es) x %d per device: the resumed run reads the last %d sample(s) "
                               "before it again", batches * width + repeated, epoch, width, now.world_size,
                               now.per_device, repeated)
        return batches

    def after_rollback(self, *, rng: dict[str, Any] | None, skip: int = 0) -> None:
        """A rollback without rewinding the data: `rng` goes back once the next batch is fetched, `skip` more
        batches are left out."""
        self._pending_rng = rng
        self._skip += max(0, int(skip))

    def __iter__(self) -> Iterator[Any]:
        dl = self.dataloader
        if hasattr(dl, "set_epoch"):
            dl.set_epoch(self.epoch)
        resuming, gen = self._source is None and bool(self._epoch_start_rngs), _generator(dl)  # armed by `resume_from`
        if self.epoch > 0:  # the uninterrupted run created its iterator in epoch 0 (a skipping copy takes the lent one)
            self.seeds.lend(dl)
        if resuming:
            restore_rank_rng(self._epoch_start_rngs)
            _set_gen(gen, self._epoch_start_gen)
            self._source = self.accelerator.skip_first_batches(dl, self.batches_seen) if self.batches_seen else dl
            # At an optimizer-step boundary the accelerator's micro-batch count starts an accumulation window, as in a
            # new process (`load_state` puts back the saved run's, not a multiple of another accumulation).
            self.accelerator.step = 0
            logger.debug("resuming epoch %d after %d batches", self.epoch, self.batches_seen)
        else:
            self._epoch_start_rngs, self._epoch_start_gen = rank_rngs(), _gen_b64(gen)
            self._source, self.batches_seen = dl, 0
        it = iter(self._source)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            finally:
                self.seeds.settle()  # an iterator created since (this one, an eval loader's) gives its seed back
                if self._pending_rng is not None:
                    restore_rng_state(self._pending_rng)
                    self._pending_rng = None
            self.batches_seen += 1
            if self._skip:
                self._skip -= 1  # a batch after a rollback that `rollback_skip_batches` leaves out
                continue
            if self.on_batch is not None:
                self.on_batch()
            yield batch
        self.epoch, self.batches_seen, self._epoch_start_rngs, self._epoch_start_gen, self._source = \
            self.epoch + 1, 0, [], None, None
        if hasattr(dl, "set_epoch"):
            dl.set_epoch(self.epoch)
