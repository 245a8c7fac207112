"""Shared-memory storage allocated without holding the GIL: `new_shared_storage`.

`torch.UntypedStorage._new_shared(n)` reserves the pages of a new shared-memory file with
`posix_fallocate` (so that running out of `/dev/shm` is an error, not a SIGBUS on first
touch) while it holds the GIL: allocating the ~700 MiB of snapshot buffers of a 60M-parameter
full fine-tune in the background stalled the training thread for as long (0.1-0.6 s,
measured on `Thread.start` during a resume). Here the file is created, sized and reserved
through `os` calls, which release the GIL, and torch only maps the finished file
(`_new_shared_fd_cpu`, what a storage received from another process uses). The result is a
torch shared storage like `_new_shared`'s: it travels to the writer process by its file
descriptor, and its memory is freed with the storage (the file is unlinked at once).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets

import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_counter = itertools.count()


def new_shared_storage(nbytes: int, *, directory: str = SHM_DIR) -> torch.UntypedStorage | None:
    """A shared-memory storage of `nbytes` bytes whose pages are reserved (zero-filled).

    Args:
        nbytes (`int`): size in bytes (> 0).
        directory (`str`, *optional*, defaults to `"/dev/shm"`): the tmpfs the file lives in.

    Returns:
        `torch.UntypedStorage | None`: the storage, or `None` where this platform lacks what
        it needs (no `directory`, no `posix_fallocate`, an older torch) or the memory cannot be
        reserved (e.g. `ENOSPC`: `directory` is too small): the caller then uses
        `torch.UntypedStorage._new_shared`, which raises its usual error for the latter.
    """
    fallocate = getattr(os, "posix_fallocate", None)
    from_fd = getattr(torch.UntypedStorage, "_new_shared_fd_cpu", None)
    if nbytes <= 0 or fallocate is None or from_fd is None or not os.path.isdir(directory):
        return None
    path = os.path.join(directory, f"hf-dynamic-ckpt-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as e:
        logger.debug("shared memory in %s not available (%s); using torch's allocator", directory, e)
        return None
    try:
        os.unlink(path)  # nothing to clean up after a crash: the memory lives as long as a mapping does
        os.ftruncate(fd, nbytes)
        fallocate(fd, 0, nbytes)
        storage: torch.UntypedStorage = from_fd(fd, nbytes)  # maps it (its own duplicate of the descriptor)
    except (OSError, RuntimeError) as e:
        logger.debug("could not reserve %d bytes of shared memory in %s (%s); using torch's allocator", nbytes,
                     directory, e)
        return None
    finally:
        os.close(fd)
    return storage
