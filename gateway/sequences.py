"""Sequence requests at the gateway: their flags checked against the model, and a sequence's
requests queued one after another, each once the one before it is answered, so that they run in
order (on whichever executor: the state is in Redis, executor/sequences.py)."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import numpy as np

from batchline.codec import DATATYPES
from batchline.errors import InvalidArgument, ResourceExhausted
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.sequences import SequenceFlags, sequence_flags


def check_sequence(request: ipb.ModelInferRequest, model: pb.ModelInfo, rows: int) -> SequenceFlags | None:
    """The request's sequence flags when `model` is a sequence model (None when it is not);
    InvalidArgument for what Triton refuses, in its words."""
    flags = sequence_flags(request)
    if not model.HasField("sequence"):
        if flags.given:
            raise InvalidArgument(f"parameter 'sequence_id': model '{model.name}' has no sequence batching "
                                  "(config.toml [sequence_batching]); send each request on its own")
        return None
    if not flags.given:
        raise InvalidArgument(f"inference request to model '{model.name}' must specify a non-zero or non-empty "
                              "correlation ID: it is a sequence model; set sequence_id (and sequence_start on a "
                              "sequence's first request)")
    if rows != 1:
        raise InvalidArgument(f"a request of sequence {flags.id} to model '{model.name}' has {rows} rows; a "
                              "sequence's requests carry one row each")
    for c in model.sequence.controls:
        if c.kind == "corrid" and isinstance(flags.id, str) and c.datatype != "BYTES":
            raise InvalidArgument(f"model '{model.name}' takes integer sequence ids (its CORRID input '{c.name}' "
                                  f"is {c.datatype}); got the string {flags.id!r}")
        dtype = DATATYPES.get(c.datatype)
        if c.kind == "corrid" and isinstance(flags.id, int) and dtype is not None and dtype.kind in "iu":
            bounds = np.iinfo(dtype)
            if not bounds.min <= flags.corrid(c.datatype) <= bounds.max:
                raise InvalidArgument(f"sequence id {flags.id} does not fit model '{model.name}''s CORRID input "
                                      f"'{c.name}' ({c.datatype}: {bounds.min} to {bounds.max})")
    return flags


class Turn:
    """A request's turn in its sequence. `hold(fate)`: the request gave up while an executor may
    still run it; the sequence's next request waits for `fate` too (the earlier one's run over, or
    known never to come), else it could run beside it, on a state it has not saved yet."""

    def __init__(self) -> None:
        self.fate: asyncio.Future | None = None

    def hold(self, fate: asyncio.Future) -> None:
        self.fate = fate


# Requests of one sequence waiting for their turn on a gateway, at most: each holds its input in the
# gateway's memory and none has begun its budget yet (it starts once queued), so a client sending a
# sequence's steps all at once is told to send the next once one is answered.
MAX_WAITING = 64
WAITING_RETRY_S = 0.1


class SequenceOrder:
    """Each sequence's requests on this gateway, in arrival order: one waits for the one before it."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str, str], asyncio.Future] = {}  # (model, version, key) -> its newest request
        self._waiting: dict[tuple[str, str, str], int] = {}  # requests waiting for their turn, per sequence
        self.releasing: set[asyncio.Task] = set()  # turns held past their request's end

    def __len__(self) -> int:
        return len(self._last)

    @contextlib.asynccontextmanager
    async def turn(self, model: str, version: str, sequence: str) -> AsyncIterator[Turn]:
        """Until the sequence's previous request here is over; then the caller's request runs.
        `sequence`: its key (batchline.sequences.sequence_key). ResourceExhausted when MAX_WAITING
        of its requests wait already."""
        key = (model, version, sequence)
        before = self._last.get(key)
        waiting = self._waiting.get(key, 0)
        if before is not None and waiting >= MAX_WAITING:
            raise ResourceExhausted(f"model '{model}': {waiting} requests of this sequence wait for their turn on "
                                    f"this gateway already (at most {MAX_WAITING}): send the next once one is "
                                    "answered", retry_after_s=WAITING_RETRY_S)
        mine = asyncio.get_running_loop().create_future()
        self._last[key] = mine
        turn = Turn()
        try:
            if before is not None:
                self._waiting[key] = waiting + 1
                try:
                    await asyncio.shield(before)  # (a cancelled wait must not cancel the request before)
                finally:
                    left = self._waiting[key] - 1
                    if left:
                        self._waiting[key] = left
                    else:
                        del self._waiting[key]
            yield turn
        finally:
            # The next one goes after this one and the one before it, even when this one gave up early.
            pending = [f for f in (before, turn.fate) if f is not None and not f.done()]
            if not pending:
                _over(self._last, key, mine)
            else:
                task = asyncio.ensure_future(_after(pending, self._last, key, mine))
                self.releasing.add(task)
                task.add_done_callback(self.releasing.discard)


async def _after(pending: list[asyncio.Future], last: dict, key: tuple, fut: asyncio.Future) -> None:
    try:
        await asyncio.wait(pending)
    finally:
        _over(last, key, fut)


def _over(last: dict, key: tuple, fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
    if last.get(key) is fut:
        del last[key]
