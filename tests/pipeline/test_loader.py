"""``loader()``: a DataLoader sized from the cores a rank may use, and ``rank_cores()``."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from remote_loader import ConfigError, RemoteDataset, loader, rank_cores
from remote_loader.pipeline.run import loader as loader_module
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload_to_new_bucket

N = 90


@pytest.fixture(scope="module")
def keys(seaweed):
    client = seaweed.client()
    upload_to_new_bucket(client, "loader-tests", "d", SyntheticImages(N, size=(32, 24)), maxcount=20)
    yield RemoteDataset(client, "loader-tests", "d", seed=2).shuffle(30).to_tuple("__key__").batched(8)
    client.close()


def test_rank_cores_takes_the_affinity_the_quota_and_the_ranks_sharing_the_node(tmp_path):
    missing = str(tmp_path / "none")
    assert rank_cores({}, cgroup=missing) == len(os.sched_getaffinity(0))  # this process, as it runs
    node = {"cgroup": missing, "cpuset": missing, "machine": 128}
    assert rank_cores({}, allowed=128, **node) == 128
    assert rank_cores({"LOCAL_WORLD_SIZE": "8"}, allowed=128, **node) == 16  # 8 ranks share the node
    assert rank_cores({"LOCAL_WORLD_SIZE": "8"}, allowed=16, **node) == 16  # an affinity of its own: all of it
    assert rank_cores({"LOCAL_WORLD_SIZE": "256"}, allowed=128, **node) == 1
    quota = tmp_path / "cpu.max"
    quota.write_text("1550000 100000\n")  # a container allowed 15.5 cores
    assert rank_cores({}, cgroup=str(quota), cpuset=missing, allowed=128, machine=128) == 16
    assert rank_cores({"LOCAL_WORLD_SIZE": "2"}, cgroup=str(quota), allowed=128, machine=128) == 8
    quota.write_text("max 100000\n")
    assert rank_cores({}, cgroup=str(quota), allowed=128, machine=128) == 128
    # A container (Docker --cpuset-cpus, Kubernetes' static CPU manager, a Slurm job) holding 32 of
    # the machine's 64 cores, its 8 ranks sharing them: 4 each, not 32.
    cpus = tmp_path / "cpuset.cpus.effective"
    cpus.write_text("0-15,32-47\n")
    assert rank_cores({"LOCAL_WORLD_SIZE": "8"}, cgroup=missing, cpuset=str(cpus), allowed=32) == 4
    assert rank_cores({"LOCAL_WORLD_SIZE": "8"}, cgroup=missing, cpuset=str(cpus), allowed=4) == 4  # bound per rank
    cpus.write_text("0-15\n")  # an 8-core quota in a 16-core cpuset, 4 ranks: 2 each, not 8
    quota.write_text("800000 100000\n")
    assert rank_cores({"LOCAL_WORLD_SIZE": "4"}, cgroup=str(quota), cpuset=str(cpus), allowed=16) == 2
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE must be an integer, got 'two'"):
        rank_cores({"LOCAL_WORLD_SIZE": "two"}, cgroup=missing)


def test_the_loader_fills_the_ranks_cores_with_persistent_workers_and_gives_each_epoch_whole(keys):
    stream = loader(keys.map(_same))
    assert isinstance(stream, DataLoader)
    assert stream.num_workers == rank_cores() and stream.batch_size is None and stream.persistent_workers
    epochs = [[key for (batch,) in stream for key in batch] for _ in range(2)]
    for keys_ in epochs:
        assert Counter(keys_) == Counter(f"{i:06d}" for i in range(N))
    assert epochs[0] != epochs[1]  # each pass takes the next epoch


def _same(batch):
    return batch


_FORKED = """
import json, os, sys
from remote_loader import RemoteDataset, loader, make_client
endpoint, access, secret, stateful = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
ds = RemoteDataset(make_client(endpoint, access, secret), "loader-tests", "d", seed=2).shuffle(30).to_tuple("__key__")
stream = loader(ds.batched(8), num_workers=1, stateful=stateful)
if stateful:
    stream.state_dict()  # before the first pass, as a checkpoint at step 0 takes it
