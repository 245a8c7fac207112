"""A real memory cgroup (v2 or v1, whichever the machine mounts) to run a command under a limit.

Used by `test_memory_limit.py` and `scripts/bench_memory.py`; needs root (or a delegated
cgroup). The command joins the cgroup before `exec` (`echo $$ > cgroup.procs`), so every
process it starts (the checkpoint writer process too) is charged to it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from hf_dynamic_ckpt import sysmem


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be created here (not root, no memory controller, read-only mount)."""


class MemoryCgroup:
    """A fresh memory cgroup below this process's own (or at the mount root), removed by `close`.

    Args:
        name (`str`): directory name; the pid is appended so concurrent runs do not collide.

    Raises:
        `CgroupUnavailable`: none could be created, with what was tried.
    """

    def __init__(self, name: str) -> None:
        own = sysmem.find_memory_cgroup()
        if own is None:
            raise CgroupUnavailable("no memory cgroup is mounted (/proc/self/cgroup + /proc/self/mountinfo)")
        self.version = 2 if (own / "memory.max").exists() else 1
        mount = own
        for line in Path("/proc/self/mountinfo").read_text().splitlines():  # the hierarchy's mount point
            fields, _, tail = line.partition(" - ")
            fstype, _, options = [*tail.split(), "", "", ""][:3]
            if (fstype == "cgroup2") if self.version == 2 else (fstype == "cgroup" and "memory" in options.split(",")):
                mount = Path(fields.split()[4])
                break
        errors = []
        for parent in dict.fromkeys([own, mount]):  # v2: a populated cgroup cannot have controllers in children
            path = parent / f"{name}-{os.getpid()}"
            try:
                path.mkdir()
            except OSError as e:
                errors.append(f"mkdir {path}: {e}")
                continue
            if self.version == 2 and not (path / "memory.max").exists():
                path.rmdir()
                errors.append(f"{path}: no memory controller (cgroup.subtree_control of {parent})")
                continue
            self.path = path
            return
        raise CgroupUnavailable("cannot create a memory cgroup: " + "; ".join(errors))

    def set_limit(self, limit_bytes: int) -> None:
        """Limit memory (and memory + swap, so swap cannot hide an overrun) to `limit_bytes`."""
        if self.version == 2:
            (self.path / "memory.max").write_text(str(limit_bytes))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            memsw = self.path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limit_bytes))

    def peak_bytes(self) -> int | None:
        """Peak usage the kernel counted (page cache included); `None` where the kernel has no such file."""
        try:
            return int((self.path / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """How many processes the OOM killer killed in this cgroup."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def run(self, argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 600,
            ) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside the cgroup and wait for it."""
        procs = self.path / "cgroup.procs"
        return subprocess.run(["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *argv], env=env,
                              capture_output=True, text=True, timeout=timeout)

    def close(self) -> None:
        """Remove the cgroup, first ending what is left in it (e.g. a writer process whose parent was OOM-killed)."""
        for attempt in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if attempt == 20:  # only processes this cgroup's command started can be in it
                    for pid in (self.path / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.1)
        self.path.rmdir()

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
