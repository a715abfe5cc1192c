"""The gateway's error answer when the call has already ended inside gRPC (a pure unit: a fake context)."""
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
