"""Kernel files the memory probe reads inside every save: one `pread` of a kept descriptor each."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from hf_dynamic_ckpt import sysmem as kernelfiles  # the kernel-file reader lives in sysmem
from hf_dynamic_ckpt.sysmem import kept, meminfo, read_kernel_file

MiB = 1 << 20


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def _fresh():
    kernelfiles.close_all()
    yield
    kernelfiles.close_all()


def _rss_pages() -> int:
    return int(read_kernel_file("/proc/self/statm").split()[1])


def test_a_kernel_file_is_read_again_from_one_kept_descriptor_and_is_fresh() -> None:
    before = _rss_pages()
    fds = _open_fds()
    block = b"\x01" * (128 * MiB)  # touched: resident
    after = _rss_pages()
    assert after - before >= (100 * MiB) // os.sysconf("SC_PAGE_SIZE")  # regenerated, not a cached text
    for _ in range(20):
        _rss_pages()
    assert _open_fds() == fds  # the first read opened it; none since
    assert kept() == ["/proc/self/statm"]
    del block


def test_regular_files_are_read_with_open_so_a_replaced_file_is_seen(tmp_path: Path) -> None:
    f = tmp_path / "memory.max"
    f.write_text("100\n")
    assert read_kernel_file(f) == "100\n"
    tmp = tmp_path / "new"
    tmp.write_text("200\n")
    os.replace(tmp, f)  # a new inode under the same name: a kept descriptor would still read "100"
    assert read_kernel_file(f) == "200\n" and kept() == []
    with pytest.raises(FileNotFoundError):
        read_kernel_file(tmp_path / "missing")


def test_a_failing_descriptor_is_opened_again_once(monkeypatch) -> None:
    read_kernel_file("/proc/self/statm")
    real, calls = os.pread, []

    def flaky(fd, n, offset):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(19, "No such device")  # what a removed cgroup's file answers
        return real(fd, n, offset)

    monkeypatch.setattr(kernelfiles.os, "pread", flaky)
    assert read_kernel_file("/proc/self/statm").split()[1].isdigit()
    assert len(calls) == 2 and kept() == ["/proc/self/statm"]
    monkeypatch.setattr(kernelfiles.os, "pread", lambda fd, n, offset: (_ for _ in ()).throw(OSError(19, "gone")))
    with pytest.raises(OSError, match="gone"):
        read_kernel_file("/proc/self/statm")
    assert kept() == []  # nothing half-open is kept


def test_at_most_max_kept_descriptors(monkeypatch) -> None:
    monkeypatch.setattr(kernelfiles, "MAX_KEPT", 2)
    fds = _open_fds()
    for path in ("/proc/self/statm", "/proc/meminfo", "/proc/self/stat", "/proc/loadavg"):
        assert read_kernel_file(path)
    assert len(kept()) <= 2 and _open_fds() <= fds + 2


def test_a_forked_child_reads_its_own_proc_self() -> None:
    _rss_pages()  # the parent keeps /proc/self/statm open: a descriptor of the parent's file
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child grows between two reads through the module; the parent does not
        try:
            before = _rss_pages()
            block = b"\x01" * (256 * MiB)
            os.write(w, str(_rss_pages() - before).encode())
            del block
        finally:
            os._exit(0)
    os.close(w)
    grown = int(os.read(r, 64).decode())
    os.close(r)
    os.waitpid(pid, 0)
    assert grown >= (200 * MiB) // os.sysconf("SC_PAGE_SIZE")


def test_meminfo_matches_psutil() -> None:
    total, available = meminfo()
    vm = psutil.virtual_memory()
    assert total == vm.total
    assert abs(available - vm.available) < 512 * MiB  # read at another moment
    assert kept() == ["/proc/meminfo"]
