"""Where a store is and whose keys it signs with: endpoints, AWS profiles and the AWS files,
refused in one line naming what was wrong (never a key), and read by both S3 backends alike."""

from __future__ import annotations

import pytest

from remote_loader import ConfigError, make_client


@pytest.mark.parametrize("backend", ["boto3", "minio"])
@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9OOO", "http://127.0.0.1:99999", "127.0.0.1:99999",
                                      "https://s3.example:0", "http://127.0.0.1:9000x/?X-Amz-Signature=SECRET-1"])
def test_an_endpoint_whose_port_is_no_port_is_refused_naming_it(backend, endpoint):
    with pytest.raises(ConfigError, match="has no valid port: a port is a number from 1 to 65535") as caught:
        make_client(endpoint, "k", "SECRET-2", backend=backend)
    message = str(caught.value)
    assert endpoint.partition("?")[0].removeprefix("http://") in message and "\n" not in message
    assert "SECRET" not in message + repr(caught.value)
