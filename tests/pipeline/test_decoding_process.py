"""The decoding process (``loader()`` of a device pipeline, ``decoding="process"``), through
nvImageCodec's CPU backend: the process that iterates never decodes; what the decoding
process raises, warns and logs arrives here as its own; a killed process is named and a
stateful loader resumes past it exactly; a pipeline that does not pickle is decoded here;
one iteration at a time; a process is reused by the next loader; a forked copy starts
its own and leaves its parent's alone (a plain ``os.fork`` too); Ctrl-C gets through while
a batch is awaited; ``close()`` ends a stopped process; the rank torch.distributed set up here reaches it."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

from remote_loader import ConfigError, RandomResizedCrop, RemoteDataset, loader
from remote_loader.errors import DecoderExited
from remote_loader.pipeline.run import loader as loading
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import in_plain_fork, require_nvimagecodec, upload_to_new_bucket

N, OTHER = 48, 24


@pytest.fixture(autouse=True)
def decoding_process(monkeypatch):
    """``loader()`` and ``decode_batches()`` here decode in a process unless told otherwise
    (as on the CPU; on a GPU with DALI installed they would decode with it, in this process)."""
    monkeypatch.setattr(loading, "default_decoding", lambda device: "process")


@pytest.fixture(scope="module")
def client(seaweed):
    require_nvimagecodec()
    store = seaweed.client()
    upload_to_new_bucket(store, "decoding-process", "d", SyntheticImages(N, size=(64, 48)), maxcount=12)
    upload_to_new_bucket(store, "decoding-other", "d", SyntheticImages(OTHER, size=(64, 48), seed=5), maxcount=12)
    yield store
    store.close()


def pipeline(client, bucket="decoding-process", batch=8, rank=None, world_size=None, fn=None, crop=32):
    ds = RemoteDataset(client, bucket, "d", seed=3, rank=rank, world_size=world_size).shuffle(20)
    ds = ds.decode(RandomResizedCrop(crop), device="cpu", batched=True).to_tuple("jpg", "cls", "__key__")
    return (ds.map(fn) if fn is not None else ds).batched(batch)


def keys(batches):
    return [key for *_, ks in batches for key in ks]


EVERY = sorted(f"{i:06d}" for i in range(N))


def test_the_process_that_iterates_never_loads_the_decoder(client, seaweed):
    # Decoded here, every batch retakes this process's GIL many times: a Python thread of the
    # user's then starves it (benchmarks/beside_python.py: 0.02x of its rate alone).
    code = textwrap.dedent(f"""
        import sys
        from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client
        client = make_client({seaweed.endpoint_url!r}, {seaweed.access_key!r}, {seaweed.secret_key!r})
        ds = (RemoteDataset(client, "decoding-process", "d").decode(RandomResizedCrop(32), device="cpu", batched=True)
              .to_tuple("jpg", "cls").batched(8))
        batches = loader(ds, num_workers=1, decoding=sys.argv[1])
        print(sum(len(labels) for _, labels in batches), "nvidia.nvimgcodec" in sys.modules, batches.decoded_on)
    """)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for decoding, loaded in (("process", "False"), ("thread", "True")):
        done = subprocess.run([sys.executable, "-c", code, decoding], capture_output=True, text=True, timeout=300,
                              env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == [str(N), loaded, "CPU"], (decoding, done.stdout)


def test_a_killed_decoding_process_is_named_and_a_stateful_loader_resumes_past_it_exactly(client):
    pytest.importorskip("torchdata")
    whole = keys(loader(pipeline(client), num_workers=1))
    assert sorted(whole) == EVERY
    batches = loader(pipeline(client), num_workers=1, stateful=True)
    epoch = iter(batches)
    first = keys(itertools.islice(epoch, 2))
    pid = batches.pid
    assert pid is not None and pid != os.getpid()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(DecoderExited, match=rf"decoding process \(pid {pid}\) was ended by signal 9") as info:
        for batch in epoch:  # the batches it had sent before it was killed still come
            first += keys([batch])
    assert info.value.pid == pid and info.value.returncode == -signal.SIGKILL
    batches.load_state_dict(batches.state_dict())  # as of the last batch handed out
    rest = keys(batches)
    assert batches.pid != pid  # a new process
    assert len(first) >= 16 and rest and sorted(first + rest) == EVERY  # none lost, none twice


def warn_and_log(sample):
    warnings.warn("from the map, in the decoding process", UserWarning, stacklevel=1)
    logging.getLogger("remote_loader.tests").warning("a record from the decoding process")
    return sample


def test_warnings_and_log_records_of_the_decoding_process_are_this_processs(client, caplog):
    batches = loader(pipeline(client, fn=warn_and_log), num_workers=0)  # the pipeline runs in the decoding process
    with caplog.at_level(logging.WARNING, logger="remote_loader"), \
            pytest.warns(UserWarning, match="from the map, in the decoding process"):
        assert sorted(keys(batches)) == EVERY
    assert "a record from the decoding process" in caplog.messages


def test_a_pipeline_that_cannot_be_pickled_is_decoded_in_this_process(client, caplog):
    lock = threading.Lock()

    def holding_a_lock(sample):
        with lock:
            return sample

    batches = loader(pipeline(client, fn=holding_a_lock), num_workers=1)
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert sorted(keys(batches)) == EVERY
    assert any("cannot go to a decoding process (TypeError" in m for m in caplog.messages), caplog.messages
    assert batches.pid is None and batches.decoded_on == "CPU"


def test_an_iteration_begun_while_another_runs_ends_the_first(client):
    batches = loader(pipeline(client), num_workers=1)
    first = iter(batches)
    next(first)
    second = iter(batches)
    begun = keys([next(second)])
    with pytest.raises(ConfigError, match="began another iteration, which ended this one"):
        next(first)
    assert sorted(begun + keys(second)) == EVERY  # the second is a whole epoch


def test_a_process_left_by_a_collected_loader_serves_the_next_and_keeps_nothing_of_it(client):
    pytest.importorskip("torchdata")
    batches = loader(pipeline(client), num_workers=1, stateful=True)
    epoch = iter(batches)
    next(epoch)
    pid, state = batches.pid, batches.state_dict()
    del epoch, batches
    gc.collect()
    other = loader(pipeline(client, "decoding-other"), num_workers=1, stateful=True)
    assert other.pid == pid  # CUDA and the decoder started already
    assert sorted(keys(other)) == [f"{i:06d}" for i in range(OTHER)]  # its own dataset, from its start
    resumed = loader(pipeline(client), num_workers=1, stateful=True)
    resumed.load_state_dict(state)
    assert len(keys(resumed)) == N - 8


def shared_memory_fds():
    """How many of this process's file descriptors are open on shared memory (torch's segments)."""
    return sum(_link(f"/proc/self/fd/{fd}").startswith("/dev/shm/") for fd in os.listdir("/proc/self/fd"))


def _link(path):
    try:
        return os.readlink(path)
    except OSError:  # the listing's own descriptor, closed by now
        return ""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts file descriptors in /proc")
def test_sending_the_pipeline_each_pass_holds_no_file_descriptor_here(client):
    # Sharing the dataset's tensors hands a copy of each one's descriptor to multiprocessing's
    # resource sharer until the decoding process takes it: a pickle no process takes kept its
    # copies for good (4 a pass, the dataset's 4 shared tensors: a process ran out at ~250 passes).
    batches = loader(pipeline(client), num_workers=1, persistent_workers=False)  # sent every pass
    assert len(keys(batches)) == N
    held = shared_memory_fds()
    for _ in range(3):
        assert len(keys(batches)) == N
    assert shared_memory_fds() == held


def ended_within(pid, seconds):
    """Whether process ``pid`` (not a child of this one) ends within ``seconds``."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([handle], [], [], seconds)[0])
    finally:
        os.close(handle)


