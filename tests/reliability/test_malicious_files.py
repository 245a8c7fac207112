"""Every bad byte falls back: hostile files raise `CorruptCheckpointError`, within bounded memory.

The failures it guards: float `data_offsets` (now refused by the safetensors package's parser) or a list
in the safetensors alias map giving a raw `TypeError`; an L1 header declaring 64 GiB giving a raw allocator
`RuntimeError`;
`group_chunk_elems=1` in a 350-byte L1 file a `MemoryError` at 2.7 GB RSS after 31 s; a
100k-deep JSON a `RecursionError` that stops the store from opening; a non-JSON
`optimizer.json` aborting resume instead of the weights-only fallback.

Every case is a checkpoint whose manifest vouches for the hostile file (size and checksum
recomputed, as anyone can), so only the parsers stand between it and the caller.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard
from helpers import save_state
from store_helpers import replace_file, tiny_state

from hf_dynamic_ckpt.config import FallbackStrategy
from hf_dynamic_ckpt.constants import MANIFEST_NAME, OPTIMIZER_META_NAME, OPTIMIZER_NAME, WEIGHTS_NAME, Tier
from hf_dynamic_ckpt.errors import CorruptCheckpointError
from hf_dynamic_ckpt.run.resume import plan_resume
from hf_dynamic_ckpt.store import CheckpointStore

DEEP = b"[" * 100_000 + b"]" * 100_000


def _safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _l1(header: dict, payload: bytes, index: list[tuple[int, int]]) -> bytes:
    """An L1 container with this header, payload and frame index (CRCs correct)."""
    raw = json.dumps(header).encode()
    body = b"".join(struct.pack("<QQ", n, h) for n, h in index)
    tail = struct.pack("<QQ", len(payload), len(index))
    return (b"HFDCTP01" + struct.pack("<Q", len(raw)) + raw + struct.pack("<I", zlib.crc32(raw)) + payload + body
            + tail + struct.pack("<I", zlib.crc32(body + tail)) + b"HFDCTEND")


def _l1_header(tensors: list[dict], **kw: object) -> dict:
    total = sum(int(t["nbytes"]) for t in tensors)
    return {"format": "hf_dynamic_ckpt.tensorpack", "version": 3, "codec": "zstd", "level": 3, "total_bytes": total,
            "group_chunk_elems": 1 << 22, "frame_bytes": 16 << 20, "tensors": tensors, **kw}


def _huge_l1(directory: Path) -> None:
    """The honest file's frames under a header that declares one 64 GiB tensor (one piece, one frame)."""
    import xxhash

    frame = zstandard.ZstdCompressor().compress(bytes(64))
    tensor = {"name": "state/0/exp_avg", "dtype": "float32", "shape": [1 << 34], "offset": 0, "nbytes": 1 << 36,
              "byte_grouped": False}
    header = _l1_header([tensor], group_chunk_elems=1 << 40, frame_bytes=1 << 40)
    replace_file(directory, OPTIMIZER_NAME, _l1(header, frame, [(len(frame), xxhash.xxh3_64_intdigest(frame))]))


def _chunk1_l1(directory: Path) -> None:
    """A 350-byte file whose header asks for 4M one-element pieces (group_chunk_elems=1)."""
    tensor = {"name": "state/0/exp_avg", "dtype": "float32", "shape": [1 << 22], "offset": 0, "nbytes": 1 << 24,
              "byte_grouped": True}
    data = _l1(_l1_header([tensor], group_chunk_elems=1, frame_bytes=1 << 40), b"\x28\xb5\x2f\xfd" + bytes(16),
               [(20, 0)])
    assert 300 <= len(data) <= 400
    replace_file(directory, OPTIMIZER_NAME, data)


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "safetensors float data_offsets": (lambda d: replace_file(d, WEIGHTS_NAME, _safetensors(
        {"w": {"dtype": "F32", "shape": [8, 4], "data_offsets": [0.0, 128.0]}}, bytes(128))),
        r"weights.safetensors is not a valid safetensors file \(Error while deserializing header: invalid JSON in "
        r"header: invalid type: floating point `0.0`, expected usize"),
    "safetensors list in the alias map": (lambda d: replace_file(d, WEIGHTS_NAME, _safetensors(
        {"__metadata__": {"format": "pt", "hf_dynamic_ckpt.aliases": json.dumps({"v": ["w"]})},
         "w": {"dtype": "F32", "shape": [8, 4], "data_offsets": [0, 128]}}, bytes(128))),
        r"Alias map in .* is not a JSON object of key names"),
    "safetensors 100k-deep header": (lambda d: replace_file(d, WEIGHTS_NAME, struct.pack("<Q", len(DEEP)) + DEEP),
                                     r"not a valid safetensors file \(Error while deserializing header: invalid "
                                     r"JSON in header: invalid type: sequence"),
    "L1 header declaring 64 GiB": (_huge_l1, r"declares 68719476736 bytes of tensors but holds a \d+-byte payload"),
    "L1 group_chunk_elems=1 in 350 bytes": (_chunk1_l1,
                                            r"declares 16777216 bytes of tensors but holds a 20-byte payload"),
    "optimizer.json 100k deep": (lambda d: replace_file(d, OPTIMIZER_META_NAME, DEEP), r"JSON nested too deeply"),
    "optimizer.json not JSON": (lambda d: replace_file(d, OPTIMIZER_META_NAME, b"\x80\x04K\x01."),  # a pickle
                                r"optimizer.json is unreadable or not JSON"),
    "rng file not an object": (lambda d: replace_file(d, "rng-rank0.json", b"[1, 2]"),
                               r"rng-rank0.json is not a JSON object"),
    "manifest 100k deep": (lambda d: (d / MANIFEST_NAME).write_bytes(DEEP), r"the manifest is not valid JSON"),
}


