"""Shared pieces of the store's reliability tests (imported by the test modules next to it)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import torch
import xxhash

from hf_dynamic_ckpt.store import CheckpointState, frozen_record


def tiny_state(step: int, *, frozen: float | None = None) -> CheckpointState:
    """A small all-tier state that is a pure function of `step` (and of `frozen`: a frozen weight's value, recorded
    by checksum instead of written)."""
    g = torch.Generator().manual_seed(step)
    return CheckpointState(step=step, weights={"w": torch.randn(8, 4, generator=g)},
                           frozen={} if frozen is None else {"frozen": frozen_record(torch.full((64,), frozen))},
                           optimizer={"state": {0: {"exp_avg": torch.randn(8, 4, generator=g)}},
                                      "param_groups": [{"lr": 0.1, "params": [0]}]},
                           scheduler={"last_epoch": step}, rng={"seed": step}, sampler={"batches": step})


def file_checksum(path: Path) -> str:
    """A file's checksum as a manifest records it (the on-disk format: ``xxh3_128:<hex>`` of its bytes)."""
    return f"xxh3_128:{xxhash.xxh3_128_hexdigest(Path(path).read_bytes())}"


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """The manifest's own checksum (the on-disk format: sha256 of the sorted, compact JSON of the other keys)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_checksum"}
    data = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def read_manifest_json(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "manifest.json").read_text())


def write_manifest_json(directory: Path, manifest: dict[str, Any]) -> None:
    """Write a hand-edited manifest with a matching checksum, as an adversary can."""
    manifest = {k: v for k, v in manifest.items() if k != "manifest_checksum"}
    manifest["manifest_checksum"] = manifest_checksum(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def replace_file(directory: Path, name: str, data: bytes) -> None:
    """Replace a checkpoint file and make the manifest vouch for the new bytes (size + checksum)."""
    (directory / name).write_bytes(data)
    manifest = read_manifest_json(directory)
    manifest["files"][name]["size"] = len(data)
    manifest["files"][name]["checksum"] = file_checksum(directory / name)
    write_manifest_json(directory, manifest)


class Canary:
    """A file outside the store that nothing may touch: same bytes, same inode, same mtime."""

    def __init__(self, directory: Path, name: str = "canary.txt", data: bytes = b"do not touch\n") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / name
        self.path.write_bytes(data)
        self.data = data
        self.stat = self.path.stat()

    def intact(self) -> bool:
        if not self.path.exists():
            return False
        st = self.path.stat()
        return (self.path.read_bytes() == self.data and st.st_ino == self.stat.st_ino
                and st.st_mtime_ns == self.stat.st_mtime_ns)


def tree(root: Path) -> dict[str, tuple[str, int, int, str]]:
    """Every entry under `root` (links not followed): kind, size, mtime_ns, content hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if kind == "file" else ""
            out[str(p.relative_to(root))] = (kind, st.st_size if kind == "file" else 0, st.st_mtime_ns, digest)
    return out


def read_only_command(directory: Path, argv: list[str]) -> list[str] | None:
    """`argv` run with `directory` mounted read-only (a private mount namespace), or `None` where that is impossible.

    As root, `chmod` binds nothing, so a real read-only bind mount is the only honest test of read-only media.
    """
    import shlex
    import shutil
    import subprocess

    if os.geteuid() != 0 or not shutil.which("unshare"):
        return None
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        return None
    d = shlex.quote(str(directory))
    script = f"mount --bind {d} {d} && mount -o remount,bind,ro {d} && exec {shlex.join(argv)}"
    return ["unshare", "-m", "sh", "-c", script]