def _iterate_in_fork(batches, results):
    seen = sorted(keys(batches))
    results.put((os.getpid(), batches.pid, seen))


def test_a_forked_copy_of_a_loader_decodes_in_a_process_of_its_own_and_leaves_its_parents(client):
    batches = loader(pipeline(client), num_workers=1)
    assert sorted(keys(batches)) == EVERY
    parents = batches.pid
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_iterate_in_fork, args=(batches, results))
    child.start()
    forked, its_own, seen = results.get(timeout=120)
    child.join(timeout=60)
    assert its_own not in (parents, None) and forked != os.getpid()
    assert seen == EVERY
    assert ended_within(its_own, 60)  # its socket closed with the fork that started it
    assert batches.pid == parents and sorted(keys(batches)) == EVERY  # the parent's still serves it


def test_a_copy_made_by_a_plain_os_fork_decodes_in_a_process_of_its_own(client):
    batches = loader(pipeline(client), num_workers=1)
    assert sorted(keys(batches)) == EVERY  # the pipeline's tensors went to the parent's process by descriptor
    answer = in_plain_fork(lambda: (sorted(keys(batches)), batches.pid))  # no hook of multiprocessing runs there
    assert answer[0] == "ok", answer
    seen, its_own = answer[1]
    assert its_own not in (batches.pid, None) and seen == EVERY
    assert ended_within(its_own, 60)
    assert sorted(keys(batches)) == EVERY


