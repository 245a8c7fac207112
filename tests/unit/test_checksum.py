"""File checksums (`hashing`), the checksumming writer (`tensorpack.HashingWriter`), fsync helpers (`fs`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import xxhash

from hf_dynamic_ckpt.store.fs import fsync_dir, fsync_file
from hf_dynamic_ckpt.store.hashing import (
    FILE_CHECKSUM_ALGO,
    checksum_algo,
    file_checksum,
    make_file_entry,
    new_hasher,
)
from hf_dynamic_ckpt.store import HashingWriter


def test_file_checksum_matches_reference_implementations(tmp_path: Path) -> None:
    data = bytes(range(256)) * 70_000  # > one 8 MiB chunk boundary
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert FILE_CHECKSUM_ALGO == "xxh3_128"
    assert file_checksum(path) == "xxh3_128:" + xxhash.xxh3_128(data).hexdigest()
    assert file_checksum(path, algo="sha256") == "sha256:" + hashlib.sha256(data).hexdigest()
    assert checksum_algo(file_checksum(path, algo="sha256")) == "sha256"
    small = tmp_path / "small"  # below the mmap threshold: read() path
    small.write_bytes(b"abc")
    assert file_checksum(small) == "xxh3_128:" + xxhash.xxh3_128(b"abc").hexdigest()
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert file_checksum(empty) == "xxh3_128:" + xxhash.xxh3_128(b"").hexdigest()


def test_one_flipped_bit_changes_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    data = bytearray(b"\0" * 10_000)
    path.write_bytes(data)
    before = file_checksum(path)
    data[5_000] ^= 0x01
    path.write_bytes(data)
    assert file_checksum(path) != before


def test_hashing_writer_checksum_equals_reread(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    with open(path, "wb") as raw:
        f = HashingWriter(raw)
        f.write(b"abc")
        f.write(memoryview(bytearray(b"xyz" * 1000)))
        assert f.tell() == f.size == 3003
        mid = f.checksum()  # taking a checksum does not finish the hash
        f.write(b"!")
        fsync_file(f)
        final = f.checksum()
    assert mid != final
    assert final == file_checksum(path)
    entry = make_file_entry(path, tier="weights", rank=1, checksum=final)
    assert entry == {"size": 3004, "checksum": final, "tier": "weights", "rank": 1}
    assert make_file_entry(path, tier="state") == {"size": 3004, "checksum": final, "tier": "state", "rank": None}
    fsync_file(path)
    fsync_dir(tmp_path)


def test_new_hasher_names_and_unknown_algorithm() -> None:
    h = new_hasher()
    h.update(b"x")
    assert h.name == "xxh3_128" and h.copy().hexdigest() == h.hexdigest()
    assert new_hasher("sha256").name == "sha256"
    with pytest.raises(ValueError, match="Unknown checksum algorithm 'nope'"):
        new_hasher("nope")


def test_hashing_writer_starts_writeback_of_each_full_stretch(tmp_path, monkeypatch):
    import hf_dynamic_ckpt.store.tensorpack as tensorpack

    calls = []
    monkeypatch.setattr(tensorpack, "WRITEBACK_BYTES", 1000)
    def fake(fd, off, n):
        calls.append((off, n))
        assert os.fstat(fd).st_size >= off + n  # flushed: the kernel can only write back what it has
        return True

    monkeypatch.setattr(tensorpack, "start_writeback", fake)
    path = tmp_path / "f.bin"
    with open(path, "wb") as raw:
        f = tensorpack.HashingWriter(raw)
        for size in (600, 600, 300, 2500, 10):
            f.write(b"x" * size)
        fsync_file(f)
    # each request covers the bytes since the previous one, once at least 1000 are pending
    assert calls == [(0, 1200), (1200, 2800)]
    assert path.stat().st_size == 4010
    assert f.checksum() == file_checksum(path)


def test_hashing_writer_stops_asking_when_writeback_is_unsupported(monkeypatch):
    import io

    import hf_dynamic_ckpt.store.tensorpack as tensorpack

    monkeypatch.setattr(tensorpack, "WRITEBACK_BYTES", 10)
    f = tensorpack.HashingWriter(io.BytesIO())  # no file descriptor
    f.write(b"y" * 50)
    f.write(b"y" * 50)
    assert f.size == 100
    calls = []
    monkeypatch.setattr(tensorpack, "start_writeback", lambda fd, off, n: calls.append(n) or False)
    g_raw = io.BufferedWriter(io.FileIO("/dev/null", "wb"))
    g = tensorpack.HashingWriter(g_raw)
    g.write(b"z" * 20)
    g.write(b"z" * 20)
    assert calls == [20]  # refused once: never asked again


def test_start_writeback_on_a_real_file(tmp_path):
    import sys

    from hf_dynamic_ckpt.store import start_writeback

    path = tmp_path / "g.bin"
    with open(path, "wb") as f:
        f.write(b"a" * 65536)
        f.flush()
        started = start_writeback(f.fileno(), 0, 65536)
        assert start_writeback(f.fileno(), 0, 0) is False
    assert started is sys.platform.startswith("linux")
    assert path.read_bytes() == b"a" * 65536
