"""Object-store roots (``s3://``, ``gs://``, ``az://``, ``file://``, ...) through fsspec: the remote seam.

A store whose root is a URL keeps a local cache directory that is an ordinary store (the
background writer writes there first, as for a local root); `remote_sync` uploads each
checkpoint's files and then its manifest LAST, so a checkpoint exists on the object store
iff its ``manifest.json`` exists there (S3 has no rename: an object appears whole when its
PUT completes, a multipart upload cut short leaves no object).

This module holds what touches the object store itself:

- `RemoteSpec`: the URL, fsspec ``storage_options`` (never logged: `repr` hides them),
  bounded retry with exponential backoff, and the local cache directory.
- `Remote`: object-level operations on ``<url>/<task>/...`` keys. Every key is built
  from plain names (no ``/``, ``.`` or ``..``) and every deletion proves it stays under the
  task's prefix, so nothing outside the root is ever removed. Every call is retried on
  transient errors (not on a missing object or a permission error).
- `redact`: the only form in which a URL reaches a message or a log line (user info and
  query strings, where signed URLs and SAS tokens live, are replaced by ``***``).

Credentials come from the usual fsspec/boto/gcloud/azure configuration (environment,
``~/.aws``, instance roles); they never enter a manifest, a spec's repr or a log.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import re
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..errors import ConfigError, DynamicCkptError

logger = logging.getLogger(__name__)

T = TypeVar("T")

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
SECRET_WORDS = ("key", "secret", "token", "password", "credential", "sas", "signature", "session")
"""Substrings of storage-option names a config file may not carry (credentials stay in the usual places)."""
CACHE_ENV = "HF_DYNAMIC_CKPT_CACHE"


class RemoteStorageError(DynamicCkptError, OSError):
    """An object-store operation failed after its retries (the message names the redacted URL)."""


def is_url(root: object) -> bool:
    """Whether a store root is a URL (``scheme://...``) rather than a local directory."""
    return isinstance(root, str) and bool(_URL_RE.match(root))


def redact(url: str) -> str:
    """`url` without user info, password or query string (``s3://bucket/run``, ``https://***@host/x?***``)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if "@" not in netloc and not parts.query and not parts.fragment:
        return url
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", ""))


def check_url(url: str) -> str:
    """Validate a root URL's scheme against fsspec's registry; returns the protocol.

    Raises:
        `ConfigError`: the scheme is not an fsspec protocol, or the URL names no bucket/path.
    """

    protocol = url.split("://", 1)[0].lower()
    from fsspec.registry import known_implementations, registry

    known = set(known_implementations) | set(registry)
    if protocol not in known:
        raise ConfigError(f"root={redact(url)!r} is invalid: {protocol!r} is not an fsspec protocol; use s3://, gs://, "
                          "az://, file:// (or another fsspec URL), or a local directory.")
    if not url.split("://", 1)[1].strip("/"):
        raise ConfigError(f"root={redact(url)!r} is invalid: name a bucket or container (e.g. s3://my-bucket/run1).")
    return protocol


def check_public_options(options: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    """Storage options from a config file: plain settings only, never credentials.

    Raises:
        `ConfigError`: an option name looks like a credential (it would be stored with the config).
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{name} must be a mapping such as {{endpoint_url: http://127.0.0.1:9000}}; got a "
                          f"{type(options).__name__}.")

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                if any(w in str(k).lower() for w in SECRET_WORDS):
                    raise ConfigError(f"{name}: {path}{k} looks like a credential; credentials never go in the "
                                      "config (it is logged and saved): use the environment (AWS_ACCESS_KEY_ID, ...), "
                                      "~/.aws, an instance role, or pass storage_options to CheckpointStore in code.")
                walk(v, f"{path}{k}.")

    walk(options, "")
    return dict(options)


def default_cache_dir(url: str, rank: int) -> Path:
    """``$HF_DYNAMIC_CKPT_CACHE`` (else ``~/.cache/hf_dynamic_ckpt``) ``/remote/<hash of the URL>/rank-<R>``."""
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "hf_dynamic_ckpt")
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return Path(base) / "remote" / digest / f"rank-{int(rank)}"


@dataclass(frozen=True)
class RemoteSpec:
    """Where a store's objects live and how calls to them are retried.

    Args:
        url (`str`): the store root URL (``s3://bucket/prefix``).
        storage_options (`Mapping`, *optional*): passed to fsspec (``endpoint_url``, ``client_kwargs``,
            ``profile``, ...). Hidden from `repr` and never logged.
        retries (`int`, *optional*, defaults to `5`): retries of one failed call (0: none).
        backoff_s (`float`, *optional*, defaults to `0.5`): first backoff; doubles per retry, with jitter.
        backoff_max_s (`float`, *optional*, defaults to `10.0`): cap of one backoff.
    """

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    retries: int = 5
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage_options", dict(self.storage_options or {}))
        if int(self.retries) < 0 or float(self.backoff_s) < 0:
            raise ConfigError(f"retries={self.retries} / backoff_s={self.backoff_s} are invalid: both must be >= 0.")

    def __repr__(self) -> str:
        return f"RemoteSpec(url={redact(self.url)!r}, retries={self.retries}, backoff_s={self.backoff_s})"

    @property
    def shown(self) -> str:
        return redact(self.url)


def _plain(name: str) -> str:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
        raise RemoteStorageError(f"{str(name)[:80]!r} is not a plain name; the store only builds keys from plain "
                                 "names.")
    return name


_NO_RETRY = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, RemoteStorageError,
             TypeError, ValueError, AttributeError, NotImplementedError)  # not transient: a retry cannot help


