"""The node benchmark's GPU rows (``run.py``'s B-gpu scenario): each a stream of batches of
``GPU_BATCH`` (images on the device, labels) for one shuffled epoch, in a fresh process.

- ``ours``: remote_loader's ``decode(RandomResizedCrop(224), device="cuda")`` through
  ``loader()`` (its defaults, or ``workers``);
- ``webdataset``: WebDataset with ``workers`` DataLoader workers and torchvision's GPU
  ``decode_jpeg`` of each batch, then a crop, resize and flip per image, as its users write it;
- ``memory``: either decoder on ``IN_MEMORY`` JPEGs held in memory, four times over;
- ``raw``: nvImageCodec decoding whole batches of the same JPEGs from memory and nothing
  else, with the hardware decoder alone or with a share of each batch (``load``) left to
  the CUDA (hybrid) decoder: the ceiling of any loader that decodes with it;
- ``dali``: NVIDIA DALI's ImageNet training pipeline as its docs write it
  (``fn.decoders.image_random_crop(device="mixed")``, ``fn.resize``,
  ``fn.crop_mirror_normalize``, its default ``hw_decoder_load``), fed by a parallel
  ``fn.external_source`` that reads the WebDataset shards with boto3 (``source="bucket"``:
  batches of consecutive samples of shuffled shards, one ranged GET per shard a batch
  touches, from the member index made when the shards were written, as DALI's own
  WebDataset reader needs ``wds2idx`` index files), or the same JPEGs from memory;
- ``model``: the training step alone, on one fixed batch: what a loader feeds.

A row with ``train`` runs a training step on each batch in the loop that draws it
(torchvision's ResNet-50, ``channels_last``, bf16 autocast, forward, backward and SGD);
one with ``spinner`` has a thread spinning pure Python beside the loop from the first
batch on (``run.py`` reports the share of its loops it kept).

Without a GPU, ours and the raw and DALI rows run on the CPU (nvImageCodec's CPU backend,
DALI's CPU operators): a check that the script runs, not a measurement.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

GPU_BATCH = 256
IN_MEMORY = 2048
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DALI_INDEX = "wds-index.json"


def ours(spec: dict[str, Any], bucket: str, shuffle: int) -> Any:
    from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client

    client = make_client(spec["endpoint"], spec["access_key"], spec["secret_key"])
    crop = RandomResizedCrop(224, mean=MEAN, std=STD) if spec.get("train") else RandomResizedCrop(224)
    ds = (RemoteDataset(client, bucket, "ours", seed=0).shuffle(shuffle)
          .decode(crop, device=spec["device"], batched=True).to_tuple("jpg", "cls").batched(GPU_BATCH))
    options = {"decoding": spec["decoding"]} if spec.get("decoding") else {}  # default: DALI in this process
    return loader(ds, **options) if spec["workers"] is None else loader(ds, num_workers=spec["workers"], **options)


def torchvision_augment(datas: list[Any]) -> Any:
    """What a WebDataset user writes for GPU decoding: torchvision's batched ``decode_jpeg`` on
    the GPU, then its RandomResizedCrop box, an antialiased resize and a flip per image."""
    import torch
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2 import RandomResizedCrop
    from torchvision.transforms.v2 import functional as tvf

    images = decode_jpeg([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas], device="cuda")
    out = []
    for image in images:
        top, left, height, width = RandomResizedCrop.get_params(image, (0.08, 1.0), (3 / 4, 4 / 3))
        crop = tvf.resized_crop(image, top, left, height, width, [224, 224], antialias=True)
        out.append(tvf.horizontal_flip(crop) if random.random() < 0.5 else crop)
    return torch.stack(out)


def webdataset(spec: dict[str, Any], bucket: str, shuffle: int) -> Any:
    import systems
    import webdataset as wds
    from torch.utils.data import DataLoader

    target = systems.Target(spec["endpoint"], bucket, spec["access_key"], spec["secret_key"])
    os.environ.update(target.environ())
    wds.gopen_schemes["s3"] = systems._s3_opener
    listing = target.boto3().list_objects_v2(Bucket=bucket, Prefix="wds/")
    urls = sorted(f"s3://{bucket}/{o['Key']}" for o in listing.get("Contents", []) if o["Key"].endswith(".tar"))
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), seed=0, nodesplitter=wds.single_node_only,
                              workersplitter=wds.split_by_worker, empty_check=False)
               .shuffle(shuffle).to_tuple("jpg", "cls").batched(GPU_BATCH, collation_fn=list))
    batches = DataLoader(dataset, batch_size=None, num_workers=spec["workers"], pin_memory=True)
    return ((torchvision_augment([d for d, _ in batch]), [int(c) for _, c in batch]) for batch in batches)


def _jpegs(spec: dict[str, Any], count: int) -> list[bytes]:
    return [p.read_bytes() for p in sorted(Path(spec["images"]).glob("*.jpg"))[:count]]


def memory(spec: dict[str, Any]) -> Any:
    """Batches of the first ``IN_MEMORY`` JPEGs, four times over, decoded by one of the two
    decoders in this thread: the decoder's own ceiling (on the CPU backend, one batch)."""
    import numpy as np

    from remote_loader import RandomResizedCrop
    from remote_loader.pipeline.device import DeviceDecoder, EncodedBatch, prepare
    from remote_loader.pipeline.device.place import _resolved  # where it decodes, starting nothing

    on_gpu = spec["device"] == "cuda"
    datas = _jpegs(spec, IN_MEMORY if on_gpu else GPU_BATCH)
    crop, rng = RandomResizedCrop(224), np.random.default_rng(0)
    place = _resolved(spec["device"], True)
    assert place is not None
    decoder = DeviceDecoder(crop, place)
    for _ in range(4 if on_gpu else 1):
        for first in range(0, len(datas), GPU_BATCH):
            chunk = datas[first : first + GPU_BATCH]
            if spec["decoder"] == "torchvision":
                images = torchvision_augment(chunk)
            else:
                batch = EncodedBatch([prepare(crop, d, rng, str(i), "memory") for i, d in enumerate(chunk)])
                batch = batch.pin_memory() if on_gpu else batch
                images, _ = decoder.decode(batch)
            yield images, [0] * len(chunk)


