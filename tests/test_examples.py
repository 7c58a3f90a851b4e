"""Every example in examples/ runs in its smoke mode (--local-server) and checks what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, str(EXAMPLES / name), "--local-server", *args],
                            capture_output=True, text=True, timeout=timeout, cwd=EXAMPLES.parent)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def json_line(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))


def test_upload_imagefolder_round_trips_every_file():
    report = json.loads(run_example("upload_imagefolder.py", "--images", "60", "--json").stdout)
    assert report["files"] == report["samples"] == report["identical"] == 60
    assert report["classes"] == 4 and report["shards"] == 2


def test_train_ddp_resumes_mid_epoch_with_every_sample_once():
    result = run_example("train_ddp.py", "--images", "128", "--stop-after", "3")
    assert "stopping in epoch 0 after 3 steps" in result.stdout
    assert "in epoch 0, saved by 2 ranks x 2 workers" in result.stdout
    try:
        import torchdata.stateful_dataloader  # noqa: F401
    except ImportError:  # counted positions: the same ranks and workers
        assert "2 rank(s) x 2 DataLoader worker(s) (DataLoader)" in result.stdout
    else:  # the rest of the epoch divided among other ranks and workers
        assert "1 rank(s) x 1 DataLoader worker(s) (StatefulDataLoader)" in result.stdout
    report = json_line(result.stdout)
    assert report == {"epochs": 2, "samples": 128, "exactly_once": {"0": True, "1": True}}


def test_random_access_splits_ranks_exactly_once():
    report = json_line(run_example("random_access.py", "--images", "60").stdout)
    assert report["per_rank"] == [30, 30]
    assert report["exactly_once"] and report["identical_probes"]


def test_cortx_style_streams_an_epoch_of_crops():
    result = run_example("cortx_style.py", "--images", "70")
    assert "70 images in 2 batches of up to 64, each [(3, 224, 224)] float tensors; dataset has 70" in result.stdout


@pytest.mark.parametrize("name", ["upload_imagefolder.py", "train_ddp.py", "random_access.py", "cortx_style.py"])
def test_examples_explain_themselves(name):
    result = subprocess.run([sys.executable, str(EXAMPLES / name), "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "--local-server" in result.stdout and "--url" in result.stdout
