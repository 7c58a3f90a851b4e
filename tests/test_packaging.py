"""The package builds as it would be published: an sdist and a wheel, with no warning from
the build backend, carrying the license, the type marker and the console script."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_sdist_and_wheel_build_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run([sys.executable, "-m", "build", "--outdir", str(tmp_path), str(ROOT)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    noisy = [
        line for line in (out.stdout + out.stderr).splitlines() if "warn" in line.lower() or "deprecat" in line.lower()
    ]
    assert not noisy, noisy
    wheel = next(tmp_path.glob("remote_loader-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        scripts = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "remote_loader/py.typed" in names and any(n.endswith("licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata and "remote-loader = remote_loader.cli:main" in scripts
    assert not any(n.startswith("tests/") for n in names)
    with tarfile.open(next(tmp_path.glob("remote_loader-*.tar.gz"))) as sdist:
        assert any(n.endswith("/LICENSE") for n in sdist.getnames())
