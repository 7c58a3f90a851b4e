"""Where a store is and whose keys it signs with: endpoints, AWS profiles and the AWS files,
refused in one line naming what was wrong (never a key), and read by both S3 backends alike."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import threading
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from remote_loader import AccessDenied, ConfigError, StorageConfig, StorageError, make_client
from tests.conftest import new_bucket
from tests.servers import free_port


@pytest.mark.parametrize("backend", ["boto3", "minio"])
@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9OOO", "http://127.0.0.1:99999", "127.0.0.1:99999",
                                      "https://s3.example:0", "http://127.0.0.1:9000x/?X-Amz-Signature=SHH-VALUE-1"])
def test_an_endpoint_whose_port_is_no_port_is_refused_naming_it(backend, endpoint):
    with pytest.raises(ConfigError, match="has no valid port: a port is a number from 1 to 65535") as caught:
        make_client(endpoint, "k", "SHH-VALUE-2", backend=backend)
    message = str(caught.value)
    assert endpoint.partition("?")[0].removeprefix("http://") in message and "\n" not in message
    assert "SHH-VALUE" not in message + repr(caught.value)


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("remote-loader")


def _users_env(home: Path, endpoint: str, **variables: str) -> dict[str, str]:
    """The environment of a user whose home is ``home`` (its ``.aws`` files, never the real
    ones), with none of this run's AWS or MinIO variables: only ``variables`` and the endpoint."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MINIO_"))}
    return {**env, "HOME": str(home), "PYTHONPATH": str(ROOT), "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_ENDPOINT_URL": endpoint, **variables}


def _aws_file(home: Path, name: str, text: str) -> Path:
    path = home / ".aws" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "backend, variables, said",
    [
        ("boto3", {"AWS_PROFILE": "nosuch"}, ["AWS profile 'nosuch' (AWS_PROFILE)", "credentials"]),
        ("minio", {"AWS_PROFILE": "nosuch"}, ["AWS profile 'nosuch' (AWS_PROFILE)", "credentials"]),
        # boto3 reads the profile's settings even where the keys come from the environment
        ("boto3",
         {"AWS_PROFILE": "nosuch", "AWS_ACCESS_KEY_ID": "AKID-VALUE-1", "AWS_SECRET_ACCESS_KEY": "SHH-VALUE-1"},
         ["AWS profile 'nosuch' (AWS_PROFILE)", "credentials"]),
        ("boto3", {"AWS_PROFILE": "half"}, ["AWS profile 'half'", "credentials", "aws_secret_access_key"]),
        ("minio", {"AWS_PROFILE": "half"}, ["AWS profile 'half'", "credentials", "aws_secret_access_key"]),
        ("boto3", {"AWS_ACCESS_KEY_ID": "AKID-VALUE-1", "AWS_SECRET_ACCESS_KEY": "SHH-VALUE-1",
                   "AWS_SESSION_TOKEN": "SHH-VALUE-TOKEN-1\n"}, ["AWS_SESSION_TOKEN", "non-printable"]),
        ("minio", {"AWS_ACCESS_KEY_ID": "AKID-VALUE-1", "AWS_SECRET_ACCESS_KEY": "SHH-VALUE-1\t"},
         ["AWS_SECRET_ACCESS_KEY", "non-printable"]),
    ],
)
def test_a_profile_missing_or_half_there_and_a_key_with_a_newline_are_one_line_config_errors(
        seaweed, tmp_path, backend, variables, said):
    # Before: botocore's ProfileNotFound or PartialCredentialsError traceback (60+ lines),
    # minio's "GET ... failed: ValueError", and for the token "failed: HTTPClientError".
    credentials = _aws_file(tmp_path, "credentials", "[half]\naws_access_key_id = AKID-VALUE-HALF\n")
    result = _cli(_users_env(tmp_path, seaweed.endpoint_url, **variables), "ls", "--backend", backend,
                  "s3://datasets/x")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("remote-loader: error: ") and result.stderr.count("\n") == 1, result.stderr
    for words in said:
        assert words in result.stderr, result.stderr
    if "AWS_PROFILE" in variables:
        assert str(credentials) in result.stderr, result.stderr
    assert "AKID-VALUE" not in result.stderr and "SHH-VALUE" not in result.stderr


