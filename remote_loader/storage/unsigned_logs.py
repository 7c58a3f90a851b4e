"""Keep the credentials of presigned URLs out of urllib3's log records.

Both S3 backends send some requests on presigned URLs (boto3's ranged GETs, minio's PUTs and
parts), whose query holds ``X-Amz-Signature``, the access key in ``X-Amz-Credential`` and any
``X-Amz-Security-Token``: a bearer credential for as long as the URL is valid. urllib3 logs the
URL of each request at DEBUG, and at WARNING where a connection breaks before a retry or an
answer's headers do not parse (which ``logging.basicConfig()`` prints). A filter on its loggers
writes those values as ``...``; the rest of each record is kept.
"""

from __future__ import annotations

import logging
import re

_SIGNED = re.compile(r"(X-Amz-(?:Signature|Credential|Security-Token)=)[^&\s'\"()<>]*", re.IGNORECASE)
_LOGGERS = ("urllib3.connectionpool", "urllib3.connection", "urllib3.poolmanager", "urllib3.util.retry")
"""urllib3's loggers whose records name a request's URL (a filter acts on its own logger's records only)."""


class _Unsigned(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot be formatted: the handler says so, as before
            return True
        if "x-amz-" in message.lower():
            record.msg, record.args = _SIGNED.sub(r"\1...", message), None
        return True


_FILTER = _Unsigned()


def hide_signatures() -> None:
    """Install the filter on urllib3's loggers (once: a logger keeps one copy of a filter)."""
    for name in _LOGGERS:
        logging.getLogger(name).addFilter(_FILTER)