def raw(spec: dict[str, Any]) -> Any:
    """nvImageCodec alone: whole batches of ``IN_MEMORY`` JPEGs (four times over), one decode
    call each, into the GPU's memory; ``load``: the share of each batch the hardware decoder
    takes (the rest goes to the hybrid CUDA decoder), None for the hardware decoder alone."""
    import torch

    from remote_loader import rank_cores
    from remote_loader.pipeline.device import nvimgcodec

    module = nvimgcodec()
    kinds = module.BackendKind
    on_gpu = spec["device"] == "cuda"
    if not on_gpu:
        backends = [module.Backend(kinds.CPU_ONLY)]
    elif spec["load"] is None:
        backends = [module.Backend(kinds.HW_GPU_ONLY)]
    else:
        backends = [module.Backend(kinds.HW_GPU_ONLY, load_hint=spec["load"]), module.Backend(kinds.HYBRID_CPU_GPU)]
    device_id = torch.cuda.current_device() if on_gpu else module.NVIMGCODEC_DEVICE_CPU_ONLY
    decoder = module.Decoder(device_id=device_id, max_num_cpu_threads=rank_cores(), backends=backends)
    params = module.DecodeParams(apply_exif_orientation=False, sample_format=module.SampleFormat.P_RGB)
    datas = _jpegs(spec, IN_MEMORY if on_gpu else GPU_BATCH)
    streams = [module.CodeStream(d) for d in datas]
    for _ in range(4 if on_gpu else 1):
        for first in range(0, len(streams), GPU_BATCH):
            images = decoder.decode(streams[first : first + GPU_BATCH], params=params)
            if any(image is None for image in images):
                raise RuntimeError(f"nvImageCodec could not decode {sum(i is None for i in images)} of a batch")
            yield images, [0] * len(images)


# ---------------------------------------------------------------------------- DALI


def dali_index(target: Any, prefix: str, folder: Path) -> None:
    """Each WebDataset shard's JPEG members (offset, size) and labels, from the shards in the
    bucket, into ``folder / DALI_INDEX``: what ``wds2idx`` gives DALI's own reader."""
    import io
    import tarfile

    s3 = target.boto3()
    listing = s3.list_objects_v2(Bucket=target.bucket, Prefix=f"{prefix}/")
    shards = []
    for key in sorted(o["Key"] for o in listing.get("Contents", []) if o["Key"].endswith(".tar")):
        data = s3.get_object(Bucket=target.bucket, Key=key)["Body"].read()
        members: dict[str, dict[str, Any]] = {}
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar:
                stem, _, ext = member.name.partition(".")
                if ext == "jpg":
                    members.setdefault(stem, {})["jpg"] = (member.offset_data, member.size)
                elif ext == "cls":
                    start = member.offset_data
                    members.setdefault(stem, {})["cls"] = int(data[start : start + member.size])
        shards.append([key, [[*m["jpg"], m["cls"]] for _, m in sorted(members.items())]])
    (folder / DALI_INDEX).write_text(json.dumps(shards))


