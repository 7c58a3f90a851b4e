#!/usr/bin/env bash
# The node benchmark, from its offline bundle (benchmarks/node/bundle.py builds it):
#
#     bash run.sh [--images 20000] [--out DIR] [--budget 280]      # run.py's options
#
# Unpacks the wheels, SeaweedFS's binary and the source next to it (once), then runs
# benchmarks/node/run.py (its smoke check first) with the Python that has torch (PYTHON, default python3).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="${NODE_BENCH_WORK:-$HERE/work}"
"$PYTHON" - "$HERE" "$WORK" <<'PY'
import lzma, os, shutil, sys, tarfile
here, work = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(work, "bin"), exist_ok=True)
for archive, folder in (("site.tar.xz", "site"), ("src.tar", "src")):
    if not os.path.isdir(os.path.join(work, folder)):
        with tarfile.open(os.path.join(here, archive)) as tar:
            tar.extractall(work, filter="data")
weed = os.path.join(work, "bin", "weed")
if not os.path.exists(weed):
    with lzma.open(os.path.join(here, "weed.xz")) as source, open(weed + ".part", "wb") as sink:
        shutil.copyfileobj(source, sink, 1 << 20)
    os.chmod(weed + ".part", 0o755)
    os.replace(weed + ".part", weed)
PY
# nvJPEG comes in the bundle (the nvidia-nvjpeg wheel), where nvImageCodec finds it; its folder is
# named here too, for a loader that looks only there.
export LD_LIBRARY_PATH="$WORK/site/nvidia/nvjpeg/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$WORK/src:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$WORK/bin:$WORK/site/bin:$PATH"
export REMOTE_LOADER_BENCH_PHOTOS="$HERE/photos"
export NODE_BENCH_COMMIT="$(cat "$HERE/commit" 2>/dev/null || true)"
exec "$PYTHON" "$WORK/src/benchmarks/node/run.py" "$@"
