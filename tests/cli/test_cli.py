"""The console script, run as a user runs it: a subprocess with the environment set."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import remote_loader
from remote_loader import DatasetReader, RemoteDataset, RemoteMapDataset
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload

SCRIPT = Path(sys.executable).with_name("remote-loader")


def run(env, *args, check=True):
    result = subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture
def image_folder(tmp_path):
    ds = SyntheticImages(36, num_classes=3, size=(48, 32), formats=("jpeg", "png"))
    for i in range(len(ds)):
        data, label = ds[i]
        folder = tmp_path / "tree" / ds.classes[label]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img{i:03d}.{'jpg' if i % 2 == 0 else 'png'}").write_bytes(data)
    return tmp_path / "tree", ds


@pytest.fixture
def env(seaweed):
    return {**os.environ, **seaweed.env()}


def test_upload_info_ls_verify(env, s3, image_folder):
    client, bucket = s3
    tree, ds = image_folder
    url = f"s3://{bucket}/folder"
    up = json.loads(run(env, "upload", str(tree), url, "--maxcount", "10", "--workers", "2", "--json").stdout)
    assert up["samples"] == 36 and up["shards"] == 4
    info = json.loads(run(env, "info", url, "--json").stdout)
    assert info["samples"] == 36 and info["fields"] == ["cls", "jpg", "png"]
    assert info["params"]["classes"] == ds.classes and info["params"]["upload"]["maxcount"] == 10
    assert RemoteDataset(client, bucket, "folder").classes == RemoteMapDataset(client, bucket, "folder").classes
    assert RemoteMapDataset(client, bucket, "folder").classes == ds.classes
    listing = json.loads(run(env, "ls", url, "--json").stdout)
    assert [r["samples"] for r in listing] == [10, 10, 10, 6]
    shown = run(env, "ls", url).stdout.splitlines()
    assert shown[0].split() == ["bytes", "samples", "shard"] and len(shown) == 5  # columns named
    assert shown[1].split()[2] == listing[0]["name"]
    text = run(env, "info", url).stdout
    assert "36 in 4 shards" in text
    assert "4 of 4 shards ok" in run(env, "verify", url, "--quiet").stdout
    # Image files keep their bytes: every stored image equals one of the source files.
    sources = {p.read_bytes() for p in tree.rglob("*.*")}
    reader = DatasetReader(client, bucket, "folder")
    for row in listing:
        view = reader.open_shard(next(e for e in reader.manifest.shards if e.name == row["name"]))
        assert all(bytes(s.get("jpg", s.get("png"))) in sources for s in view)


def test_verify_names_every_bad_shard_and_fails(env, s3, image_folder):
    client, bucket = s3
    tree, _ = image_folder
    url = f"s3://{bucket}/corrupt"
    run(env, "upload", str(tree), url, "--maxcount", "8", "--workers", "0", "--quiet")
    names = [e.name for e in DatasetReader(client, bucket, "corrupt").manifest.shards]
    assert len(names) >= 4
    client.delete(bucket, f"corrupt/{names[0]}")  # a missing shard does not stop the check
    data = bytearray(client.get(bucket, f"corrupt/{names[1]}"))
    data[1500] ^= 0x01  # inside the first member's data
    client.put(bucket, f"corrupt/{names[1]}", bytes(data))
    client.delete(bucket, f"corrupt/{names[3]}")
    result = run(env, "verify", url, "--json", check=False)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert [b["name"] for b in report["bad"]] == [names[0], names[1], names[3]]
    assert report["bad"][0]["problems"] == ["the shard object is missing"]
    assert any("crc32" in p for p in report["bad"][1]["problems"])


def test_errors_are_one_line_and_never_show_the_secret(env, s3):
    _, bucket = s3
    secret = "SUPER-SECRET-VALUE-123"
    bad_env = {**env, "AWS_SECRET_ACCESS_KEY": secret}
    result = run(bad_env, "info", f"s3://{bucket}/x", check=False)
    assert result.returncode == 1
    assert result.stderr.startswith("remote-loader: error: access denied") and result.stderr.count("\n") == 1
    assert secret not in result.stderr + result.stdout
    result = run(env, "info", f"s3://{bucket}/nothing-here", check=False)
    assert result.returncode == 1 and "no dataset at s3://" in result.stderr and "Traceback" not in result.stderr


def test_upload_from_module_function_to_a_local_directory(tmp_path):
    (tmp_path / "mydata.py").write_text(
        "from remote_loader.testing.synthetic import SyntheticImages\n"
        "def make():\n    return SyntheticImages(12, size=(32, 24))\n"
    )
    dest = tmp_path / "store" / "bucket" / "ds"
    dest.parent.mkdir(parents=True)
    subprocess.run(
        [str(SCRIPT), "upload", "mydata:make", str(dest), "--workers", "0", "--quiet"],
        cwd=tmp_path,
        check=True,
        timeout=120,
    )
    info = json.loads(
        subprocess.run([str(SCRIPT), "info", str(dest), "--json"], capture_output=True, text=True, check=True).stdout
    )
    assert info["samples"] == 12


def test_bench_reports_rates_and_a_verdict(env, s3):
    client, bucket = s3
    upload(client, bucket, "b", SyntheticImages(40, size=(64, 48)), maxcount=10)
    report = json.loads(
        run(env, "bench", f"s3://{bucket}/b", "--decode", "rrc", "--size", "32", "--workers", "1", "--json").stdout
    )
    none, rrc = report["runs"]
    assert none["decode"] == "none" and none["samples"] == 40 and rrc["samples"] == 40
    assert none["samples_per_s"] > 0 and rrc["first_sample_seconds"] > 0
    assert report["verdict"].startswith(("decoding limits", "storage limits"))
    shown = run(env, "bench", f"s3://{bucket}/b", "--samples", "20", "--workers", "0")
    assert "bench none" in shown.stderr and "20/20" in shown.stderr and "samples/s" in shown.stdout
    assert run(env, "bench", f"s3://{bucket}/b", "--samples", "20", "--workers", "0", "--quiet").stderr == ""


@pytest.mark.parametrize(
    "args, message, status",
    [
        # Usage errors (a mistyped command line, an invalid setting): 2, as argparse exits.
        (["upload", "--seed", "-1", "tests.helpers:small_images", "s3://{bucket}/x"], "--seed: must be >= 0", 2),
        (
            ["upload", "tests.helpers:small_images", "s3://{bucket}/x", "--maxcont", "5"],
            "unrecognized arguments: --maxcont",
            2,
        ),
        (["upload", "--maxsize", "inf", "tests.helpers:small_images", "s3://{bucket}/x"],
         "--maxsize: must be a number of bytes in 4096..9223372036854775807, got 'inf'", 2),
        (["upload", "--maxsize", "1e400", "tests.helpers:small_images", "s3://{bucket}/x"],
         "--maxsize: must be a number of bytes in 4096..9223372036854775807, got '1e400'", 2),
        (["upload", "--maxsize", "100", "tests.helpers:small_images", "s3://{bucket}/x"],
         "--maxsize: must be a number of bytes in 4096..9223372036854775807, got '100'", 2),
        (["upload", "--maxcount", str(2**70), "tests.helpers:small_images", "s3://{bucket}/x"],
         "--maxcount: must be in 1..18014398509481983, got 1180591620717411303424", 2),
        (["bench", "--workers", "-1", "s3://{bucket}/x"], "--workers: must be in 0..1024, got -1", 2),
        (["bench", "--workers", "5000", "s3://{bucket}/x"], "--workers: must be in 0..1024, got 5000", 2),
        (["bench", "--size", "100000", "s3://{bucket}/x"], "--size: must be in 1..4096, got 100000", 2),
        (["bench", "--decode", "rrc", "--size", "0", "s3://{bucket}/x"], "--size: must be in 1..4096, got 0", 2),
        (["bench", "--samples", "0", "s3://{bucket}/x"], "--samples: must be >= 1", 2),
        (["serve", "--data", "/proc/nope"], "cannot use /proc/nope as the server's data directory", 2),
        (["serve", "--port", "1"], "port must be an integer in", 2),
        (["ls", "s3:/{bucket}/x"], "is not a valid URL", 2),
        (["upload", "os:getcwd", "s3://{bucket}/x"], "returned a str, not a dataset", 2),
        (["upload", "json:loads", "s3://{bucket}/x"], "loads() raised TypeError", 2),
        (
            ["upload", "--dask", "garbage", "tests.helpers:small_images", "s3://{bucket}/x"],
            "cannot reach the Dask scheduler at garbage within",
            2,
        ),
        (["info", "s3://data[sets/x"], "'data[sets' holds '['", 2),
        (["info", "s3://da\ttasets/x"], "'da\\ttasets' holds '\\t'", 2),
        (["info", "s3://ab\x01c/x"], "'ab\\x01c' holds '\\x01'", 2),
        (["info", "s3://my bucket/x"], "'my bucket' holds ' '", 2),
        (["ls", "--endpoint-url", "http://127.0.0.1:9OOO", "s3://{bucket}/x"],
         "endpoint 'http://127.0.0.1:9OOO' has no valid port", 2),
        (["ls", "--backend", "minio", "--endpoint-url", "http://127.0.0.1:99999", "s3://{bucket}/x"],
         "endpoint 'http://127.0.0.1:99999' has no valid port", 2),
        (["upload", "tests.cli.sources:source_that_fails", "s3://{bucket}/x"], "cannot build\\nthe dataset", 2),
        # Runtime errors (what the command ran into): 1.
        (["ls", "s3://{bucket}/nothing-here"], "no dataset at", 1),
        (["upload", "--quiet", "--workers", "0", "tests.cli.sources:source_whose_item_fails", "s3://{bucket}/x"],
         "ds[3] raised RuntimeError: line one\\nline two", 1),
        (["info", "s3://no-such-bucket-here/x"], "does not exist", 1),
    ],
)
def test_bad_command_lines_get_one_line_errors_not_tracebacks(env, s3, args, message, status):
    _, bucket = s3
    result = run(
        {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        *[a.format(bucket=bucket) for a in args],
        check=False,
    )
    assert result.returncode == status, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 or "usage:" in result.stderr, result.stderr
    assert all(line.isprintable() for line in result.stderr.split("\n")), result.stderr  # no control character
    if "unrecognized" in message:
        assert "usage: remote-loader upload" in result.stderr  # the command's usage, not the top level's


def test_an_overwrite_refusal_names_the_flag(env, s3):
    _, bucket = s3
    env = {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run(env, "upload", "--quiet", "tests.helpers:small_images", f"s3://{bucket}/o")
    result = run(env, "upload", "--quiet", "--seed", "3", "tests.helpers:small_images", f"s3://{bucket}/o", check=False)
    assert result.returncode == 1 and "--overwrite" in result.stderr


def test_a_re_run_compares_every_item_unless_told_not_to(env, s3):
    _, bucket = s3
    env = {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = ("upload", "tests.helpers:small_images", f"s3://{bucket}/again", "--workers", "0")
    run(env, *command, "--quiet")
    checked = run(env, *command, "--quiet").stdout
    assert "read and compared, nothing to upload" in checked and "sampled" not in checked, checked
    trusted = run(env, *command, "--quiet", "--no-verify", "--stall-timeout", "none").stdout
    assert "sampled items compared (verify=False" in trusted, trusted
    refused = run(env, *command, "--stall-timeout", "0", check=False)
    assert refused.returncode == 2 and "--stall-timeout: must be > 0, or none" in refused.stderr


def test_version_and_python_dash_m():
    assert (
        subprocess.run([str(SCRIPT), "--version"], capture_output=True, text=True).stdout.strip()
        == f"remote-loader {remote_loader.__version__}"
    )
    result = subprocess.run([sys.executable, "-m", "remote_loader", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "upload" in result.stdout


def _help(*command: str) -> str:
    result = subprocess.run([str(SCRIPT), *command, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split())  # argparse wraps lines where it likes


@pytest.mark.parametrize("command", ["upload", "ls", "info", "verify", "index", "bench"])
def test_each_commands_help_names_the_credential_variables_and_shows_defaults(command):
    text = _help(command)
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MINIO_ACCESS_KEY"):
        assert name in text, (command, name)
    assert "S3 client library (default: boto3)" in text
    assert f"never answered gets at most {remote_loader.RetryConfig().first_contact_deadline:g} s" in text
    # --quiet hides a progress bar: offered where there is one
    assert ("--quiet" in text) == (command not in ("ls", "info")), command


def test_uploads_options_say_what_they_do_and_their_defaults():
    text = _help("upload")
    for shown in ("maximum shard size in bytes (default: 1e8)", "maximum samples per shard (default: 100000)",
                  "before sharding (default: 0)", "1..100 (default: 90)", "(default: jpeg)", "(default: CPU count)",
                  "--on-error {raise,skip} raise: stop at the first sample", "(default: raise)"):
        assert shown in text, shown
    assert "--no-shuffle keep the source order (default" not in text  # a flag's False is not a default to show


def test_a_reader_that_stops_reading_ends_the_command_quietly(env, s3, image_folder):
    """`remote-loader ls ... | head -1`: no BrokenPipeError traceback, the status a pipe's writer gets."""
    tree, _ = image_folder
    url = f"s3://{s3[1]}/piped"
    run(env, "upload", str(tree), url, "--maxcount", "1", "--workers", "0", "--quiet")
    process = subprocess.Popen([str(SCRIPT), "ls", url], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               bufsize=0)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # the reader is gone before the command writes
    err = process.stderr.read().decode()
    process.stderr.close()
    assert process.wait(timeout=120) == 141 and err == "", err


