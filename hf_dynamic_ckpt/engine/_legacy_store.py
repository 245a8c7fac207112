"""TRANSITION ONLY - remove this module when the store branch (issue 9 store part) is merged.

The one place where the engine adapts to a `CheckpointStore` that predates the round-2
store contract (keyword `save`, no `spec`/`from_spec`, no `CheckpointInfo.blobs`, no
`cancel`), and to callers that still use the keyword form of `SaveEngine.save`. With the
new store every function here reduces to its first branch; at merge:

- `store_save(store, ...)` -> `store.save(state, request, timings=timings, cancel=cancel)`;
- `store_spec(store)` -> `store.spec`; `open_store(cls, spec)` -> `cls.from_spec(spec, cleanup=False)`;
- `blob_exists(store, ref)` -> the BlobStore's existence check;
- `LegacyRequest` / `resolve_request` go together with `SaveEngine.save(**legacy)`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any, cast

from ..constants import ALL_TIERS, KEY_BLOBS
from ..store.spec import Codec, SaveRequest, StoreSpec
from ..store.types import BlobRef, CheckpointInfo, CheckpointState

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LegacyRequest(SaveRequest):
    """A `SaveRequest` plus the old store's `replace=` flag (the new store decides replacement itself)."""

    replace: bool = False


_LEGACY_KEYWORDS = frozenset({"step", "epoch", "tiers", "reason", "pinned", "healthy", "signals", "debug_info",
                              "replace"})


def resolve_request(request: SaveRequest | None, keywords: Mapping[str, Any]) -> SaveRequest:
    """`request`, or the request of a call in the old keyword form `save(sources, step=..., reason=..., ...)`."""
    if request is not None:
        if keywords:
            raise TypeError(f"pass either a SaveRequest or keywords, not both (got {sorted(keywords)}).")
        return request
    unknown = set(keywords) - _LEGACY_KEYWORDS
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}: pass a SaveRequest instead.")
    if "step" not in keywords or "reason" not in keywords:
        raise TypeError("save() needs a SaveRequest (or, in the old form, step= and reason=).")
    kw = dict(keywords)
    kw["tiers"] = kw.get("tiers") if kw.get("tiers") is not None else ALL_TIERS
    kw["debug_info"] = tuple(kw.get("debug_info") or ())
    return LegacyRequest(**kw)


@functools.cache
def _save_parameters(store_cls: Any) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(store_cls.save).parameters)
    except (AttributeError, TypeError, ValueError):
        return frozenset()


def store_save(store: Any, state: CheckpointState, request: SaveRequest, *, timings: Mapping[str, Any],
               cancel: Callable[[], bool]) -> CheckpointInfo | None:
    """`store.save` in whichever form the store's class takes (decided by its signature, not the instance's,
    so test wrappers `store.save = f(*a, **k)` keep working)."""
    params = _save_parameters(cast(Hashable, type(store)))
    if "request" in params:
        extra: dict[str, Any] = {"cancel": cancel} if "cancel" in params else {}
        return store.save(state, request, timings=timings, **extra)  # type: ignore[no-any-return]
    info = store.save(state, reason=request.reason, pinned=request.pinned, healthy=request.healthy,
                      signals=dict(request.signals) if request.signals is not None else None,
                      debug_info=list(request.debug_info), timings=timings,
                      replace=bool(getattr(request, "replace", False)))
    if info is not None and not info.blobs and state.dedup_keys:
        info = _with_blob_table(info)
    return info  # type: ignore[no-any-return]


def _with_blob_table(info: CheckpointInfo) -> CheckpointInfo:
    """`info` with the manifest's blob table, as the new store fills it (the old one does not)."""
    from ..store.manifest import read_manifest

    try:
        blobs = read_manifest(Path(info.path)).get(KEY_BLOBS) or {}
    except Exception as e:  # the checkpoint is committed; only the dedup shortcut is lost
        logger.warning("could not read the blob table of step %d (%s): frozen weights will be written again",
                       info.step, e)
        return info
    return dataclasses.replace(info, blobs=blobs)


def store_spec(store: Any) -> StoreSpec:
    """`store.spec`, or the same spec read from an old store's attributes."""
    spec = getattr(store, "spec", None)
    if isinstance(spec, StoreSpec):
        return spec
    return StoreSpec(root=str(store.root), task_id=store.task_id, rank=store.rank, world_size=store.world_size,
                     session_id=store.session_id, codec=Codec.parse(getattr(store, "compression", "zstd"), field="compression"),
                     compression_level=store.compression_level, compression_threads=store.compression_threads,
                     rank_timeout_s=store.rank_timeout_s)


def open_store(store_cls: type, spec: StoreSpec) -> Any:
    """The writer process's store: `store_cls.from_spec(spec, cleanup=False)` (or the old constructor)."""
    from_spec = getattr(store_cls, "from_spec", None)
    if from_spec is not None:
        return from_spec(spec, cleanup=False)
    return store_cls(spec.root, task_id=spec.task_id, rank=spec.rank, world_size=spec.world_size,
                     session_id=spec.session_id, compression_level=spec.compression_level,
                     compression_threads=spec.compression_threads, compression=spec.codec.value,
                     rank_timeout_s=spec.rank_timeout_s, cleanup=False)


def blob_exists(store: Any, ref: BlobRef) -> bool:
    """Whether the blob `ref` names is still on disk (a later save may refer to it instead of writing it)."""
    blobs = getattr(store, "blobs", None)
    if blobs is not None and hasattr(blobs, "exists"):
        return bool(blobs.exists(ref.digest))
    blobs_dir = getattr(store, "blobs_dir", None)
    if blobs_dir is None:
        return True
    from ..store.weights import blob_path

    return blob_path(Path(blobs_dir), ref.digest).exists()
