"""Keep the credentials of signed requests out of urllib3's and botocore's log records.

Both S3 backends send some requests on presigned URLs (boto3's ranged GETs, minio's PUTs and
parts), whose query holds ``X-Amz-Signature``, the access key in ``X-Amz-Credential`` and any
``X-Amz-Security-Token``: a bearer credential for as long as the URL is valid. urllib3 logs the
URL of each request at DEBUG, and at WARNING where a connection breaks before a retry or an
answer's headers do not parse (which ``logging.basicConfig()`` prints). botocore logs at DEBUG
each request it sends with its headers (``Authorization``, with the signature and the access
key, and ``X-Amz-Security-Token``), and, as it signs, the canonical request (the token again)
and the signature itself; botocore.parsers logs at DEBUG the body of each answer, and AWS S3's
refusal of a signature echoes the access key, the signature provided and the canonical request
(a session token in it, as text and as hex bytes). A filter on those loggers writes these
values as ``...``; the rest of each record is kept (the StringToSign among it, which holds no
secret).
"""

from __future__ import annotations

import logging
import re

_SIGNED = re.compile(
    r"((?:X-Amz-)?(?:Signature|Credential|Security-Token)="  # a presigned URL's query; Authorization's fields
    r"|(?:Signature|X-Amz-Security-Token)'?:\s*b?['\"]?"  # botocore.auth's "Signature:\n..."; a header, as a
    # dict's repr shows it or a canonical request holds it
    r"|Authorization'?:\s*b?['\"]?AWS )"  # a SigV2 header: "AWS <access key>:<signature>"
    r"[^&\s'\"()<>,}\\]+",  # up to a backslash too: a line's end in a body's repr
    re.IGNORECASE,
)
_ECHOED = re.compile(r"(<(?:AWSAccessKeyId|SignatureProvided|CanonicalRequestBytes)>)[^<]+", re.IGNORECASE)
"""What an S3 error body echoes of a request: its access key, its signature, and its canonical
request as hex bytes (a session token among them)."""
_MARKS = ("x-amz-", "signature", "authorization", "accesskeyid", "canonicalrequest")
_LOGGERS = (
    "urllib3.connectionpool", "urllib3.connection", "urllib3.poolmanager", "urllib3.util.retry",
    "botocore.endpoint", "botocore.auth", "botocore.utils", "botocore.parsers",
)
"""The loggers whose records name a request's URL, its headers or what signs it (a filter acts
on its own logger's records only): urllib3's, botocore's request log, its signers', and its
parsers' (the bodies of answers, which may echo the request)."""


class _Unsigned(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot be formatted: the handler says so, as before
            return True
        lowered = message.lower()
        if any(mark in lowered for mark in _MARKS):
            record.msg, record.args = _ECHOED.sub(r"\1...", _SIGNED.sub(r"\1...", message)), None
        return True


_FILTER = _Unsigned()


def hide_signatures() -> None:
    """Install the filter on urllib3's and botocore's loggers (once: a logger keeps one copy of
    a filter)."""
    for name in _LOGGERS:
        logging.getLogger(name).addFilter(_FILTER)
