"""Object-store roots (``s3://``, ``gs://``, ``az://``, ``file://``, ...) through fsspec: a local cache directory with
the ordinary layout plus its copy under ``<url>/<task>/`` (docs/storage.md). A checkpoint exists there iff its manifest
does: uploaded last, removed first. Keys are built from plain names under the task's prefix; credentials never enter a
message, a log line, a spec's repr or a config file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..constants import BLOBS_DIR, KEY_BLOBS, MANIFEST_NAME, PINNED_MARKER, TMP_MARKER, WRITER_LOCK_NAME
from ..errors import ConfigError, DynamicCkptError, fault
from ..jsonutil import loads_bounded
from .manifest import GcReport, is_kind, is_url, parse_step_dir

logger = logging.getLogger(__name__)
T = TypeVar("T")
CACHE_ENV = "HF_DYNAMIC_CKPT_CACHE"
SECRET_WORDS = ("key", "secret", "token", "password", "credential", "sas", "signature", "session")
"""Substrings of storage-option names a config file may not carry."""
_NO_RETRY = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, TypeError, ValueError,
             AttributeError, NotImplementedError, DynamicCkptError)  # a retry cannot help


class RemoteStorageError(DynamicCkptError, OSError):
    """An object-store operation failed after its retries (the message names the redacted URL)."""


def redact(url: str) -> str:
    """`url` without user info and query string (``https://***@host/x?***``): the only form a message shows."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc and not parts.query:
        return url
    netloc = f"***@{parts.netloc.rsplit('@', 1)[1]}" if "@" in parts.netloc else parts.netloc
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", ""))


def check_url(url: str) -> str:
    """The protocol of a root URL; `ConfigError` when fsspec does not know it or the URL names no bucket."""
    from fsspec.registry import known_implementations, registry

    protocol = url.split("://", 1)[0].lower()
    if protocol not in set(known_implementations) | set(registry):
        raise ConfigError(f"root={redact(url)!r} is invalid: {protocol!r} is not an fsspec protocol; use s3://, gs://, "
                          "az://, file:// (or another fsspec URL), or a local directory.")
    if not url.split("://", 1)[1].strip("/"):
        raise ConfigError(f"root={redact(url)!r} is invalid: name a bucket or container (e.g. s3://my-bucket/run1).")
    return protocol


def check_public_options(options: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    """Storage options from a config file: plain settings only; a credential-like name is a `ConfigError`."""
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"{name} must be a mapping such as {{endpoint_url: http://127.0.0.1:9000}}; got a "
                          f"{type(options).__name__}.")

    def walk(obj: Any, path: str) -> None:
        for k, v in obj.items() if isinstance(obj, Mapping) else ():
            if any(w in str(k).lower() for w in SECRET_WORDS):
                raise ConfigError(f"{name}: {path}{k} looks like a credential; credentials never go in the config "
                                  "(it is logged and saved): use the environment (AWS_ACCESS_KEY_ID, ...), ~/.aws, an "
                                  "instance role, or pass storage_options to CheckpointStore in code.")
            walk(v, f"{path}{k}.")

    walk(options or {}, "")
    return dict(options or {})


def default_cache_dir(url: str, rank: int) -> Path:
    """``$HF_DYNAMIC_CKPT_CACHE`` (else ``~/.cache/hf_dynamic_ckpt``) ``/remote/<hash of the URL>/rank-<R>``."""
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "hf_dynamic_ckpt")
    return Path(base) / "remote" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16] / f"rank-{int(rank)}"


@dataclass(frozen=True)
class RemoteSpec:
    """Where a store's objects live (the root URL, fsspec `storage_options`, never shown) and how a failed call is
    retried: `retries` times, the first pause `backoff_s`, doubling (with jitter), at most 10 s."""

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, compare=False)
    retries: int = 5
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage_options", dict(self.storage_options or {}))
        if int(self.retries) < 0 or float(self.backoff_s) < 0:
            raise ConfigError(f"retries={self.retries} / backoff_s={self.backoff_s} are invalid: both must be >= 0.")

    def __repr__(self) -> str:
        return f"RemoteSpec(url={self.shown!r}, retries={self.retries}, backoff_s={self.backoff_s})"

    @property
    def shown(self) -> str:
        return redact(self.url)


def split_root(root: str | os.PathLike[str], *, rank: int, storage_options: Mapping[str, Any] | None = None,
               cache_dir: str | os.PathLike[str] | None = None, retries: int = 5,
               backoff_s: float = 0.5) -> tuple[str | os.PathLike[str], RemoteSpec | None]:
    """A store root as (local directory, `RemoteSpec` or `None`): a URL maps to its cache directory."""
    if not is_url(root):
        return root, None
    check_url(str(root))
    spec = RemoteSpec(str(root), storage_options or {}, retries=retries, backoff_s=backoff_s)
    return (cache_dir if cache_dir is not None else default_cache_dir(str(root), rank)), spec


