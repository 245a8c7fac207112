"""Object-store roots: upload throughput vs a plain s3fs put, resume from the bucket vs from local disk.

Starts moto's S3 server on 127.0.0.1 (dummy credentials), then, in one run and on the same
bytes, measures (median of --repeats):

- ``save_local``: `CheckpointStore.save` to a local root (write + fsync + commit);
- ``save_s3``: the same save to an ``s3://`` root (local cache write + upload, manifest last);
- ``put_plain``: ``s3fs.put_file`` of the same files (what any uploader must pay);
- ``load_local`` / ``load_s3_cold`` / ``load_s3_warm``: `load("auto")` (verified) from the local
  root, from the bucket on an empty cache (download + verify), and from a warm cache.

Reported ratios: ``(save_s3 - save_local) / put_plain`` (the library's upload vs a bare put;
1.0 = no overhead) and ``load_s3_cold / load_local``. Absolute numbers measure moto (a
Python server) and this machine, not S3; the ratios are the point.

    python scripts/bench_s3.py --mb 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=64, help="weights size in MiB (the optimizer state is 2x)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    import logging

    import boto3
    import s3fs
    from moto.server import ThreadedMotoServer

    from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore, SaveRequest

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    options = {"endpoint_url": endpoint}
    n = args.mb * (1 << 20) // 4
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g)
    state = CheckpointState(step=1, weights={"w": w}, optimizer={
        "state": {0: {"exp_avg": torch.randn(n, generator=g), "exp_avg_sq": torch.rand(n, generator=g)}},
        "param_groups": [{"lr": 1e-3, "params": [0]}]})
    times: dict[str, list[float]] = {k: [] for k in ("save_local", "save_s3", "put_plain", "load_local",
                                                     "load_s3_cold", "load_s3_warm")}
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="warmup")
    fs.pipe_file("warmup/x", b"x")  # the plain client's session and connection exist before timing
    nbytes = 0
    try:
        for rep in range(args.repeats):
            tmp = Path(tempfile.mkdtemp(prefix="bench_s3_"))
            bucket = f"bench-{uuid.uuid4().hex[:10]}"
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            url = f"s3://{bucket}/run"
            kw = {"compression": "none", "task_id": "t"}
            local = CheckpointStore(tmp / "local", **kw)
            t0 = time.perf_counter()
            info = local.save(state, SaveRequest(step=1, reason="bench"))
            times["save_local"].append(time.perf_counter() - t0)
            files = [f for f in Path(info.path).iterdir() if f.is_file()]
            nbytes = sum(f.stat().st_size for f in files)

            def plain(files: list[Path] = files, bucket: str = bucket) -> None:
                t0 = time.perf_counter()
                for f in files:
                    fs.put_file(str(f), f"{bucket}/plain/{f.name}")
                times["put_plain"].append(time.perf_counter() - t0)

            if rep % 2 == 0:  # alternate the order: neither side always meets a warmer server
                plain()
            remote = CheckpointStore(url, storage_options=options, cache_dir=tmp / "cache-a", **kw)
            t0 = time.perf_counter()
            remote.save(state, SaveRequest(step=1, reason="bench"))
            times["save_s3"].append(time.perf_counter() - t0)
            if rep % 2 == 1:
                plain()
            t0 = time.perf_counter()
            local.load("auto")
            times["load_local"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cold = CheckpointStore(url, storage_options=options, cache_dir=tmp / "cache-b", read_only=True, **kw)
            cold.load("auto")
            times["load_s3_cold"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cold.load("auto")
            times["load_s3_warm"].append(time.perf_counter() - t0)
            for s in (local, remote, cold):
                s.close()
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"bytes": nbytes, "repeats": args.repeats, **{f"{k}_s": round(v, 3) for k, v in med.items()},
           "upload_MiB_s": round(nbytes / (1 << 20) / max(med["save_s3"] - med["save_local"], 1e-9), 1),
           "plain_put_MiB_s": round(nbytes / (1 << 20) / med["put_plain"], 1),
           "upload_vs_plain_put": round((med["save_s3"] - med["save_local"]) / med["put_plain"], 2),
           "resume_s3_cold_vs_local": round(med["load_s3_cold"] / med["load_local"], 2),
           "resume_s3_warm_vs_local": round(med["load_s3_warm"] / med["load_local"], 2)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