keys = lambda: sorted(key for (batch,) in stream for key in batch)
first, parents = keys(), [w.pid for w in stream._iterator._workers]
read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:  # a plain fork, which exits as a script does: multiprocessing's exit handlers run
    os.close(read_end)
    seen, its_own = keys(), [w.pid for w in stream._iterator._workers]
    os.write(write_end, json.dumps([seen == first, its_own]).encode())
    sys.exit(0)
os.close(write_end)
child = json.loads(os.read(read_end, 1 << 16))
_, status = os.waitpid(pid, 0)
print(json.dumps([len(first), child, status, parents, keys() == first, [w.pid for w in stream._iterator._workers]]))
"""


@pytest.mark.parametrize("stateful", [False, True])
def test_a_plain_fork_of_a_loader_with_persistent_workers_starts_its_own_and_leaves_the_parents(seaweed, keys,
                                                                                               stateful):
    """In a process of its own, so the fork has no other test's threads; the fork exits as a
    script does, whose exit would have ended the parent's workers."""
    if stateful:
        pytest.importorskip("torchdata")
    done = subprocess.run([sys.executable, "-c", _FORKED, seaweed.endpoint_url, seaweed.access_key,
                           seaweed.secret_key, "1" if stateful else "0"], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "can only" not in done.stderr and "killed by signal" not in done.stderr, done.stderr[-3000:]
    count, (same, its_own), status, parents, again, workers_after = json.loads(done.stdout.strip().splitlines()[-1])
    assert count == N and same and status == 0 and not set(its_own) & set(parents)
    assert again and workers_after == parents  # the parent's workers serve it still


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # torch's: more workers than this machine's cores
def test_a_pipeline_that_streams_bytes_gets_a_few_workers_and_one_that_runs_code_per_sample_one_a_core(
        keys, seaweed, monkeypatch):
    """Workers that only fetch (pick fields, batch) stream tens of thousands of samples a second
    each, and each holds a shuffle buffer and shard ranges: on a node's 16 cores, 4 of them. A
    per-sample function of the user's, or a decode on the CPU, may need every core."""
    monkeypatch.setattr(loader_module, "rank_cores", lambda: 16)
    client = seaweed.client()
    plain = RemoteDataset(client, "loader-tests", "d", seed=2)
    assert loader(keys).num_workers == 4  # to_tuple + batched
    assert loader(plain).num_workers == 4  # no stage at all
    assert loader(keys, num_workers=16).num_workers == 16  # asked for: given
    for heavier in (keys.map(_same), keys.select(bool), plain.decode("pil").to_tuple("jpg").batched(8),
                    plain.to_tuple("jpg", "cls").map_tuple(len, None).batched(8)):
        assert loader(heavier).num_workers == 16, heavier.stages
    client.close()
    monkeypatch.setattr(loader_module, "rank_cores", lambda: 2)
    assert loader(keys).num_workers == 2  # never more than the rank's cores


def test_the_loader_takes_any_dataloader_argument_and_a_stateful_one(keys):
    plain = loader(keys, num_workers=0, pin_memory=False)
    assert plain.num_workers == 0 and not plain.persistent_workers
    assert sum(len(batch[0]) for batch in plain) == N
    with pytest.raises(ConfigError, match="num_workers must be"):
        loader(keys, num_workers=-1)
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        stateful = loader(keys, num_workers=1, stateful=True)
    assert not [w for w in said if "set_vital" in str(w.message)]  # torchdata's, printed on every run before
    assert isinstance(stateful, StatefulDataLoader) and stateful.persistent_workers
    it = iter(stateful)
    next(it)
    assert "remote_loader_state" in str(stateful.state_dict())


def test_a_stateful_loader_out_of_order_is_refused(keys):
    """Out of order, a StatefulDataLoader's snapshot does not say which items came out: a
    resume repeated 2 samples of 241 and lost 2, with torchdata's generic warning only."""
    pytest.importorskip("torchdata")
    with pytest.raises(ConfigError, match="stateful=True with in_order=False: a StatefulDataLoader's state needs"):
        loader(keys, num_workers=2, stateful=True, in_order=False)
    assert loader(keys, num_workers=0, stateful=True, in_order=False).num_workers == 0  # no workers: in order


def test_a_stateful_loader_without_torchdata_names_the_extra(keys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)  # as if it were not installed
    with pytest.raises(ConfigError, match="install the torchdata extra"):
        loader(keys, stateful=True)


def test_decoded_on_says_cpu_where_the_workers_decode(keys):
    """``loader(ds).decoded_on`` on every loader: ``"CPU"`` for a pipeline whose workers decode,
    ``decode(..., device="auto")`` without a GPU among them (a plain DataLoader came back, without it)."""
    from remote_loader import RandomResizedCrop, decode_batches

    base = RemoteDataset(keys.reader.client, "loader-tests", "d", seed=2)
    auto = base.decode(RandomResizedCrop(16), device="auto").to_tuple("jpg", "cls").batched(8)
    if auto.batch_decoder() is not None:
        pytest.skip("this machine decodes on a GPU: device='auto' does not fall back")
    made = loader(auto, num_workers=0)
    assert isinstance(made, DataLoader) and made.decoded_on == "CPU"
    images, _ = next(iter(made))
    assert images.shape == (8, 3, 16, 16)
    assert loader(keys, num_workers=0).decoded_on == "CPU"
    mine = DataLoader(auto, batch_size=None)
    handed_back = decode_batches(mine, auto)
    assert handed_back is mine and handed_back.decoded_on == "CPU"
    pytest.importorskip("torchdata")
    assert loader(auto, num_workers=0, stateful=True).decoded_on == "CPU"


def _with_strategy(batch):
    import torch.multiprocessing

    return batch, torch.multiprocessing.get_sharing_strategy()


def test_a_dataloader_of_your_own_keeps_torch_s_sharing_strategy_in_its_workers(keys):
    import torch.multiprocessing

    before = torch.multiprocessing.get_sharing_strategy()
    stream = DataLoader(keys.map(_with_strategy), batch_size=None, num_workers=2)
    assert {strategy for _, strategy in stream} == {before}
    assert torch.multiprocessing.get_sharing_strategy() == before


def _strategy_code(pair):
    import torch.multiprocessing

    return pair[0], int(torch.multiprocessing.get_sharing_strategy() == "file_system")


@pytest.mark.parametrize("decoding, persistent, by_name", [
    ("thread", True, True),  # this process decodes: its workers hand tensors over by name
    ("thread", False, False),  # a pass cut short would leave their memory behind
    ("process", True, False),  # the decoding process receives them, beside no Python of yours
])
def test_loader_s_workers_hand_tensors_over_by_name_where_this_process_decodes(seaweed, decoding, persistent,
                                                                                by_name):
    from remote_loader import RandomResizedCrop
    from tests.helpers import require_nvimagecodec

    require_nvimagecodec()
    client = seaweed.client()
    bucket = f"by-name-{decoding}-{int(persistent)}"
    upload_to_new_bucket(client, bucket, "d", SyntheticImages(16, size=(32, 24)), maxcount=8)
    ds = (RemoteDataset(client, bucket, "d", seed=0).decode(RandomResizedCrop(16), device="cpu", batched=True)
          .to_tuple("jpg", "cls").map(_strategy_code).batched(8))
    stream = loader(ds, num_workers=1, decoding=decoding, persistent_workers=persistent)
    codes = [int(code) for _, codes in stream for code in codes]
    assert codes == [int(by_name)] * 16
    stream.close()
    client.close()


_FREED_BLOCKS = textwrap.dedent("""
    import ctypes, ctypes.util
    from torch.utils.data import DataLoader
    from remote_loader import RemoteDataset, make_client

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = Mallinfo2

    def unmapped(batch):
        # Whether this process gives a 1 MiB block a mapping of its own (returned when freed) even
        # after a 16 MiB block was freed, which raises glibc's threshold unless it is fixed. The
        # dataset's shards are a few KB: no other block of this size comes or goes meanwhile.
        large = bytearray(16 << 20)  # under glibc's 32 MiB ceiling on the threshold it raises
        del large
        before = libc.mallinfo2().hblkhd
        block = bytearray(1 << 20)
        mapped = libc.mallinfo2().hblkhd - before >= 1 << 20
        del block
        return mapped

    client = make_client(*sys.argv[1:4])
    keys = RemoteDataset(client, "loader-tests", "d", seed=2).to_tuple("__key__")
    ds = keys.batched(8).map(unmapped)
    streams = keys.batched(8, unmapped)  # bytes only: the probe is its collation_fn
    print(set(ds), set(DataLoader(ds, batch_size=None, num_workers=1)),
          set(DataLoader(streams, batch_size=None, num_workers=1)), set(ds))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(ctypes.util.find_library("c")),
                    "mallinfo2"), reason="glibc's mallinfo2 (2.33+) tells where a block lies")
def test_a_decoding_worker_gives_each_large_block_back_when_freed_and_the_training_process_keeps_its_allocator(
        keys, seaweed):
    """A decode's large temporaries freed between the shuffle buffer's samples left holes that
    grew a worker's heap for as long as it ran (755 MB a worker against 254 MB): a worker that
    runs more than picking fields and batching maps each block of 256 KiB or more on its own.
    One that only streams bytes keeps glibc's own threshold, and so does the process that
    trains, before and after its workers ran (a fresh process: tests here play workers in this one)."""
    done = subprocess.run([sys.executable, "-c", "import sys\n" + _FREED_BLOCKS, seaweed.endpoint_url,
                           seaweed.access_key, seaweed.secret_key], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["{False}", "{True}", "{False}", "{False}"]


_ORPHANED = """
import os, sys
from remote_loader import loader
ready, gate = int(sys.argv[1]), sys.argv[2]

def starting(worker_id):  # a worker slow to start (spawned, importing torch): its process is killed meanwhile
    os.write(ready, str(os.getpid()).encode())
    with open(gate) as held:
        held.read()

for _ in loader(list(range(4)), num_workers=1, worker_init_fn=starting):
    pass
"""


@pytest.mark.parametrize("stateful", [False, True])
def test_a_worker_whose_process_is_killed_before_it_has_started_ends_too(tmp_path, stateful):
    """torch's worker notes its parent's pid once it has started (its watchdog); a parent
    killed before then (by the OOM killer, or a decoding process ended while its workers
    start) leaves a worker that records pid 1 as its parent and waits for work for ever."""
    if stateful:
        pytest.importorskip("torchdata")
    script = _ORPHANED.replace("num_workers=1", "num_workers=1, stateful=True") if stateful else _ORPHANED
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    ready_read, ready_write = os.pipe()
    process = subprocess.Popen([sys.executable, "-c", script, str(ready_write), str(gate)], pass_fds=(ready_write,),
                               cwd=Path(__file__).resolve().parents[2])
    os.close(ready_write)
    worker = None
    try:
        worker = int(os.read(ready_read, 16))  # the worker's pid, written once it is in its worker_init_fn
        os.close(ready_read)
        ended = os.pidfd_open(worker)
        process.kill()
        process.wait(timeout=60)
        try:  # the gate opened, if the worker still waits there
            os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader: the worker has ended already
        assert select.select([ended], [], [], 60)[0], f"worker {worker} lives on after its process was killed"
        os.close(ended)
    finally:
        process.kill()
        process.wait(timeout=60)
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
