"""The servicer's pure units: its error answer when the call has already ended inside gRPC (a fake
context), and a stream's key for a request's sequence."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from batchline.errors import RETRY_AFTER_KEY, ResourceExhausted
from gateway.servicer import _abort


class _EndedCall:
    """A servicer context whose call ended (its deadline passed) before the status could be sent."""

    def __init__(self) -> None:
        self.trailing = None
        self.aborted = None

    def set_trailing_metadata(self, md) -> None:
        self.trailing = md

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.InternalError("the call is already finished")


async def test_an_answer_to_a_call_that_already_ended_is_a_cancellation_not_an_error():
    context = _EndedCall()
    with pytest.raises(asyncio.CancelledError):
        await _abort(context, ResourceExhausted("queue full", retry_after_s=0.25))
    # It tried to send the real status, with the retry hint, before giving up.
    assert context.aborted == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    assert context.trailing == ((RETRY_AFTER_KEY, "250"),)


def test_an_answer_that_finds_its_call_over_is_not_logged_as_an_error(caplog):
    import logging

    from grpc._cython import cygrpc

    from batchline.grpc_server import _AnswerAfterTheEnd  # importing it installs it

    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    assert any(isinstance(f, _AnswerAfterTheEnd) for f in grpc_log.filters)
    try:
        raise cygrpc.ExecuteBatchError('Failed "execute_batch"')
    except cygrpc.ExecuteBatchError:
        with caplog.at_level(logging.DEBUG):
            grpc_log.exception("ExecuteBatchError raised in core by servicer method "
                               "[/inference.GRPCInferenceService/ModelInfer]")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("already over" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
    # Any other error grpc logs still shows.
    try:
        raise ValueError("a servicer bug")
    except ValueError:
        grpc_log.exception("Unexpected error")
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == ["Unexpected error"]


def test_a_streams_sequence_key_is_the_sequences_own_unsigned_id():
    from batchline.protocol import inference_pb2 as ipb
    from gateway.servicer import _sequence_of

    def request(kind: str, value) -> ipb.ModelInferRequest:
        r = ipb.ModelInferRequest(model_name="m")
        setattr(r.parameters["sequence_id"], kind, value)
        return r

    assert _sequence_of(request("int64_param", -1)) == _sequence_of(request("uint64_param", 2**64 - 1))
    assert _sequence_of(request("int64_param", 7)) != _sequence_of(request("string_param", "7"))
    assert _sequence_of(ipb.ModelInferRequest(model_name="m")) is None
