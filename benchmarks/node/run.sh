#!/usr/bin/env bash
# The node benchmark, from its offline bundle (benchmarks/node/bundle.py builds it):
#
#     bash run.sh [--images 20000] [--out DIR] [--budget 280]      # run.py's options
#
# Unpacks the wheels, SeaweedFS's binary and the source next to it (once), and DALI where its
# parts are beside the bundle (build/node-dali), then runs benchmarks/node/run.py (its smoke
# check first) with the Python that has torch (PYTHON, default python3).
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
# DALI, where its parts were carried here (bundle.py --dali; each part in a call of its own):
# unpacked once, beside them, when every part is there.
DALI="${NODE_BENCH_DALI:-$HERE/../node-dali}"
DALI_SITE=""
if [ -f "$DALI/parts" ]; then
    DALI_SITE="$("$PYTHON" - "$DALI" <<'PY'
import lzma, os, sys, tarfile
folder = sys.argv[1]
count = int(open(os.path.join(folder, "parts")).read())
parts = [os.path.join(folder, f"dali.tar.xz.part-{k}") for k in range(1, count + 1)]
site = os.path.join(folder, "dali")
if not os.path.isdir(site):
    missing = [os.path.basename(p) for p in parts if not os.path.exists(p)]
    if missing:
        print(f"DALI: {', '.join(missing)} not here yet: its rows are left out", file=sys.stderr)
        sys.exit(0)

    class Joined:  # the parts as one stream
        def __init__(self):
            self.files = iter(parts)
            self.current = open(next(self.files), "rb")

        def read(self, size=-1):
            while True:
                data = self.current.read(size)
                if data or size == 0:
                    return data
                self.current.close()
                name = next(self.files, None)
                if name is None:
                    return b""
                self.current = open(name, "rb")

    with lzma.open(Joined()) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        tar.extractall(folder + ".part", filter="data")
    os.replace(os.path.join(folder + ".part", "dali"), site)
print(site)
PY
)"
fi
# nvJPEG comes in the bundle (the nvidia-nvjpeg wheel), where nvImageCodec finds it; its folder is
# named here too, for a loader that looks only there.
export LD_LIBRARY_PATH="$WORK/site/nvidia/nvjpeg/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -n "$DALI_SITE" ]; then  # DALI loads nvImageCodec and nvCOMP by name, not from beside itself
    export LD_LIBRARY_PATH="$WORK/site/nvidia/nvimgcodec:$DALI_SITE/nvidia/libnvcomp/lib64:$LD_LIBRARY_PATH"
fi
export PYTHONPATH="$WORK/src:$WORK/site${DALI_SITE:+:$DALI_SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$WORK/bin:$WORK/site/bin:$PATH"
export REMOTE_LOADER_BENCH_PHOTOS="$HERE/photos"
export NODE_BENCH_COMMIT="$(cat "$HERE/commit" 2>/dev/null || true)"
exec "$PYTHON" "$WORK/src/benchmarks/node/run.py" "$@"