class DaliShards:
    """DALI's parallel external source (batch mode): batch ``i`` of the epoch, read from the
    bucket with one boto3 client per worker process, one ranged GET per shard the batch
    touches; the epoch is the shards in a seeded order, their samples in order."""

    def __init__(self, spec: dict[str, Any], bucket: str, seed: int = 0) -> None:
        shards = json.loads((Path(spec["images"]) / DALI_INDEX).read_text())
        random.Random(seed).shuffle(shards)
        self.samples = [(key, offset, size, label) for key, members in shards for offset, size, label in members]
        self.target = (spec["endpoint"], spec["access_key"], spec["secret_key"], bucket)
        self._client: Any = None

    def __call__(self, info: Any) -> Any:
        import numpy as np

        first = info.iteration * GPU_BATCH
        if first >= len(self.samples):
            raise StopIteration
        if self._client is None:  # in the worker process
            import systems

            self._client = systems.Target(self.target[0], self.target[3], *self.target[1:3]).boto3()
        chosen = self.samples[first : first + GPU_BATCH]
        jpegs, labels, k = [], [], 0
        while k < len(chosen):
            key, start = chosen[k][0], chosen[k][1]
            end = k
            while end + 1 < len(chosen) and chosen[end + 1][0] == key:
                end += 1
            stop = chosen[end][1] + chosen[end][2]
            body = self._client.get_object(Bucket=self.target[3], Key=key, Range=f"bytes={start}-{stop - 1}")
            data = np.frombuffer(body["Body"].read(), dtype=np.uint8)
            for _, offset, size, label in chosen[k : end + 1]:
                jpegs.append(data[offset - start : offset - start + size])
                labels.append(np.array([label], dtype=np.int64))
            k = end + 1
        return jpegs, labels


class DaliMemory:
    """The same external source over ``IN_MEMORY`` JPEGs held in memory, four times over."""

    def __init__(self, spec: dict[str, Any], on_gpu: bool) -> None:
        import numpy as np

        self.jpegs = [np.frombuffer(d, dtype=np.uint8) for d in _jpegs(spec, IN_MEMORY if on_gpu else GPU_BATCH)]
        self.passes = 4 if on_gpu else 1

    def __call__(self, info: Any) -> Any:
        import numpy as np

        per_pass = -(-len(self.jpegs) // GPU_BATCH)
        if info.iteration >= per_pass * self.passes:
            raise StopIteration
        first = (info.iteration % per_pass) * GPU_BATCH
        chosen = self.jpegs[first : first + GPU_BATCH]
        return chosen, [np.array([0], dtype=np.int64)] * len(chosen)


def dali(spec: dict[str, Any], bucket: str) -> Any:
    """DALI's training pipeline (see the module's docstring), iterated as its PyTorch plugin
    does: ``threads`` CPU threads, ``workers`` Python worker processes for the source."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import pipeline_def
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    on_gpu = spec["device"] == "cuda"
    source = DaliShards(spec, bucket) if spec["source"] == "bucket" else DaliMemory(spec, on_gpu)
    parallel = spec["source"] == "bucket"

    @pipeline_def(batch_size=GPU_BATCH, num_threads=spec["threads"], device_id=0 if on_gpu else None,
                  py_num_workers=spec["workers"] if parallel else 1, py_start_method="spawn")
    def pipeline() -> Any:
        jpegs, labels = fn.external_source(source=source, num_outputs=2, batch=True, batch_info=True,
                                           parallel=parallel, **({"prefetch_queue_depth": 2} if parallel else {}))
        images = fn.decoders.image_random_crop(jpegs, device="mixed" if on_gpu else "cpu", output_type=types.RGB,
                                               random_aspect_ratio=[3 / 4, 4 / 3], random_area=[0.08, 1.0],
                                               num_attempts=100)
        images = fn.resize(images, resize_x=224, resize_y=224, interp_type=types.INTERP_TRIANGULAR)
        mirror = fn.random.coin_flip(probability=0.5)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", crop=(224, 224),
                                          mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD], mirror=mirror)
        return images, labels.gpu() if on_gpu else labels

    built = pipeline()
    built.build()
    batches = DALIGenericIterator([built], ["images", "labels"], last_batch_policy=LastBatchPolicy.PARTIAL)
    for out in batches:
        yield out[0]["images"], out[0]["labels"].view(-1)


# ---------------------------------------------------------------------------- training


class Trainer:
    """torchvision's ResNet-50 in ``channels_last``, one SGD step on each batch with bf16
    autocast: forward, cross-entropy, backward, step. Takes uint8 crops (normalised here)
    or normalised floats."""

    def __init__(self, device: str) -> None:
        import torch
        import torchvision

        self.device = torch.device(device)
        self.model = torchvision.models.resnet50().to(self.device, memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.mean = torch.tensor(MEAN, device=self.device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=self.device).view(1, 3, 1, 1) * 255

    def __call__(self, images: Any, labels: Any) -> None:
        import torch

        if images.dtype == torch.uint8:
            images = (images.float() - self.mean) / self.std
        images = images.to(self.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        target = torch.as_tensor(labels, device=self.device).long() % 1000
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(self.model(images), target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def model(spec: dict[str, Any], steps: int) -> Any:
    """One fixed batch, ``steps`` times: the training step's own rate, with nothing to load."""
    import torch

    images = torch.randn(GPU_BATCH, 3, 224, 224, device=spec["device"])
    labels = torch.randint(0, 1000, (GPU_BATCH,), device=spec["device"])
    for _ in range(steps):
        yield images, labels