def test_the_cli_imports_neither_torch_nor_the_test_server_until_a_command_needs_them():
    code = ("import sys\nfrom remote_loader import cli\n"
            "print('torch' in sys.modules, 'remote_loader.testing.server' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False False"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"MINIO_ROOT_USER": "mine"}, "give the server's access key and secret together"),
        ({"MINIO_ROOT_PASSWORD": "hunter2-secret"}, "give the server's access key and secret together"),
        ({"MINIO_ROOT_USER": "mine", "MINIO_ROOT_PASSWORD": "hunter2\nsecret"},
         "the environment variable MINIO_ROOT_PASSWORD holds a non-printable character"),
    ],
)
def test_serve_refuses_half_a_key_or_a_key_with_a_newline_from_the_environment_without_showing_it(extra, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINIO_ROOT_")}
    result = run({**env, **extra}, "serve", "--port", "1", check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert "hunter2" not in result.stderr


def test_serve_accepts_the_readmes_credentials_and_its_own(tmp_path):
    from remote_loader import make_client
    from remote_loader.testing.server import free_base_port

    clean = {k: v for k, v in os.environ.items() if not k.startswith("MINIO_ROOT_")}
    for keys, extra in (
        ([], {}),
        (["--access-key", "mine", "--secret-key", "hunter2-secret"], {}),
        # The secret kept off the command line (and so out of ps and shell history).
        (["--access-key", "mine"], {"MINIO_ROOT_PASSWORD": "hunter2-secret"}),
        ([], {"MINIO_ROOT_USER": "mine", "MINIO_ROOT_PASSWORD": "hunter2-secret"}),
    ):
        # A block whose every port (gRPC ones included) is free and below the ephemeral
        # range, where an outgoing connection could take one before the server binds it.
        port = free_base_port() + 3  # the S3 port of the block
        server = subprocess.Popen(
            [
                str(SCRIPT),
                "serve",
                "--port",
                str(port),
                "--bucket",
                "datasets",
                "--data",
                str(tmp_path / str(port)),
                *keys,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**clean, **extra},
            text=True,
        )
        stderr = ""
        try:
            assert server.stdout is not None
            lines = [server.stdout.readline() for _ in range(8)]  # the banner, up to "Ctrl-C stops it."
            assert "Ctrl-C stops it." in lines[-1], lines
            base = port - 3  # every port the server takes is named: S3, and the internal services'
            for name, taken in {
                "master": base,
                "volume": base + 1,
                "filer": base + 2,
                "admin": base + 4,
                "filer gRPC": base + 10002,
                "admin gRPC": base + 10004,
            }.items():
                assert f"{name} {taken}" in lines[1], lines[1]
            assert "hunter2-secret" not in "".join(lines)
            access, secret = ("mine", "hunter2-secret") if keys or extra else ("minioadmin", "minioadmin")
            client = make_client(f"http://127.0.0.1:{port}", access, secret)
            client.put("datasets", "k", b"v")
            assert client.get("datasets", "k") == b"v"
            client.close()
        finally:
            server.send_signal(signal.SIGINT)
            stderr = server.communicate(timeout=60)[1]
        assert "hunter2-secret" not in stderr
        # A secret typed on the command line still works, with a warning that names the way to keep it off.
        warned = "--secret-key puts the secret on the command line" in stderr
        assert warned == ("--secret-key" in keys), stderr
        if warned:
            assert "MINIO_ROOT_PASSWORD" in stderr


def _local_tars(directory: Path, count: int = 2) -> None:
    import io
    import tarfile

    directory.mkdir(parents=True, exist_ok=True)
    images = SyntheticImages(count * 3, size=(16, 16))
    for t in range(count):
        with tarfile.open(directory / f"part-{t}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(t * 3, t * 3 + 3):
                for name, data in ((f"{i:04d}.jpg", images.encoded(i)), (f"{i:04d}.cls", b"1")):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("relative", [True, False])
def test_local_paths_are_paths_everywhere_in_the_cli(image_folder, tmp_path, monkeypatch, relative):
    tree, _ = image_folder
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MINIO_"))}
    dataset = "some/dir/ds" if relative else str(work / "some/dir/ds")
    here = {"cwd": work}
    out = subprocess.run(
        [str(SCRIPT), "upload", str(tree), f"./{dataset}" if relative else dataset, "--workers", "0", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        **here,
    )
    assert out.returncode == 0, out.stderr
    made = work / "some/dir/ds"
    assert (made / "manifest.msgpack").is_file()  # the path is the dataset: nothing above it written
    assert sorted(p.name for p in work.iterdir()) == ["some"] and sorted(p.name for p in (work / "some").iterdir()) == [
        "dir"
    ]
    for command in ("ls", "info", "verify"):
        done = subprocess.run(
            [str(SCRIPT), command, f"./{dataset}" if relative else dataset],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            **here,
        )
        assert done.returncode == 0, (command, done.stderr)
    assert (
        str(made)
        in subprocess.run([str(SCRIPT), "info", str(made)], env=env, capture_output=True, text=True, timeout=300).stdout
    )
    tars = work / "tars/wds"  # plain tars: the advice names the path, and following it works
    _local_tars(tars)
    target = "./tars/wds" if relative else str(tars)
    advice = subprocess.run([str(SCRIPT), "ls", target], env=env, capture_output=True, text=True, timeout=300, **here)
    assert advice.returncode == 1 and f"remote-loader index {tars}" in advice.stderr, advice.stderr
    done = subprocess.run(
        [str(SCRIPT), "index", target, "--quiet"], env=env, capture_output=True, text=True, timeout=300, **here
    )
    assert done.returncode == 0 and "indexed 6 samples in 2 shards" in done.stdout, done.stderr
    info = subprocess.run([str(SCRIPT), "info", target], env=env, capture_output=True, text=True, timeout=300, **here)
    assert "classes   unknown (tars indexed in place)" in info.stdout, info.stdout  # not "0"
    assert sorted(p.name for p in tars.iterdir()) == [
        ".rl-partial-lock",
        "manifest.msgpack",
        "part-0.tar",
        "part-0.tar.index",
        "part-1.tar",
        "part-1.tar.index",
    ]


def test_advice_at_a_bucket_holding_datasets_never_merges_them(env, s3, tmp_path):
    client, bucket = s3
    for name in ("a", "b"):
        upload(client, bucket, f"sets/{name}", SyntheticImages(6, size=(16, 16)), maxcount=3)
    before = sorted(o.key for o in client.list(bucket))
    shown = run(env, "ls", f"s3://{bucket}/sets", check=False)
    assert shown.returncode == 1 and "index" not in shown.stderr, shown.stderr
    assert f"2 below it: s3://{bucket}/sets/a, s3://{bucket}/sets/b; name one of those" in shown.stderr
    refused = run(env, "index", f"s3://{bucket}/sets", "--quiet", check=False)
    assert refused.returncode == 1 and "holds 2 datasets below it" in refused.stderr, refused.stderr
    assert sorted(o.key for o in client.list(bucket)) == before


def test_the_bench_verdict_suggests_what_the_decode_it_ran_does_not_already_do():
    from remote_loader.bench import BenchResult, verdict

    fast, slow = BenchResult("none", 100, 1.0, 0.1, 10.0), BenchResult("rrc", 100, 4.0, 0.1, 10.0)
    assert "reduced-size" not in verdict(fast, slow) and "decoding on a GPU" in verdict(fast, slow)
    assert "--decode rrc" in verdict(fast, BenchResult("pil", 100, 4.0, 0.1, 10.0))


def test_info_says_what_a_video_field_holds(env, s3, tmp_path):
    pytest.importorskip("av", reason="PyAV is not installed (the video extra)")
    from remote_loader.testing.synthetic import SyntheticVideos

    client, bucket = s3
    upload(client, bucket, "clips", SyntheticVideos(3, str(tmp_path), frames=24, size=(64, 48), fps=12))
    info = json.loads(run(env, "info", f"s3://{bucket}/clips", "--json").stdout)
    assert info["field_types"] == {"cls": "int", "mp4": "video (h264, 64x48, 2.0 s, 12 fps)"}
    assert "mp4 (video (h264, 64x48, 2.0 s, 12 fps))" in run(env, "info", f"s3://{bucket}/clips").stdout
    bench = json.loads(run(env, "bench", f"s3://{bucket}/clips", "--decode", "clip", "--size", "32", "--workers",
                           "0", "--json").stdout)
    assert [(r["decode"], r["samples"]) for r in bench["runs"]] == [("none", 3), ("clip", 3)]
    upload(client, bucket, "pictures", SyntheticImages(4, size=(32, 24)))
    refused = run(env, "bench", f"s3://{bucket}/pictures", "--decode", "clip", check=False)
    assert refused.returncode != 0 and "bench --decode clip decodes video fields;" in refused.stderr


def test_a_folder_of_videos_uploads_as_their_files(env, s3, tmp_path):
    pytest.importorskip("av", reason="PyAV is not installed (the video extra)")
    from remote_loader.testing.synthetic import SyntheticVideos

    client, bucket = s3
    videos = SyntheticVideos(4, str(tmp_path / "made"), num_classes=2, frames=6)
    for i in range(len(videos)):  # UCF101's layout: one folder per class, its videos in it
        path, label = videos[i]
        folder = tmp_path / "UCF" / ["ApplyEyeMakeup", "Archery"][label]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"v_{i:02d}.avi.mp4").write_bytes(Path(path).read_bytes())
    up = json.loads(run(env, "upload", str(tmp_path / "UCF"), f"s3://{bucket}/ucf", "--workers", "0", "--json").stdout)
    assert up["samples"] == 4
    back = {s["__key__"]: s for s in RemoteDataset(client, bucket, "ucf")}
    assert sorted(int(bytes(s["cls"])) for s in back.values()) == [0, 0, 1, 1]
    assert {bytes(s["mp4"]) for s in back.values()} == {Path(videos[i][0]).read_bytes() for i in range(4)}
    assert RemoteDataset(client, bucket, "ucf").classes == ["ApplyEyeMakeup", "Archery"]


def test_upload_stores_frames_as_video_where_asked(tmp_path):
    pytest.importorskip("av", reason="PyAV is not installed (the video extra)")
    (tmp_path / "myclips.py").write_text(
        "import numpy as np\n"
        "def make():\n    return [(np.full((8, 24, 32, 3), 30 * k, dtype=np.uint8), k) for k in range(3)]\n"
    )
    dest = tmp_path / "store" / "bucket" / "ds"
    dest.parent.mkdir(parents=True)
    subprocess.run([str(SCRIPT), "upload", "myclips:make", str(dest), "--workers", "0", "--quiet",
                    "--frames-as-video", "lossless"], cwd=tmp_path, check=True, timeout=120)
    info = json.loads(
        subprocess.run([str(SCRIPT), "info", str(dest), "--json"], capture_output=True, text=True, check=True).stdout
    )
    assert info["samples"] == 3 and "0.mp4" in json.dumps(info["fields"])


def test_a_local_path_that_is_a_file_or_no_directory_is_named_in_one_line(tmp_path):
    work = tmp_path.resolve()
    (work / "notes.txt").write_text("mine\n")
    (work / "src").mkdir()
    (work / "src" / "main.py").write_text("mine\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MINIO_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    upload = ["upload", "tests.helpers:small_images", "--workers", "0", "--quiet"]
    under_a_file = f"{work}/src/main.py/x: {work}/src/main.py is a file, not a directory"
    for args, message in (
        ([*upload, "./notes.txt"], f"{work}/notes.txt is a file, not a directory"),
        ([*upload, f"file://{work}/src/main.py/x"], under_a_file),
        (["ls", "./notes.txt"], f"{work}/notes.txt is a file, not a directory"),
        (["info", f"{work}/src/main.py/x"], under_a_file),
        (["info", "./missing-dir"], f"no directory {work}/missing-dir"),
    ):
        done = subprocess.run([str(SCRIPT), *args], env=env, cwd=work, capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stderr) == (1, f"remote-loader: error: {message}\n"), args
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt", "src"]  # nothing made, nothing touched
    assert (work / "notes.txt").read_text() == (work / "src" / "main.py").read_text() == "mine\n"


@pytest.mark.parametrize("command", ["ls", "info", "verify"])
def test_a_command_whose_stdout_is_closed_says_so_in_one_line(tmp_path, command):
    from remote_loader import LocalStore
    from tests.helpers import upload_to_new_bucket

    upload_to_new_bucket(LocalStore(tmp_path), "ds", "", SyntheticImages(4, size=(16, 16)), maxcount=2)
    done = subprocess.run(["sh", "-c", 'exec "$0" "$@" >&-', str(SCRIPT), command, str(tmp_path / "ds")],
                          capture_output=False, stderr=subprocess.PIPE, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (1, "remote-loader: error: standard output is closed\n")


@pytest.mark.parametrize("endpoint", ["./ep", "127.0.0.1", "file://{tmp_path}/ep"])
def test_an_endpoint_url_that_is_no_http_endpoint_is_refused_never_taken_as_a_directory(tmp_path, endpoint):
    endpoint = endpoint.format(tmp_path=tmp_path)
    problem = f"endpoint {endpoint!r} is not an http(s)://host[:port] URL"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s"}
    for command in (["upload", "tests.helpers:small_images", "s3://datasets/x", "--create-bucket", "--workers", "0",
                     "--quiet"], ["ls", "s3://datasets/x"]):
        done = subprocess.run([str(SCRIPT), *command, "--endpoint-url", endpoint], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines()[-1].endswith(f"error: argument --endpoint-url: {problem}"), done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written where the endpoint was taken for a directory
