"""Metadata at scale: 10M samples in 10k shards open and serve random reads in little memory."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from remote_loader import LocalStore
from remote_loader.format import Manifest, ShardEntry, ShardWriter

ROOT = Path(__file__).resolve().parents[2]
SHARDS, PER_SHARD = 10_000, 1_000


def build(tmp_path: Path) -> list[int]:
    """A manifest of 10k shards of 1,000 tiny samples; only the 100 shards read exist as objects."""
    out = io.BytesIO()
    writer = ShardWriter(out.write)
    for i in range(PER_SHARD):
        writer.add(f"{i:07d}", {"cls": str(i % 1000).encode()})
    summary = writer.close()
    store = LocalStore(tmp_path)
    store.create_bucket("big")
    entries = tuple(ShardEntry.from_summary(f"shard-{s:06d}.tar", summary) for s in range(SHARDS))
    store.put("big", "ds/manifest.msgpack", Manifest(shards=entries, fields=("cls",)).encode())
    chosen = sorted(int(s) for s in np.random.default_rng(0).choice(SHARDS, 100, replace=False))
    for s in chosen:
        store.put("big", f"ds/shard-{s:06d}.tar", out.getvalue())
    return chosen


def test_ten_million_samples_open_and_read_in_under_50_mb(tmp_path):
    chosen = build(tmp_path)
    script = textwrap.dedent(
        f"""
        import gc, os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from remote_loader import LocalStore
        from remote_loader.mapstyle.dataset import RemoteMapDataset

        def rss():
            gc.collect()
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        before = rss()
        ds = RemoteMapDataset(LocalStore({str(tmp_path)!r}), "big", "ds")
        assert len(ds) == {SHARDS * PER_SHARD}
        for shard in {chosen!r}:
            for j in (0, 499, 999):
                sample = ds[shard * {PER_SHARD} + j]
                assert sample["cls"] == str(j).encode(), sample
        print(rss() - before)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    growth = int(result.stdout.strip())
    print(f"RSS growth: {growth / 2**20:.1f} MB")
    assert growth < 50 * 2**20, f"RSS grew by {growth / 2**20:.1f} MB"
