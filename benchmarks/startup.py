"""Where the time to the first batch goes: from a fresh process to the first batch of 64.

Each phase is timed in a fresh process against the embedded SeaweedFS: importing
remote_loader (and torch, which it needs), creating the client, fetching the manifest,
the first index GET, the first sample (first parts of the first ranges), and the first
batch through a 1,000-sample shuffle buffer, with 0 and 2 DataLoader workers.

    python benchmarks/startup.py --images 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

from remote_loader import upload_cv_dataset
from remote_loader.testing.server import EmbeddedS3
from remote_loader.testing.synthetic import SyntheticImages

_CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    t_torch = time.perf_counter()
    from torch.utils.data import DataLoader
    from remote_loader import RemoteDataset, make_client
    t_import = time.perf_counter()
    endpoint, key, secret, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    client = make_client(endpoint, key, secret)
    client.head("bench", "d/manifest.msgpack")  # the client's first request: SDK set-up and a connection
    t_client = time.perf_counter()
    ds = RemoteDataset(client, "bench", "d")
    ds.reader.manifest
    t_manifest = time.perf_counter()
    ds.reader.read_index(ds.reader.manifest.shards[0])
    t_index = time.perf_counter()
    first = next(iter(RemoteDataset(client, "bench", "d")))
    t_sample = time.perf_counter()
    pipeline = ds.shuffle(1000).to_tuple("jpg", "cls").batched(64, collation_fn=len)
    next(iter(DataLoader(pipeline, batch_size=None, num_workers=workers)))
    t_batch = time.perf_counter()
    print(json.dumps({"import torch": t_torch - t0, "import remote_loader": t_import - t_torch,
                      "client + first request": t_client - t_import, "manifest GET": t_manifest - t_client,
                      "one index GET": t_index - t_manifest, "first sample (no buffer)": t_sample - t_index,
                      "first batch (shuffle 1000, batch 64)": t_batch - t_sample}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with EmbeddedS3(buckets=["bench"]) as server:
        client = server.client()
        upload_cv_dataset(SyntheticImages(args.images), client=client, bucket="bench", base_folder="d", maxsize=64e6,
                          workers=2, progress=False)
        for workers in (0, 2):
            runs = []
            for _ in range(args.repeats):
                out = subprocess.run([sys.executable, "-c", _CHILD, server.endpoint_url, server.access_key,
                                      server.secret_key, str(workers)], capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"num_workers={workers} (median of {args.repeats}, seconds):")
            for phase in runs[0]:
                print(f"  {phase:40s} {statistics.median(r[phase] for r in runs):6.3f}")


if __name__ == "__main__":
    main()
