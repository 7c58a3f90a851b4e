"""Retrying reads: a store that never answered fails at the first-contact deadline, one
that answered and then fails is retried until the outage deadline."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading

import pytest

from remote_loader import (
    ConfigError,
    DatasetReader,
    EndpointUnreachable,
    FetchConfig,
    RemoteDataset,
    RetryConfig,
    cli,
    make_client,
)
from remote_loader.config import ENV_DEADLINES
from tests.servers import free_port

NEVER = FetchConfig(retry=RetryConfig(outage_deadline=300, first_contact_deadline=0.5, backoff=0.01))


@pytest.mark.parametrize("endpoint", [f"http://127.0.0.1:{free_port()}", "http://no-such-host.invalid:9000"],
                         ids=["closed port", "unresolvable host"])
def test_a_store_that_never_answered_fails_at_the_first_contact_deadline(endpoint):
    client = make_client(endpoint, "key", "secret")
    with pytest.raises(
        EndpointUnreachable,
        match=r"never answered.*check the endpoint URL.*first_contact_deadline=0\.5 s, or REMOTE_LOADER_FIRST_CO",
    ) as caught:
        RemoteDataset(client, "bkt", "ds", fetch=NEVER)
    assert endpoint in str(caught.value) and "secret" not in str(caught.value)


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = b"<Error><Code>NoSuchKey</Code><Message>none</Message></Error>"
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_store_that_answered_once_gets_the_whole_outage_deadline():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    client = make_client(endpoint, "key", "secret")
    fetch = FetchConfig(retry=RetryConfig(outage_deadline=1.5, first_contact_deadline=0.2, backoff=0.01))
    assert not DatasetReader(client, "bkt", "ds", fetch=fetch).has_manifest()  # a 404 is an answer
    server.shutdown()
    server.server_close()
    thread.join(10)
    with pytest.raises(EndpointUnreachable, match=r"outage_deadline=1\.5 s") as caught:
        DatasetReader(client, "bkt", "ds", fetch=fetch).has_manifest()
    assert "never answered" not in str(caught.value)


def test_deadlines_come_from_the_environment_and_are_checked():
    config = FetchConfig.from_env({"REMOTE_LOADER_OUTAGE_DEADLINE": "60", "REMOTE_LOADER_FIRST_CONTACT_DEADLINE": "5"})
    assert (config.retry.outage_deadline, config.retry.first_contact_deadline) == (60, 5)
    assert FetchConfig.from_env({"REMOTE_LOADER_OUTAGE_DEADLINE": "60"}, outage_deadline=7).retry.outage_deadline == 7
    with pytest.raises(ConfigError, match="REMOTE_LOADER_OUTAGE_DEADLINE must be a number"):
        FetchConfig.from_env({"REMOTE_LOADER_OUTAGE_DEADLINE": "soon"})
    with pytest.raises(ConfigError, match="first_contact_deadline"):
        RetryConfig(first_contact_deadline=-1)


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_a_deadline_that_is_no_finite_number_is_refused_naming_where_it_was_set(value, capsys):
    """RetryConfig refuses an infinite deadline: one set in the environment or on the command
    line was refused as 'outage_deadline must be a finite number...', which names neither."""
    for name in ENV_DEADLINES:
        variable = f"REMOTE_LOADER_{name.upper()}"
        with pytest.raises(ConfigError, match=f"^{variable} must be a finite number of seconds >= 0, got '{value}'$"):
            RetryConfig.from_env({variable: value})
    with pytest.raises(SystemExit):
        cli.main(["info", "s3://bkt/ds", "--outage-deadline", value])
    assert "error: argument --outage-deadline: must be " in capsys.readouterr().err  # not RetryConfig's words


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_cli_gives_up_on_a_dead_endpoint_at_its_deadline(how):
    endpoint = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret"}
    args = [sys.executable, "-m", "remote_loader.cli", "info", "s3://bkt/ds", "--endpoint-url", endpoint]
    if how == "flag":
        args += ["--outage-deadline", "0.5"]
    else:
        env["REMOTE_LOADER_FIRST_CONTACT_DEADLINE"] = "0.5"
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert endpoint in out.stderr and "deadline=0.5 s" in out.stderr and "Traceback" not in out.stderr


def test_by_default_a_mistyped_endpoint_fails_in_seconds_with_one_message_in_words_a_user_knows(caplog):
    endpoint = f"http://127.0.0.1:{free_port()}"
    client = make_client(endpoint, "key", "secret")
    assert RetryConfig().first_contact_deadline == 2
    with caplog.at_level("WARNING", logger="remote_loader"):
        with pytest.raises(EndpointUnreachable) as caught:
            DatasetReader(client, "bkt", "ds").has_manifest()
    message = str(caught.value)
    assert message.startswith(f"cannot connect to {endpoint}: it has never answered, ")
    assert "check the endpoint URL" in message
    assert "(RetryConfig.first_contact_deadline=2 s, or REMOTE_LOADER_FIRST_CONTACT_DEADLINE)" in message
    assert "GET" not in message and "bytes=" not in message  # the request it was means nothing to the user
    assert not [r.getMessage() for r in caplog.records if "is failing" in r.getMessage()]  # no warning repeating it


_SPAWNED_CHILD = """
import pickle, sys
from remote_loader.storage.contact import answered
store = pickle.loads(sys.stdin.buffer.read())
print(answered(store.endpoint))
"""


def test_a_store_pickled_into_another_process_carries_whether_its_endpoint_answered(s3):
    import pickle

    store, bucket = s3
    fresh = make_client(f"http://127.0.0.1:{free_port()}", "key", "secret")  # never contacted
    assert not DatasetReader(store, bucket, "nothing").has_manifest()  # a 404: an answer
    for client, expected in ((store, "True"), (fresh, "False")):
        out = subprocess.run(
            [sys.executable, "-c", _SPAWNED_CHILD], input=pickle.dumps(client), capture_output=True, timeout=60
        )
        assert out.stdout.decode().strip() == expected, out.stderr.decode()