def test_ctrl_c_while_a_batch_is_awaited_gets_through_and_the_next_epoch_is_whole(client):
    batches = loader(pipeline(client), num_workers=1)
    epoch = iter(batches)
    next(epoch)
    os.kill(batches.pid, signal.SIGSTOP)  # nothing more comes: this process waits
    try:
        interrupt = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        interrupt.start()
        with pytest.raises(KeyboardInterrupt):
            list(epoch)
        interrupt.join()
    finally:
        os.kill(batches.pid, signal.SIGCONT)
    assert sorted(keys(batches)) == EVERY


def test_close_ends_a_stopped_process_and_the_loader_then_decodes_here(client):
    batches = loader(pipeline(client), num_workers=1)
    next(iter(batches))
    pid = batches.pid
    os.kill(pid, signal.SIGSTOP)  # it can answer nothing: killed after the wait
    batches.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # ended and reaped
    assert batches.pid is None and sorted(keys(batches)) == EVERY


def test_the_rank_torch_distributed_set_up_here_reaches_the_decoding_process(client):
    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    ours = sorted(keys(loader(pipeline(client, rank=1, world_size=2), num_workers=1)))
    assert 0 < len(ours) < N
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=2)
    try:
        from_here = sorted(keys(loader(pipeline(client), num_workers=1)))  # the decoding process has no group
    finally:
        dist.destroy_process_group()
    assert from_here == ours
    gc.collect()
    after = loader(pipeline(client), num_workers=1)  # the same process, which keeps nothing of that world
    assert sorted(keys(after)) == EVERY


def test_cpu_tensors_come_through_the_channel_by_value_writable_and_holding_no_file_descriptor():
    import socket

    from remote_loader.pipeline.device.channel import Channel

    ours, theirs = socket.socketpair()
    sender, receiver = Channel(ours), Channel(theirs)
    values = torch.arange(12, dtype=torch.int16).reshape(3, 4)[:, 1:]  # not contiguous
    large = torch.arange(3 << 20, dtype=torch.int32)  # 12 MiB: more than the socket holds at once
    fds = len(os.listdir("/proc/self/fd"))
    held = []
    sending = threading.Thread(target=lambda: [sender.send(("batch", k, (values, large, "key"), None))
                                               for k in range(4)])
    sending.start()
    for _ in range(4):
        held.append(receiver.receive())
    sending.join()
    assert len(os.listdir("/proc/self/fd")) == fds  # none held for the tensors kept
    kind, number, (small, big, key), state = held[-1]
    assert (kind, number, key, state) == ("batch", 3, "key", None)
    assert torch.equal(small, values) and small.dtype == torch.int16 and torch.equal(big, large)
    assert not big.is_shared()
    small[0, 0] = 7  # its own memory, writable
    assert values[0, 0] == 1 and held[0][2][0][0, 0] == 1
    sender.close()
    with pytest.raises(EOFError):
        receiver.receive()
    receiver.close()


def test_a_pass_that_fails_before_the_decoder_opens_is_raised_and_it_still_says_where_it_decodes(client):
    import pickle

    from remote_loader.pipeline.device import DecodingProcess, Place

    process = DecodingProcess(Place(torch.device("cpu")))  # a pass sent at once: it arrives before its imports end
    try:
        with pytest.raises(pickle.UnpicklingError):
            next(process.run(b"not a pipeline"))
        assert process.opened() == "CPU"  # not a wait for a decoder the failed pass never opened
    finally:
        process.close()