class Remote:
    """The objects of one task, ``<url>/<task_id>/<names...>``: retried calls, keys from plain names only."""

    def __init__(self, spec: RemoteSpec, task_id: str) -> None:
        import fsspec

        try:
            self.fs, path = fsspec.core.url_to_fs(spec.url, **dict(spec.storage_options))
        except ImportError as e:
            raise ConfigError(f"root={spec.shown!r} needs an fsspec backend that is not installed ({e}); for s3:// "
                              "install `hf_dynamic_ckpt[s3]` (s3fs), for gs:// gcsfs, for az:// adlfs.") from None
        self.spec, self.retried, self.task_id = spec, 0, task_id
        self.prefix = f"{str(path).rstrip('/')}/{self.key_name(task_id)}"
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple | list) else (self.fs.protocol,)
        self._dirs = bool({"file", "local"} & set(protocols))  # a file system, not an object store: make parents

    @staticmethod
    def key_name(name: str) -> str:
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise RemoteStorageError(f"{str(name)[:80]!r} is not a plain name; the store only builds keys from plain "
                                     "names.")
        return name

    def call(self, op: str, names: tuple[str, ...], fn: Callable[[str], T]) -> T:
        """`fn(key)` of ``<prefix>/<names...>``, retried with exponential backoff on transient errors (`fault` point
        ``remote``: `op`, `name`, `attempt`); `FileNotFoundError` and the like at once, `RemoteStorageError` after the
        last retry."""
        key, delay = "/".join([self.prefix, *map(self.key_name, names)]), float(self.spec.backoff_s)
        for attempt in range(1, int(self.spec.retries) + 2):
            try:
                fault("remote", op=op, name="/".join(names), attempt=attempt)
                return fn(key)
            except _NO_RETRY:
                raise
            except Exception as e:  # botocore/aiohttp/gcsfs raise many kinds for one transient fault
                msg = f"{type(e).__name__}: {e}".replace(self.spec.url, self.spec.shown)
                for v in self.spec.storage_options.values():
                    msg = msg.replace(v, "***") if isinstance(v, str) and len(v) >= 8 and "://" not in v else msg
                if attempt > int(self.spec.retries):
                    raise RemoteStorageError(f"{op} {'/'.join(names)} on {self.spec.shown} failed after {attempt} "
                                             f"attempt(s): {msg}") from None
                self.retried += 1
                pause = min(delay, 10.0) * random.uniform(0.5, 1.0)
                logger.debug("%s on %s failed (%s); retry %d/%d in %.2f s", op, self.spec.shown, msg, attempt,
                             self.spec.retries, pause)
                time.sleep(pause)
                delay *= 2
        raise AssertionError("unreachable")

    def put(self, data: bytes | Path, *names: str) -> None:
        """Upload a local file, or `data`, as ``<names...>``."""
        def put(key: str) -> None:
            if self._dirs:
                self.fs.makedirs(key.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(os.fspath(data), key) if isinstance(data, Path) else self.fs.pipe_file(key, data)

        self.call("put", names, put)

    def get(self, local: Path, *names: str) -> None:
        self.call("get", names, lambda key: self.fs.get_file(key, os.fspath(local)))

    def size(self, *names: str) -> int | None:
        """The object's size, `None` when there is none."""
        with contextlib.suppress(FileNotFoundError):
            info = self.call("stat", names, self.fs.info)
            return None if info.get("type") == "directory" else int(info.get("size") or 0)
        return None

    def read(self, *names: str, limit: int = 64 << 20) -> bytes | None:
        """A small object's bytes (at most `limit`), `None` when there is none."""
        size = self.size(*names)
        if size is not None and size > limit:
            raise RemoteStorageError(f"{'/'.join(names)} has {size} bytes, more than the {limit} it may have.")
        with contextlib.suppress(FileNotFoundError):
            return None if size is None else self.call("read", names, self.fs.cat_file)
        return None

    def names(self, *under: str) -> list[str]:
        """Plain names directly under ``<names...>``, sorted."""
        with contextlib.suppress(FileNotFoundError):
            entries = self.call("list", under, lambda key: self.fs.ls(key, detail=False))
            return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries} - {"", ".", ".."})
        return []

    def invalidate(self) -> None:  # other ranks and processes change the bucket
        self.fs.invalidate_cache()

    def remove(self, *names: str) -> None:
        """Delete ``<names...>`` and everything under it (never the task prefix itself; missing is fine)."""
        if not names:
            raise RemoteStorageError("refusing to delete the whole task prefix.")
        for name in self.names(*names) if self.size(*names) is None else []:
            self.remove(*names, name)
        with contextlib.suppress(FileNotFoundError):
            self.call("rm", names, lambda key: self.fs.rm_file(key) if self.fs.isfile(key) else self.fs.rmdir(key))

    def manifests(self) -> dict[str, bytes]:
        """Manifest bytes of every committed ``step-<N>`` of the task, by directory name (partial uploads have none)."""
        self.invalidate()
        found = {n: self.read(n, MANIFEST_NAME) for n in self.names() if n.startswith("step-") and TMP_MARKER not in n}
        return {n: data for n, data in found.items() if data is not None}

    def publish(self, directory: Path, name: str, files: list[str], *, replacing: bool) -> None:
        """Upload ``directory``'s `files` as ``<name>/``, its manifest last (the commit point); a copy it replaces
        stops being a checkpoint first (its manifest goes), its other objects after."""
        if replacing:
            self.remove(name, MANIFEST_NAME)
        for fname in files:
            self.put(directory / fname, name, fname)
        self.put(directory / MANIFEST_NAME, name, MANIFEST_NAME)
        for stale in set(self.names(name)) - {*files, MANIFEST_NAME, PINNED_MARKER} if replacing else ():
            self.remove(name, stale)

    def mirror(self, local: Path, files: Iterable[str]) -> None:
        """Make the bucket's copy of a committed directory follow the cache's after a tier delete, pin or unpin: its
        manifest, pin marker, and no file the manifest does not list."""
        keep = {*files, MANIFEST_NAME}
        self.put(local / MANIFEST_NAME, local.name, MANIFEST_NAME)
        if is_kind(local / PINNED_MARKER, "file"):
            self.put(b"", local.name, PINNED_MARKER)
            keep.add(PINNED_MARKER)
        for stale in set(self.names(local.name)) - keep:
            self.remove(local.name, stale)

    def note_writer(self, session: str) -> None:
        """Record `session` as the task's writer, warning when another one wrote last (object stores offer no lock:
        the note only makes a second writer visible)."""
        with contextlib.suppress(ValueError, OSError):
            old = loads_bounded(self.read(WRITER_LOCK_NAME, limit=4096) or b"null")
            if isinstance(old, dict) and old.get("session") != session:
                logger.warning("%s/%s: session %s on %s (pid %s) wrote here last, since %s; object stores have no "
                               "lock, so make sure it has stopped: two writers on one task interleave their "
                               "checkpoints", self.spec.shown, self.task_id, old.get("session"), old.get("host"),
                               old.get("pid"), old.get("since"))
        self.put(json.dumps({"session": session, "host": os.uname().nodename, "pid": os.getpid(),
                             "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode(), WRITER_LOCK_NAME)

    def leftovers(self, session: str, *, dry_run: bool, at_open: bool, kept: list[str] | None = None) -> list[str]:
        """Remove other sessions' ``step-<N>.tmp-*`` prefixes, and ``step-<N>/`` prefixes without a manifest (partial
        uploads): all of them at the writer's open, else only those at or below the newest committed step; returns
        them (`dry_run`: only that)."""
        self.invalidate()
        committed = {parse_step_dir(n) for n in self.manifests()}
        top, removed = max((s for s in committed if s is not None), default=-1), []
        for n in self.names():
            partial = (step := parse_step_dir(n)) is not None and step not in committed
            if partial and not at_open and step > top:  # type: ignore[operator]
                (kept if kept is not None else []).append(
                    f"remote:{n} kept: an upload without a manifest above the newest checkpoint (a save may be in "
                    "flight); the writer's next open removes it if it was interrupted")
            elif partial or (TMP_MARKER in n and parse_step_dir(n.split(TMP_MARKER)[0]) is not None
                             and f"{TMP_MARKER}{session}" not in n):
                removed.append(f"remote:{n}")
                self.remove(n) if not dry_run else None
        return removed

    def collect_blobs(self, report: GcReport) -> None:
        """Remove the blobs of an earlier version no manifest in the bucket references (`report.dry_run`: list them)."""
        used = set()
        for name, data in self.manifests().items():
            try:
                used |= {str(b.get("digest")) for b in (loads_bounded(data).get(KEY_BLOBS) or {}).values()}
            except (ValueError, AttributeError):
                return report.kept.append(f"remote blobs: not collected, the manifest of {name} is unreadable")
        for n in self.names(BLOBS_DIR):
            if n.split(".")[0] not in used:
                report.blobs.append(f"remote:{n}")
                report.bytes_freed += self.size(BLOBS_DIR, n) or 0
                self.remove(BLOBS_DIR, n) if not report.dry_run else None
