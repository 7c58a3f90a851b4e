"""torchvision imports in a plain process of this environment, as in a user's script: the
tv_tensors blocks of docs/targets.md and the tests of torchvision's dataset classes need it
there, not only inside the test process. What makes it import (``make`` installs
tools/remote_loader_torchvision_ops.py where torchvision's C++ operators cannot load beside
this torch) costs a process that never imports torchvision nothing: torch stays unloaded."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

_USER_SCRIPT = """
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

boxes = tv_tensors.BoundingBoxes(torch.tensor([[4.0, 6.0, 40.0, 30.0]]), format="XYXY", canvas_size=(64, 96))
print(type(v2.RandomHorizontalFlip(p=1)(boxes)).__name__)
"""


def test_torchvision_and_its_tv_tensors_import_in_a_fresh_interpreter():
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed here")
    done = subprocess.run([sys.executable, "-c", _USER_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "BoundingBoxes\n"


def test_an_interpreter_that_never_imports_torchvision_loads_no_torch():
    loaded = "import sys; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    done = subprocess.run([sys.executable, "-c", loaded], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n"


def test_the_makefile_takes_the_torchvision_the_vision_extra_pins():
    import tomllib  # Python 3.11+

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = re.search(r"^TORCHVISION := (\S+)$", (root / "Makefile").read_text(), re.M)
    assert pinned and [pinned.group(1)] == extras["vision"]