def test_a_decoding_process_whose_user_is_killed_ends_without_a_word(client, seaweed):
    # Killed, its user's process leaves the socket closed under a batch being sent.
    code = textwrap.dedent(f"""
        import os, signal
        from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client
        client = make_client({seaweed.endpoint_url!r}, {seaweed.access_key!r}, {seaweed.secret_key!r})
        ds = (RemoteDataset(client, "decoding-process", "d").decode(RandomResizedCrop(32), device="cpu", batched=True)
              .to_tuple("jpg", "cls").batched(4))
        batches = loader(ds, num_workers=1, decoding="process")
        next(iter(batches))
        print(batches.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
    out, err = run.communicate(timeout=300)  # its pipes close once the decoding process and its workers have ended
    assert run.returncode == -signal.SIGKILL and out.strip().isdigit()
    assert err == "", err[-2000:]


def fail_at_the_tenth(sample):
    if sample[2] == "000009":
        raise ValueError("the tenth sample")
    return sample


def test_a_failed_passs_worker_ends_with_the_pass(client):
    # The pass's error held a frame that held the error (torch's reraise): its DataLoader
    # iterator, and its worker, lived on until the decoding process's garbage collector ran,
    # or the next pass began.
    batches = loader(pipeline(client, fn=fail_at_the_tenth), num_workers=1, persistent_workers=False)
    with pytest.raises(ValueError, match="the tenth sample"):
        keys(batches)
    with open(f"/proc/{batches.pid}/task/{batches.pid}/children") as children:
        workers = [int(pid) for pid in children.read().split()]
    assert all(ended_within(pid, 30) for pid in workers), "the failed pass's worker lives on"


def interrupt_at_the_eighth(sample):
    if sample[2] == "000007":
        raise KeyboardInterrupt
    return sample


def test_a_keyboard_interrupt_raised_by_a_map_in_the_decoding_process_is_raised_here_and_it_goes_on(client):
    batches = loader(pipeline(client, fn=interrupt_at_the_eighth), num_workers=0)  # the map runs in that process
    pid = batches.pid
    with pytest.raises(KeyboardInterrupt):
        keys(batches)
    assert batches.pid == pid  # the process still serves (it was not ended by the exception)
    with pytest.raises(KeyboardInterrupt):
        keys(batches)


# ---------------------------------------------------------------- from a break-it pass, each seen failing first


def run_script(seaweed, body, *args, timeout=300):
    """``body`` as a script of its own (its ``__main__``), with ``client`` and ``pipeline(fn,
    batch, crop)`` over the module's dataset; its exit status, stdout and stderr."""
    head = textwrap.dedent(f"""
        import os, signal, sys, warnings, logging
        from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client
        client = make_client({seaweed.endpoint_url!r}, {seaweed.access_key!r}, {seaweed.secret_key!r})
        def pipeline(fn=None, batch=8, crop=32):
            ds = (RemoteDataset(client, "decoding-process", "d").decode(RandomResizedCrop(crop), device="cpu",
                  batched=True).to_tuple("jpg", "cls", "__key__"))
            return (ds.map(fn) if fn else ds).batched(batch)
        def keys(batches):
            return sorted(k for *_, ks in batches for k in ks)
    """)
    done = subprocess.run([sys.executable, "-c", head + textwrap.dedent(body), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return done.returncode, done.stdout, done.stderr


def test_classes_of_the_users_main_reach_the_workers_samples_and_errors(client, seaweed):
    # The workers were forked from a process whose __main__ is not the user's: a sample holding
    # a class of the user's script did not pickle there, and was lost without a word.
    code, out, err = run_script(seaweed, """
        class Key(str):
            pass
        class BadSample(Exception):
            pass
        def as_key(sample):
            return (*sample[:2], Key(sample[2]))
        def refuse(sample):
            if sample[2] == "000007":
                raise BadSample("not this one")
            return sample
        got = loader(pipeline(as_key), num_workers=1)
        print(len(keys(got)))
        try:
            keys(loader(pipeline(refuse), num_workers=1))
        except BadSample as error:
            print("BadSample", "not this one" in str(error))
    """, timeout=120)
    assert code == 0, err[-2000:]
    assert out.split() == ["48", "BadSample", "True"], (out, err[-2000:])


def test_a_pipeline_sent_again_while_the_process_sends_a_large_batch_does_not_deadlock(client):
    big = b"v" * (40 << 20)  # a lookup table the map holds: the pipeline is larger than the socket holds

    def keep(sample):
        return (*sample, big[: 3 << 20])  # and each sample 3 MB

    batches = loader(pipeline(client, fn=keep), num_workers=0)  # sent again each epoch
    epoch = iter(batches)
    next(epoch)
    del epoch  # left early, the process blocked sending the next batch
    assert sorted(k for *_, ks, _ in batches for k in ks) == EVERY


def test_a_killed_decoding_process_with_large_batches_is_named_too(client):
    # 1.2 MB a batch, and six batches: the process has sent at most AHEAD (2) past the one taken
    # when it is killed, so it cannot have finished the epoch before (with three, it could).
    batches = loader(pipeline(client, batch=8, crop=224), num_workers=1)
    epoch = iter(batches)
    next(epoch)
    os.kill(batches.pid, signal.SIGKILL)
    with pytest.raises(DecoderExited):
        for _ in epoch:
            pass


def stopped_then_resumed(client, workers):
    """Two batches of one stateful loader, and a second loader given its state."""
    pytest.importorskip("torchdata")
    stopped = loader(pipeline(client), num_workers=workers, stateful=True)
    first = keys(itertools.islice(iter(stopped), 2))
    resumed = loader(pipeline(client), num_workers=workers, stateful=True)
    resumed.load_state_dict(stopped.state_dict())
    return first, resumed


def test_a_state_loaded_in_the_decoding_process_leaves_the_next_epoch_whole(client):
    first, resumed = stopped_then_resumed(client, 0)
    assert sorted(first + keys(resumed)) == EVERY
    assert sorted(keys(resumed)) == EVERY  # the next epoch: no ResumeError, every sample


def test_a_state_loaded_then_close_is_the_one_the_loader_resumes_from(client):
    first, resumed = stopped_then_resumed(client, 1)
    resumed.close()  # decoded here from now on, from the state loaded
    rest = keys(resumed)
    assert len(first) == 16 and sorted(first + rest) == EVERY


class Flaky:
    """A map whose first call after ``arm()`` raises (a transient failure in a user's map), in
    whichever process runs it: the flag is a file."""

    def __init__(self, flag) -> None:
        self.flag = flag

    def arm(self) -> None:
        self.flag.write_text("")

    def __call__(self, sample):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.flag)
            raise RuntimeError("a transient failure")
        return sample


@pytest.mark.parametrize("workers", [0, 1])
def test_a_loaded_state_whose_pass_fails_before_its_first_batch_is_resumed_again(client, tmp_path, workers):
    """A checkpoint loaded, the resumed pass failing before it hands out a batch: the state the
    loader gives then is still the one loaded, and resuming from it delivers the rest once."""
    pytest.importorskip("torchdata")
    flaky = Flaky(tmp_path / "flag")
    stopped = loader(pipeline(client, fn=flaky), num_workers=workers, stateful=True)
    first = keys(itertools.islice(iter(stopped), 2))
    state = stopped.state_dict()
    stopped.close()  # its processes read ahead no more: the armed failure is the resumed pass's
    resumed = loader(pipeline(client, fn=flaky), num_workers=workers, stateful=True)
    resumed.load_state_dict(state)
    flaky.arm()
    with pytest.raises(RuntimeError, match="a transient failure"):
        keys(resumed)
    again = loader(pipeline(client, fn=flaky), num_workers=workers, stateful=True)
    again.load_state_dict(resumed.state_dict())
    assert sorted(first + keys(again)) == EVERY


def test_the_environment_and_sys_path_of_a_pass_are_this_processs_as_it_begins(client, monkeypatch, tmp_path):
    ds = pipeline(client)  # the decoding process starts now, with the environment of now
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ours = keys(loader(pipeline(client, rank=1, world_size=2), num_workers=1))
    assert sorted(keys(loader(ds, num_workers=1))) == sorted(ours) and len(ours) < N
    (tmp_path / "late_module.py").write_text("def same(sample):\n    return sample\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # after the process started
    import late_module

    assert len(keys(loader(pipeline(client, fn=late_module.same, rank=1, world_size=2), num_workers=1))) == len(ours)


def test_a_pipeline_that_did_not_arrive_whole_is_sent_again(client, tmp_path, monkeypatch):
    (tmp_path / "flaky_module.py").write_text("def same(sample):\n    return sample\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import flaky_module

    batches = loader(pipeline(client, fn=flaky_module.same), num_workers=1, persistent_workers=True)
    (tmp_path / "flaky_module.py").rename(tmp_path / "elsewhere.py")  # the decoding process cannot import it
    with pytest.raises(ModuleNotFoundError):
        keys(batches)
    (tmp_path / "elsewhere.py").rename(tmp_path / "flaky_module.py")
    assert sorted(keys(batches)) == EVERY


def log_from_the_pipeline(sample):
    logging.getLogger("myapp").info("a record of the user's own, for %s", sample[2])
    return sample


def test_the_users_own_log_records_from_the_decoding_process_reach_this_processs_handlers(client, caplog):
    with caplog.at_level(logging.INFO, logger="myapp"):
        assert sorted(keys(loader(pipeline(client, fn=log_from_the_pipeline), num_workers=0))) == EVERY
    assert sum("a record of the user's own" in m for m in caplog.messages) == N


def test_a_decoding_process_ends_with_its_user_though_a_fork_holds_the_socket(client, seaweed):
    script = textwrap.dedent(f"""
        import os, signal, time
        from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client
        client = make_client({seaweed.endpoint_url!r}, {seaweed.access_key!r}, {seaweed.secret_key!r})
        ds = (RemoteDataset(client, "decoding-process", "d").decode(RandomResizedCrop(32), device="cpu",
              batched=True).to_tuple("jpg", "cls").batched(8))
        batches = loader(ds, num_workers=1, decoding="process")
        next(iter(batches))
        helper = os.fork()
        if helper == 0:  # a helper of the user's, which holds the user's end of the socket
            time.sleep(120)
            os._exit(0)
        print(batches.pid, helper, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    decoding, helper = map(int, run.stdout.readline().split())
    run.wait(timeout=60)
    try:
        assert ended_within(decoding, 30)  # with its user, not with the helper
    finally:
        os.kill(helper, signal.SIGKILL)
        run.stdout.close()


def test_decoded_on_is_said_before_the_first_pass(client):
    """The process says where it decodes once its decoder opened, before any pass: asking
    then waited, after that message, for a pass's message that never came."""
    batches = loader(pipeline(client), num_workers=1)
    said: list[str] = []
    asking = threading.Thread(target=lambda: said.append(batches.decoded_on), daemon=True)
    asking.start()
    asking.join(timeout=120)  # a bound on a hang, not a measure of speed
    assert said == ["CPU"]
    assert sorted(keys(batches)) == EVERY  # and the pass after it is whole


def test_a_decoding_process_waiting_on_a_stuck_worker_ends_with_its_user(client, seaweed):
    # Its user killed while it waits in a pass for a batch that never comes (a worker stuck in a
    # user's map, or retrying a server that is gone): it used to wait for ever, CPU and all.
    script = textwrap.dedent(f"""
        import os, signal, time
        from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client
        seen = []
        def stuck(sample):  # in the worker: the first batch passes, the second never comes
            seen.append(sample[2])
            if len(seen) > 8:
                time.sleep(3600)
            return sample
        client = make_client({seaweed.endpoint_url!r}, {seaweed.access_key!r}, {seaweed.secret_key!r})
        ds = (RemoteDataset(client, "decoding-process", "d").decode(RandomResizedCrop(32), device="cpu",
              batched=True).to_tuple("jpg", "cls", "__key__").map(stuck).batched(4))
        batches = loader(ds, num_workers=1, decoding="process")
        next(iter(batches))
        print(batches.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert select.select([run.stdout], [], [], 120)[0], "the first batch never came"
        decoding = int(run.stdout.readline())
        with open(f"/proc/{decoding}/task/{decoding}/children") as children:
            (worker,) = map(int, children.read().split())
        run.wait(timeout=60)
    finally:
        run.kill()
        run.stdout.close()
    try:
        assert ended_within(decoding, 30)
        assert ended_within(worker, 30)  # the worker stuck in the map too
    finally:
        for pid in (decoding, worker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
