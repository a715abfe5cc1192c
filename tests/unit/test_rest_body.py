"""The REST port's reading of a request before it is parsed (gateway/rest.py): a compressed body is
one whole stream, and the client's deadline header counts from the request's arrival."""
from __future__ import annotations

import gzip
import time
import zlib

import pytest

from batchline.errors import InvalidArgument
from gateway.rest import TIMEOUT_HEADER, RestApp, _deadline, _left

BODY = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}'


def _app() -> RestApp:
    return RestApp(None, None, 1 << 20)  # type: ignore[arg-type]  # reading bodies needs no gateway


def test_a_whole_gzip_or_deflate_stream_is_read():
    assert _app()._decompress(gzip.compress(BODY), "gzip") == BODY
    assert _app()._decompress(zlib.compress(BODY), "deflate") == BODY


@pytest.mark.parametrize("body, says", [
    (gzip.compress(BODY)[:-8], "it ends before the stream does"),  # its CRC and size cut off
    (gzip.compress(BODY) + b"junk", "4 bytes follow the end of the stream"),
    (zlib.compress(BODY)[:-4], "it ends before the stream does"),
])
def test_a_stream_cut_short_or_with_bytes_after_it_is_invalid_argument(body, says):
    encoding = "gzip" if body[:2] == b"\x1f\x8b" else "deflate"
    with pytest.raises(InvalidArgument, match=says):
        _app()._decompress(body, encoding)


def test_the_deadline_header_counts_from_the_arrival_not_from_the_call():
    arrived = time.monotonic() - 0.2  # a body that took 200 ms to upload
    left = _left(_deadline({TIMEOUT_HEADER: b"500"}, arrived))
    assert left is not None and 0.25 < left <= 0.3
    assert _left(_deadline({}, arrived)) is None
    with pytest.raises(InvalidArgument, match="must be a number of milliseconds >= 0"):
        _deadline({TIMEOUT_HEADER: b"-1"}, arrived)


def test_every_refusal_a_reply_can_carry_has_its_http_status():
    from batchline.errors import AlreadyExists, Unimplemented, http_status

    assert (http_status(AlreadyExists("x")), http_status(Unimplemented("x"))) == (409, 501)