class Remote:
    """Object-level access to ``<url>/<task_id>/...`` with retries and containment.

    Args:
        spec (`RemoteSpec`): the URL, options and retry settings.
        task_id (`str`): the task's prefix under the URL.
        fs (*optional*): an fsspec filesystem to use instead of the one the URL names (tests).
    """

    def __init__(self, spec: RemoteSpec, task_id: str, *, fs: Any = None) -> None:
        import fsspec

        self.spec = spec
        try:
            url_fs, path = fsspec.core.url_to_fs(spec.url, **dict(spec.storage_options))
        except ImportError as e:
            raise ConfigError(f"root={spec.shown!r} needs an fsspec backend that is not installed ({e}); for s3:// "
                              "install `hf_dynamic_ckpt[s3]` (s3fs), for gs:// gcsfs, for az:// adlfs.") from None
        self.fs = fs if fs is not None else url_fs
        self.base = str(path).rstrip("/")
        self.task_id = _plain(task_id)
        self.prefix = f"{self.base}/{self.task_id}"
        self.calls = 0
        self.retried = 0
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple | list) else (self.fs.protocol,)
        self._needs_dirs = bool({"file", "local"} & set(protocols))  # a filesystem, not an object store

    # -- keys -----------------------------------------------------------------------------
    def key(self, *names: str) -> str:
        """``<prefix>/<name>/...`` from plain names."""
        return "/".join([self.prefix, *(_plain(n) for n in names)])

    def _inside(self, key: str) -> str:
        if not key.startswith(self.prefix + "/") or "/../" in key or key.endswith("/.."):
            raise RemoteStorageError(f"refusing to delete {key!r}: outside the task prefix {self.prefix!r}.")
        return key

    # -- retry ----------------------------------------------------------------------------
    def _scrub(self, text: str) -> str:
        text = text.replace(self.spec.url, self.spec.shown)
        for v in self.spec.storage_options.values():
            if isinstance(v, str) and len(v) >= 8 and not v.startswith(("http://", "https://")):
                text = text.replace(v, "***")
        return text

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn`, retrying transient errors with exponential backoff (bounded by `spec.retries`).

        Raises:
            `FileNotFoundError` / `PermissionError`: at once (not transient).
            `RemoteStorageError`: still failing after the last retry.
        """
        delay = float(self.spec.backoff_s)
        for attempt in range(int(self.spec.retries) + 1):
            self.calls += 1
            try:
                return fn()
            except _NO_RETRY:
                raise
            except Exception as e:  # botocore/aiohttp/gcsfs raise many kinds for one transient fault
                msg = self._scrub(f"{type(e).__name__}: {e}")
                if attempt >= int(self.spec.retries):
                    raise RemoteStorageError(f"{what} on {self.spec.shown} failed after {attempt + 1} attempt(s): "
                                             f"{msg}") from None
                self.retried += 1
                pause = min(delay, float(self.spec.backoff_max_s)) * random.uniform(0.5, 1.0)
                logger.debug("%s on %s failed (%s); retry %d/%d in %.2f s", what, self.spec.shown, msg, attempt + 1,
                             self.spec.retries, pause)
                time.sleep(pause)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    # -- operations -----------------------------------------------------------------------
    def invalidate(self) -> None:
        """Forget cached listings (s3fs caches them; other ranks and processes change the bucket)."""
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate()

    def _parent(self, key: str) -> None:
        if self._needs_dirs:
            self.fs.makedirs(key.rsplit("/", 1)[0], exist_ok=True)

    def put(self, local: str | os.PathLike[str], key: str) -> None:
        self._parent(key)
        self.call(f"uploading {key.rsplit('/', 2)[-2:]}", lambda: self.fs.put_file(os.fspath(local), key))

    def put_bytes(self, data: bytes, key: str) -> None:
        self._parent(key)
        self.call(f"writing {key.rsplit('/', 2)[-2:]}", lambda: self.fs.pipe_file(key, data))

    def get(self, key: str, local: str | os.PathLike[str]) -> None:
        self.call(f"downloading {key.rsplit('/', 2)[-2:]}", lambda: self.fs.get_file(key, os.fspath(local)))

    def size(self, key: str) -> int | None:
        """The object's size, `None` when it does not exist."""
        try:
            info = self.call(f"stat {key.rsplit('/', 2)[-2:]}", lambda: self.fs.info(key))
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    def read(self, key: str, *, limit: int) -> bytes | None:
        """The bytes of a small object (at most `limit`), `None` when it does not exist."""
        size = self.size(key)
        if size is None:
            return None
        if size > limit:
            raise RemoteStorageError(f"{key} has {size} bytes, more than the {limit} an object of this kind may have.")
        try:
            return self.call(f"reading {key.rsplit('/', 2)[-2:]}", lambda: self.fs.cat_file(key))
        except FileNotFoundError:
            return None

    def names(self, *under: str) -> list[str]:
        """Plain names directly under ``<prefix>/<under...>`` (files and 'directories'), sorted."""
        path = self.key(*under) if under else self.prefix
        try:
            entries = self.call(f"listing {path.rsplit('/', 1)[-1]}", lambda: self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []
        out = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}
        return sorted(n for n in out if n and n not in (".", ".."))

    def tasks(self) -> list[str]:
        """Task prefixes directly under the URL."""
        try:
            entries = self.call("listing tasks", lambda: self.fs.ls(self.base, detail=False))
        except FileNotFoundError:
            return []
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries} - {"", ".", ".."})

    def remove(self, key: str) -> None:
        """Delete one object under the task prefix (missing is fine)."""
        key = self._inside(key)
        with contextlib.suppress(FileNotFoundError):
            self.call(f"deleting {key.rsplit('/', 2)[-2:]}", lambda: self.fs.rm_file(key))

    def remove_tree(self, *names: str) -> None:
        """Delete every object under ``<prefix>/<names...>/`` (never the task prefix itself)."""
        if not names:
            raise RemoteStorageError("refusing to delete the whole task prefix.")
        key = self._inside(self.key(*names))
        for name in self.names(*names):
            sub = f"{key}/{name}"
            if self.size(sub) is None:
                self.remove_tree(*names, name)
            else:
                self.remove(sub)
        rmdir = getattr(self.fs, "rmdir", None)  # local/memory filesystems keep empty directories
        if rmdir is not None:
            with contextlib.suppress(Exception):  # object stores have no directories to remove
                rmdir(key)


def split_root(root: str | os.PathLike[str], *, rank: int, storage_options: Mapping[str, Any] | None = None,
               cache_dir: str | os.PathLike[str] | None = None, retries: int = 5,
               backoff_s: float = 0.5) -> tuple[str | os.PathLike[str], RemoteSpec | None]:
    """A store root as (local directory, remote spec): a URL maps to its cache directory and a `RemoteSpec`."""
    if not is_url(root):
        if storage_options:
            raise ConfigError(f"storage_options are for URL roots (s3://...); root={root!r} is a local directory.")
        return root, None
    url = str(root)
    check_url(url)
    spec = RemoteSpec(url, storage_options or {}, retries=retries, backoff_s=backoff_s)
    return (cache_dir if cache_dir is not None else default_cache_dir(url, rank)), spec