_VARIABLE = {"access_key": "AWS_ACCESS_KEY_ID", "secret_key": "MINIO_SECRET_KEY", "session_token": "AWS_SESSION_TOKEN"}


@pytest.mark.parametrize("field", ["access_key", "secret_key", "session_token"])
def test_keys_holding_a_control_character_are_refused_without_showing_them(field):
    keys = {"access_key": "AKID-VALUE-2", "secret_key": "SHH-VALUE-2", "session_token": "SHH-VALUE-3"}
    keys[field] += "\n"
    with pytest.raises(ConfigError, match=f"^{field} holds a non-printable character") as caught:
        StorageConfig(endpoint_url="http://127.0.0.1:9000", **keys)
    assert "AKID-VALUE" not in str(caught.value) + repr(caught.value) and "SHH-VALUE" not in str(caught.value)
    env = {"AWS_ACCESS_KEY_ID": "AKID-VALUE-2", "MINIO_SECRET_KEY": "SHH-VALUE-2"}
    env[_VARIABLE[field]] = "\x1b[2JSHH-VALUE-4"
    with pytest.raises(ConfigError, match=f"^the environment variable {_VARIABLE[field]} holds a non-printable"
                       ) as caught:
        StorageConfig.from_env(env)
    message = str(caught.value)
    assert "AKID-VALUE" not in message and "SHH-VALUE" not in message and "\x1b" not in message


def test_an_endpoint_given_as_bytes_is_refused_without_showing_its_keys():
    """An endpoint URL that is no str was echoed whole in the message, with the
    ``user:secret@`` it held (StorageConfig's, and make_client's)."""
    url = b"http://AKID-VALUE-5:SHH-VALUE-5@127.0.0.1:9000"
    with pytest.raises(ConfigError, match="^endpoint_url must be a str, got bytes") as caught:
        StorageConfig(endpoint_url=url)  # type: ignore[arg-type]
    assert "VALUE-5" not in str(caught.value)
    with pytest.raises(ConfigError, match="^expected a URL or a local path, got bytes") as caught:
        make_client(url)  # type: ignore[arg-type]
    assert "VALUE-5" not in str(caught.value)
    with pytest.raises(ConfigError, match="^expected a URL or a local path, got int 5$"):
        make_client(5)  # type: ignore[arg-type]