def _build(root: Path, case: str) -> None:
    store = CheckpointStore(root, task_id="run", session_id="s1")
    save_state(store, tiny_state(1, frozen=1.0), reason="honest")
    info = save_state(store, tiny_state(2, frozen=2.0), reason="hostile")
    store.close()
    CASES[case][0](Path(info.path))


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file_is_a_corrupt_checkpoint_and_resume_falls_back(tmp_path: Path, case: str) -> None:
    _build(tmp_path, case)
    store = CheckpointStore(tmp_path, task_id="run", session_id="s2")  # opening reads every manifest
    with pytest.raises(CorruptCheckpointError, match=CASES[case][1]):
        store.load("step:2")
    plan = plan_resume(store, "auto", fallback=FallbackStrategy.FULL)
    assert plan is not None
    loaded = plan.loaded
    if case.startswith(("safetensors", "manifest")):  # weights unusable: the next older checkpoint
        assert loaded.info.step == 1 and loaded.optimizer is not None
    else:  # weights fine: resume from them, the broken tier falls back
        assert loaded.info.step == 2 and loaded.weights is not None
        assert loaded.warnings and ("optimizer" in case or "L1" in case) == (loaded.optimizer is None)
        assert ("rng" in case) == (loaded.rng is None)
    assert store.verify("step:1") == []
    store.close()


_MEASURE = """
import json, resource, sys
from hf_dynamic_ckpt.store import CheckpointStore
from hf_dynamic_ckpt.errors import CorruptCheckpointError
soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
with open("/proc/self/status") as f:
    data_kb = next(int(l.split()[1]) for l in f if l.startswith("VmData:"))
resource.setrlimit(resource.RLIMIT_DATA, ((data_kb << 10) + (1 << 30), hard))  # a runaway reader stops at +1 GiB
out = {}
for root in sys.argv[1:]:
    store = CheckpointStore(root, task_id="run", cleanup=False)
    honest = store.load("step:1", mmap=False)
    del honest
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        store.load("step:2", mmap=False)
        outcome = "loaded"
    except CorruptCheckpointError:
        outcome = "CorruptCheckpointError"
    except BaseException as e:
        outcome = type(e).__name__
    out[root] = [outcome, before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]
    store.close()
print(json.dumps(out))
"""


def test_rejecting_a_hostile_file_costs_a_few_mb_over_an_honest_load(tmp_path: Path) -> None:
    roots = {}
    for k, case in enumerate(sorted(CASES)):
        roots[case] = tmp_path / f"case{k}"
        _build(roots[case], case)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_MEASURE), *map(str, roots.values())],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, root in roots.items():
        outcome, before_kb, after_kb = measured[str(root)]
        assert outcome == "CorruptCheckpointError", (case, outcome)
        assert after_kb - before_kb < 8 * 1024, (case, after_kb - before_kb)  # peak RSS grew by < 8 MiB


def test_store_opens_and_lists_next_to_a_hostile_manifest(tmp_path: Path) -> None:
    _build(tmp_path, "manifest 100k deep")
    store = CheckpointStore(tmp_path, task_id="run", session_id="s2")
    assert [(i.step, i.status) for i in store.list(include_unhealthy=True)] == [(2, "corrupt"), (1, "ok")]
    assert store.resolve("auto").step == 1
    assert store.load("step:1", tiers={Tier.WEIGHTS}).weights is not None
    store.close()
