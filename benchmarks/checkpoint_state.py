"""How large a RemoteDataset worker's checkpoint state is, at ImageNet-like settings.

    python benchmarks/checkpoint_state.py [--sizes 4000 16000]

Uploads generated datasets of 1,000-sample shards to an embedded S3 server on loopback,
streams each with ``open_shards=4``, ``shuffle(1000)`` and ``batched(64)`` on one worker,
and at several stop points saves ``state_dict()`` the way a checkpoint does
(``torch.save``), as JSON and as a pickle. Ranges are cut so that a shard is read in about
14 of them, as 110 KB JPEGs in 8 MiB ranges are. The state lists what is not delivered
(the buffer, the open ranges, the ranges cut ahead, the rest of the plan), so its size
should follow ``open_shards`` and the buffer, not the dataset: the two sizes show it.
It also times gathering 2 ranks x 4 workers' states and dividing the rest among 3 ranks,
and the resume itself: from a fresh pipeline's ``load_state_dict`` to its first batch
(medians of 3), for the worker's own state (an exact resume, which replays the run) and
for the states of every worker divided among other ranks (an elastic one).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import pickle
import statistics
import time
from operator import itemgetter

import torch

from remote_loader import FetchConfig, RemoteDataset, upload_cv_dataset
from remote_loader.testing.server import EmbeddedS3
from remote_loader.testing.synthetic import SyntheticImages

BUCKET = "checkpoint-bench"


def measure(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return {"torch_save_bytes": buffer.tell(), "json_bytes": len(json.dumps(state)),
            "pickle_bytes": len(pickle.dumps(state)), "intervals": len(state["remaining"]) // 2,
            "undelivered": sum(b - a for a, b in zip(state["remaining"][::2], state["remaining"][1::2], strict=False))}


def first_batch_after(load) -> float:
    """Seconds from loading a state into a fresh pipeline (``load()`` returns it) to its first batch."""
    started = time.perf_counter()
    stream = load()
    iterator = iter(stream)
    next(iterator)
    took = time.perf_counter() - started
    iterator.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4000, 16000])
    parser.add_argument("--stops", type=int, nargs="+", default=[1, 20, 45], help="batches of 64 before each save")
    args = parser.parse_args()
    rows = []
    with EmbeddedS3(buckets=[BUCKET]) as server:
        client = server.client()
        for size in args.sizes:
            prefix = f"n{size}"
            upload_cv_dataset(SyntheticImages(size, size=(48, 36)), client=client, bucket=BUCKET, base_folder=prefix,
                              maxcount=1000, workers=2, progress=False)
            dataset = RemoteDataset(client, BUCKET, prefix, open_shards=4, fetch=FetchConfig(range_bytes=1))
            shard_bytes = int(dataset.reader.manifest.shards.size[0])
            fetch = FetchConfig(range_bytes=max(1, shard_bytes // 14))
            for stop in args.stops:
                stream = (RemoteDataset(client, BUCKET, prefix, open_shards=4, fetch=fetch)
                          .shuffle(1000).map(itemgetter("__key__")).batched(64, collation_fn=list))
                iterator = iter(stream)
                for _ in itertools.islice(iterator, stop):
                    pass
                state = stream.state_dict()
                iterator.close()

                def load(state=state):
                    fresh = (RemoteDataset(client, BUCKET, prefix, open_shards=4, fetch=fetch)
                             .shuffle(1000).map(itemgetter("__key__")).batched(64, collation_fn=list))
                    fresh.load_state_dict(state)
                    return fresh

                resume = statistics.median(first_batch_after(load) for _ in range(3))
                rows.append({"samples": size, "batches": stop, **measure(state), "resume_seconds": round(resume, 3)})
                print(json.dumps(rows[-1]), flush=True)
        # Gathering 2 x 4 workers' states and dividing the rest among 3 ranks.
        prefix = f"n{args.sizes[-1]}"
        states = []
        for rank in range(2):
            stream = RemoteDataset(client, BUCKET, prefix, open_shards=4, rank=rank, world_size=2,
                                   fetch=FetchConfig(range_bytes=max(1, shard_bytes // 14))).shuffle(1000)
            stream.set_epoch(0)  # one object plays the four workers here: their iterations share epoch 0
            for worker in range(4):
                from torch.utils.data._utils import worker as torch_worker

                torch_worker._worker_info = torch_worker.WorkerInfo(
                    id=worker, num_workers=4, seed=1000 + worker, dataset=stream
                )
                iterator = iter(stream)
                for _ in itertools.islice(iterator, 300):
                    pass
                states.append(stream.state_dict())
                iterator.close()
                torch_worker._worker_info = None
        started = time.perf_counter()
        resumed = RemoteDataset(client, BUCKET, prefix, rank=0, world_size=3).shuffle(1000)
        resumed.load_state_dict(states)
        took = time.perf_counter() - started

        def elastic():
            fresh = RemoteDataset(client, BUCKET, prefix, rank=0, world_size=3).shuffle(1000)
            fresh.load_state_dict(states)
            return fresh

        resume = statistics.median(first_batch_after(elastic) for _ in range(3))
        print(
            json.dumps(
                {
                    "gather_2x4_states_seconds": round(took, 4),
                    "states_bytes": len(pickle.dumps(states)),
                    "elastic_resume_seconds": round(resume, 3),
                }
            )
        )
        client.close()


if __name__ == "__main__":
    main()