def _home_with_no_keys(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """This process as a user's whose home is ``home``: no key variable, the AWS files under ``home``."""
    for name in [n for n in os.environ if n.startswith(("AWS_", "MINIO_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_the_minio_backend_takes_the_default_profiles_keys_as_boto3_does(seaweed, tmp_path, monkeypatch):
    # `aws configure`'s set-up: keys in ~/.aws/credentials [default], no AWS_PROFILE. Before:
    # the minio backend sent anonymous requests (AccessDenied) where boto3 used them.
    bucket = new_bucket(seaweed.client())
    _home_with_no_keys(monkeypatch, tmp_path)
    _aws_file(tmp_path, "credentials", f"[default]\naws_access_key_id = {seaweed.access_key}\n"
                                       f"aws_secret_access_key = {seaweed.secret_key}\n")
    store = make_client(seaweed.endpoint_url, backend="minio")
    store.put(bucket, "k", b"v")
    assert store.get(bucket, "k") == b"v"
    store.close()


def test_the_minio_backend_reads_a_credentials_file_given_as_a_path(seaweed, tmp_path, monkeypatch):
    """StorageConfig's credentials_file, which the minio backend reads, took a pathlib.Path;
    the check that it is a str refused one ('credentials_file must be a str, got PosixPath')."""
    bucket = new_bucket(seaweed.client())
    _home_with_no_keys(monkeypatch, tmp_path)
    keys = _aws_file(tmp_path, "elsewhere", f"[p]\naws_access_key_id = {seaweed.access_key}\n"
                                          f"aws_secret_access_key = {seaweed.secret_key}\n")
    config = StorageConfig(endpoint_url=seaweed.endpoint_url, profile="p", credentials_file=keys)
    assert config.credentials_file == str(keys)
    store = make_client(config=config, backend="minio")
    store.put(bucket, "k", b"v")
    assert store.get(bucket, "k") == b"v"
    store.close()


def test_keys_in_the_environment_win_over_the_default_profiles(seaweed, tmp_path, monkeypatch):
    bucket = new_bucket(seaweed.client())
    _home_with_no_keys(monkeypatch, tmp_path)
    _aws_file(tmp_path, "credentials", "[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    store = make_client(seaweed.endpoint_url, backend="minio")
    store.put(bucket, "k", b"v")
    assert store.get(bucket, "k") == b"v"
    store.close()


@pytest.mark.parametrize("text, refused", [
    (None, None),  # no file: anonymous requests, which the server refuses, as before
    ("[work]\naws_access_key_id = AKID-VALUE-5\naws_secret_access_key = SHH-VALUE-5\n", None),
    ("[default]\nregion = eu-west-1\n", None),  # a default profile without keys: anonymous too, as boto3 finds none
    ("[default]\naws_access_key_id = AKID-VALUE-5\n", "the AWS profile 'default' in the AWS credentials file"),
    ("aws_access_key_id = AKID-VALUE-5\n",
     r"credentials cannot be parsed as \[profile\] sections \(MissingSectionHeaderError\)"),
])
def test_a_default_profile_absent_means_no_keys_and_half_there_an_error(seaweed, tmp_path, monkeypatch, text, refused):
    bucket = new_bucket(seaweed.client())
    _home_with_no_keys(monkeypatch, tmp_path)
    if text is not None:
        _aws_file(tmp_path, "credentials", text)
    store = make_client(seaweed.endpoint_url, backend="minio")
    with pytest.raises(ConfigError if refused else AccessDenied, match=refused) as caught:
        store.get(bucket, "k")
    assert "AKID-VALUE" not in str(caught.value) and "SHH-VALUE" not in str(caught.value)
    store.close()


def test_an_endpoint_from_the_aws_config_file_is_the_one_messages_name(seaweed, tmp_path):
    # botocore sends every request to an endpoint_url of ~/.aws/config; before, messages said
    # "at AWS S3", and for a dead one "no endpoint is set: set AWS_ENDPOINT_URL".
    config = _aws_file(tmp_path, "config", f"[default]\nendpoint_url = {seaweed.endpoint_url}\n")
    env = _users_env(tmp_path, seaweed.endpoint_url, AWS_ACCESS_KEY_ID=seaweed.access_key,
                     AWS_SECRET_ACCESS_KEY=seaweed.secret_key, REMOTE_LOADER_FIRST_CONTACT_DEADLINE="0.5")
    del env["AWS_ENDPOINT_URL"]
    missing = _cli(env, "ls", f"s3://{new_bucket(seaweed.client())}-no/x")
    assert f"does not exist at {seaweed.endpoint_url} (" in missing.stderr, missing.stderr
    refused = _cli({**env, "AWS_SECRET_ACCESS_KEY": "SHH-VALUE-6"}, "ls", f"s3://{new_bucket(seaweed.client())}/x")
    assert f"at {seaweed.endpoint_url} (GET" in refused.stderr and "SHH-VALUE" not in refused.stderr, refused.stderr
    dead = f"http://127.0.0.1:{free_port()}"
    config.write_text(f"[default]\nendpoint_url = {dead}\n")
    unreachable = _cli(env, "ls", "s3://datasets/x")
    assert f"cannot connect to {dead}: it has never answered" in unreachable.stderr, unreachable.stderr
    assert "check the endpoint URL" in unreachable.stderr and "no endpoint is set" not in unreachable.stderr
    for result in (missing, refused, unreachable):
        assert result.returncode == 1 and "AWS S3" not in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize("secret", ["SHH-VALUE-7", "SHH/VALUE-7"])
def test_keys_in_the_aws_config_files_endpoint_url_are_never_named(seaweed, tmp_path, secret):
    """An endpoint_url of ~/.aws/config is botocore's to parse, with a key:secret@ in it too:
    every message that named the endpoint then repeated the secret."""
    host = seaweed.endpoint_url.removeprefix("http://")
    _aws_file(tmp_path, "config", f"[default]\nendpoint_url = http://AKID-VALUE-7:{secret}@{host}\n")
    env = _users_env(tmp_path, seaweed.endpoint_url, AWS_ACCESS_KEY_ID=seaweed.access_key,
                     AWS_SECRET_ACCESS_KEY=seaweed.secret_key, REMOTE_LOADER_FIRST_CONTACT_DEADLINE="0.5",
                     REMOTE_LOADER_OUTAGE_DEADLINE="0.5")
    del env["AWS_ENDPOINT_URL"]
    result = _cli(env, "ls", f"s3://{new_bucket(seaweed.client())}-no/x")
    assert result.returncode == 1 and result.stderr.startswith("remote-loader: error: "), result.stderr
    assert "VALUE-7" not in result.stderr, result.stderr


def test_an_aws_config_files_endpoint_url_that_is_no_url_is_named_as_such(seaweed, tmp_path):
    """botocore raises a ValueError ('Invalid endpoint: ...', the URL and any secret in it) for
    an endpoint_url of ~/.aws/config that is no URL: the message blamed a credential_process
    the profile does not have."""
    _aws_file(tmp_path, "config", "[default]\nendpoint_url = not/a url SHH-VALUE-8\n")
    env = _users_env(tmp_path, seaweed.endpoint_url, AWS_ACCESS_KEY_ID=seaweed.access_key,
                     AWS_SECRET_ACCESS_KEY=seaweed.secret_key)
    del env["AWS_ENDPOINT_URL"]
    result = _cli(env, "ls", "s3://datasets/x")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "credential_process" not in result.stderr and "SHH-VALUE" not in result.stderr, result.stderr
    assert "endpoint_url" in result.stderr, result.stderr


def _signature_shown(text: str, access_key: str) -> list[str]:
    """What of a presigned URL's credentials ``text`` holds: its signature, or the access key
    its X-Amz-Credential names."""
    return [*re.findall(r"X-Amz-Signature=[0-9a-f]{8,}", text), *re.findall(rf"Credential={access_key}", text)]


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_presigned_urls_stay_out_of_urllib3s_debug_log(seaweed, backend, caplog):
    """boto3's ranged GETs and minio's PUTs go on presigned URLs, which urllib3 logs whole at
    DEBUG for every request: anyone reading that log could read the shard (or, with a
    session token, act as the user) for as long as the URL is valid. The request lines
    stay, their signatures do not."""
    client = make_client(seaweed.endpoint_url, seaweed.access_key, seaweed.secret_key, backend=backend)
    bucket = new_bucket(client)
    client.put(bucket, "logged/obj", b"0123456789")
    out = bytearray(4)
    caplog.set_level(logging.DEBUG, logger="urllib3")
    client.get_range_into(bucket, "logged/obj", 2, 6, memoryview(out))
    client.put(bucket, "logged/obj2", b"abc")
    assert out == b"2345"
    assert f"/{bucket}/logged/obj" in caplog.text  # the requests were logged
    assert not _signature_shown(caplog.text, seaweed.access_key), caplog.text
    client.close()
    token = "SHH-TOKEN-VALUE-8"  # in a presigned URL's query, where a session token goes (the server refuses it)
    with_token = make_client(backend=backend, config=StorageConfig(
        endpoint_url=seaweed.endpoint_url, access_key=seaweed.access_key, secret_key=seaweed.secret_key,
        session_token=token))
    with pytest.raises(AccessDenied):
        with_token.get_range_into(bucket, "logged/obj", 2, 6, memoryview(out)) if backend == "boto3" else \
            with_token.put(bucket, "logged/obj3", b"abc")
    assert "X-Amz-Security-Token" in caplog.text and token not in caplog.text, caplog.text
    with_token.close()


def _signatures(text: str, secret_key: str) -> list[str]:
    """The SigV4 signatures of the requests whose StringToSign botocore logged (it holds no
    secret), computed again with ``secret_key`` as botocore computes them."""
    import hashlib
    import hmac

    found = []
    for string_to_sign in re.findall(r"StringToSign:\n(AWS4-HMAC-SHA256\n\S+\n\S+\n[0-9a-f]{64})", text):
        key = ("AWS4" + secret_key).encode()
        for part in string_to_sign.split("\n")[2].split("/"):  # date, region, service, aws4_request
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        found.append(hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest())
    return found


def test_botocores_debug_log_keeps_its_lines_but_not_the_signatures_or_the_session_token(seaweed, caplog):
    """With ``logging.basicConfig(level=logging.DEBUG)``, botocore logs each request it sends
    with its headers (the Authorization header's signature, a session token) and, as it signs,
    the canonical request (the token again) and the signature: enough to replay a request, or
    act as the user while the token lasts. The lines stay, those values do not."""
    caplog.set_level(logging.DEBUG)
    client = make_client(seaweed.endpoint_url, seaweed.access_key, seaweed.secret_key)
    bucket = new_bucket(client)
    client.put(bucket, "logged/obj", b"0123456789")
    out = bytearray(4)
    client.get_range_into(bucket, "logged/obj", 2, 6, memoryview(out))  # a presigned URL
    assert bytes(client.get(bucket, "logged/obj")) == b"0123456789" and out == b"2345"
    client.close()
    token = "SHH-TOKEN-VALUE-9"  # the server refuses it, after botocore has logged the request
    with_token = make_client(config=StorageConfig(
        endpoint_url=seaweed.endpoint_url, access_key=seaweed.access_key, secret_key=seaweed.secret_key,
        session_token=token))
    with pytest.raises(AccessDenied):
        with_token.get(bucket, "logged/obj")
    with_token.close()
    text = caplog.text
    signatures = _signatures(text, seaweed.secret_key)
    assert len(signatures) >= 4, text  # every request was signed, and logged as it was
    assert text.count("Sending http request: <AWSPreparedRequest") >= 4, text
    assert "Authorization" in text and "X-Amz-Security-Token" in text and "CanonicalRequest:" in text, text
    shown = [s for s in signatures if s in text]
    assert not shown, shown
    assert seaweed.secret_key not in text and token not in text


class _MalformedHeaders:
    """A server on 127.0.0.1 whose every answer holds a line that is no header: urllib3 then
    logs a WARNING naming the URL of the request, which Python's ``logging.basicConfig()``
    prints."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                connection, _ = self.listener.accept()
                with connection:
                    request = b""
                    while b"\r\n\r\n" not in request:
                        request += connection.recv(65536) or b"\r\n\r\n"
                    connection.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-3/10\r\n"
                                       b"Content-Length: 4\r\nno header here\r\n\r\n0123")


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_a_url_urllib3_warns_about_holds_no_signature(backend, caplog):
    server = _MalformedHeaders()
    try:
        client = make_client(server.endpoint_url, "AKIAEXAMPLEKEY", "EXAMPLE-SECRET-0123456789", backend=backend)
        caplog.set_level(logging.WARNING, logger="urllib3")
        operation = (lambda: client.get_range_into("bkt", "a/b", 0, 4, memoryview(bytearray(4)))) \
            if backend == "boto3" else (lambda: client.put("bkt", "a/b", b"abcd"))
        with contextlib.suppress(StorageError):
            operation()
        assert "Failed to parse headers" in caplog.text and "/bkt/a/b" in caplog.text
        assert not _signature_shown(caplog.text, "AKIAEXAMPLEKEY"), caplog.text
        client.close()
    finally:
        server.listener.close()


class _EchoesTheSignedRequest:
    """A server on 127.0.0.1 that refuses every request as AWS S3 refuses a signature it does not
    match (its body echoes the request's access key, signature and canonical request, the
    session token there, and all of it again as hex bytes) or an access key it does not know
    (the key echoed): botocore.parsers logs each such body at DEBUG."""

    def __init__(self, code: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = _refusal(code, self.path, self.headers)
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _refusal(code: str, path: str, headers: Message) -> bytes:
    """AWS S3's refusal ``code`` of a request, with the request's own values as AWS echoes them."""
    found = re.search(r"Credential=([^/]+)/([^,]+),.*Signature=(\w+)", headers["Authorization"])
    assert found is not None
    access_key, scope, signature = found.groups()
    echoed = f"<AWSAccessKeyId>{access_key}</AWSAccessKeyId>"
    if code == "SignatureDoesNotMatch":
        date, token = headers["X-Amz-Date"], headers["X-Amz-Security-Token"]
        canonical = (f"GET\n{path}\n\nhost:{headers['Host']}\nx-amz-date:{date}\nx-amz-security-token:{token}"
                     "\n\nhost;x-amz-date;x-amz-security-token\nUNSIGNED-PAYLOAD")
        string_to_sign = f"AWS4-HMAC-SHA256\n{date}\n{scope}\n{'0' * 64}"
        echoed += (f"<StringToSign>{string_to_sign}</StringToSign><SignatureProvided>{signature}</SignatureProvided>"
                   f"<StringToSignBytes>{_hex(string_to_sign)}</StringToSignBytes><CanonicalRequest>{canonical}"
                   f"</CanonicalRequest><CanonicalRequestBytes>{_hex(canonical)}</CanonicalRequestBytes>")
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>refused</Message>{echoed}'
            "<RequestId>0A1B</RequestId><HostId>h</HostId></Error>").encode()


def _hex(text: str) -> str:
    """``text`` as AWS writes it in an error's ``...Bytes`` fields: hex bytes between spaces."""
    return " ".join(f"{b:02x}" for b in text.encode())


@pytest.mark.parametrize("code", ["SignatureDoesNotMatch", "InvalidAccessKeyId"])
def test_an_error_body_echoing_the_signed_request_is_logged_by_botocore_without_its_credentials(code, caplog):
    """AWS S3 answers a signature it does not match with a body that echoes the access key, the
    signature and the canonical request, the session token in it (as text and as hex bytes);
    an access key it does not know, with the key. botocore.parsers logs every response body at
    DEBUG. The lines stay, those values do not."""
    server = _EchoesTheSignedRequest(code)
    access_key, token = "AKIAECHOEDKEY7", "SHH-TOKEN-VALUE-10"
    try:
        client = make_client(config=StorageConfig(endpoint_url=server.endpoint_url, access_key=access_key,
                                                  secret_key="EXAMPLE-SECRET-0123456789", session_token=token))
        caplog.set_level(logging.DEBUG, logger="botocore")
        with pytest.raises(AccessDenied, match=code):
            client.get("bkt", "a/b")
        client.close()
    finally:
        server.close()
    bodies = "\n".join(r.getMessage() for r in caplog.records if r.name == "botocore.parsers")
    assert f"<Code>{code}</Code>" in bodies and "<AWSAccessKeyId>" in bodies, caplog.text  # the lines stay
    if code == "SignatureDoesNotMatch":
        assert "<CanonicalRequest>GET\\n/bkt/a/b" in bodies and "<StringToSign>AWS4-HMAC-SHA256" in bodies, bodies
        assert "x-amz-security-token\\nUNSIGNED-PAYLOAD" in bodies, bodies  # its signed headers, after the token
    for secret in (access_key, token, _hex(token)):
        assert secret not in caplog.text, (secret, caplog.text)
    assert not re.search(r"<SignatureProvided>[0-9a-f]{8}", caplog.text), caplog.text


@pytest.mark.parametrize("output", ["{Version: 1, AccessKeyId: AKID-VALUE-5, SecretAccessKey: SHH-VALUE-5}",
                                    '["SHH-VALUE-5"]'])
def test_a_credential_process_whose_output_is_no_json_is_a_config_error_that_shows_none_of_it(
        seaweed, tmp_path, output):
    """botocore parses a credential_process's output with json.loads and raises what that
    raises: a JSONDecodeError (holding the output, keys and all, in its ``doc``) or an
    AttributeError came through as a traceback from inside botocore, with the output in
    the frames' locals for a traceback that shows them."""
    _aws_file(tmp_path, "config", f"[default]\ncredential_process = printf '%s' '{output}'\n")
    result = _cli(_users_env(tmp_path, seaweed.endpoint_url), "ls", "s3://datasets/x")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("remote-loader: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "credential_process" in result.stderr and "VALUE-5" not in result.stderr, result.stderr
