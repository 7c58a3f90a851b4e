"""Plain tars streamed without an index (``unindexed=True``): every tar's samples, once."""

from __future__ import annotations

import io
import tarfile
from collections import Counter

import pytest
from torch.utils.data import DataLoader

from remote_loader import LocalStore, RemoteDataset


def tar_of(keys: list[str], size: int = 100) -> bytes:
    """A tar as tarfile (WebDataset's TarWriter) writes it: one ``.txt`` member a sample."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for key in keys:
            info = tarfile.TarInfo(f"{key}.txt")
            info.size = size
            tar.addfile(info, io.BytesIO(key.encode().ljust(size, b".")))
    return buffer.getvalue()


def keys_of(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{j:03d}" for j in range(count)]


def delivered(ds: RemoteDataset, num_workers: int = 0) -> Counter[str]:
    return Counter(s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=num_workers))


# --------------------------------------------------------------------------- every tar, once


@pytest.mark.parametrize("open_shards", [1, 2, 4])
def test_every_tar_is_read_whatever_the_tars_read_at_once(tmp_path, open_shards):
    store = LocalStore(tmp_path)
    store.create_bucket("b")
    for t in range(6):
        store.put("b", f"ds/s{t}.tar", tar_of(keys_of(f"t{t}-", 3 + t)))
    ds = RemoteDataset(store, "b", "ds", unindexed=True, open_shards=open_shards, seed=5)
    assert delivered(ds) == Counter(key for t in range(6) for key in keys_of(f"t{t}-", 3 + t))
