"""Running a batch's members on a model: as few runs as their shapes allow, off the event loop;
a member that makes the model fail is run again alone so that only it fails. And each member's
answer, as the Reply its gateway waits for."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np

from batchline.clock import now_us
from batchline.codec import decode_inputs, encode_array, onnx_strings
from batchline.errors import BatchlineError, DeadlineExceeded, Internal, InvalidArgument, Unavailable, status_value
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.sizing import row_length
from batchline.regions import RegionUnreadable
from executor import shared_memory
from executor.batching import assemble, check_rows, split
from executor.repository import LoadedModel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Member:
    """One request of a batch, from its queue entry to its outputs or its error."""
    entry: pb.QueueEntry
    request: ipb.ModelInferRequest | None = None
    inputs: dict[str, np.ndarray] | None = None
    outputs: dict[str, np.ndarray] | None = None
    error: BatchlineError | None = None
    answered_elsewhere: bool = False  # another run of it answers (a stale sequence step): no reply here


def decoded(entry: pb.QueueEntry, blob: bytes, model: LoadedModel | None, batch: pb.Batch, executor_id: str) -> Member:
    """A member from its queue entry and payload; with its error when it cannot be run."""
    m = Member(entry)
    if model is None:
        # The scheduler's registry was behind this executor's (e.g. a reload): not the client's fault.
        m.error = Unavailable(f"executor {executor_id} no longer serves model '{batch.model_name}' version "
                              f"'{batch.model_version}': retry")
        return m
    try:
        m.request = ipb.ModelInferRequest.FromString(blob)
        m.inputs = decode_inputs(m.request, shared_memory.read_inputs(m.request))
        for name in model.string_inputs:
            m.inputs[name] = onnx_strings(m.inputs[name], name)
    except BatchlineError as exc:
        m.error = exc
    except Exception as exc:  # noqa: BLE001 - a corrupt payload fails alone
        # The gateway validated it before queueing: what fails here is on the server's side.
        m.error = Internal(f"the request's payload could not be decoded on executor {executor_id} ({exc})")
    return m


def expire_late(members: list[Member], now_us: int, model_name: str, executor_id: str) -> list[Member]:
    """Answer DEADLINE_EXCEEDED to the members whose deadline passed (while they waited for the
    batch ahead to run); the others, to run."""
    for m in members:
        if 0 < m.entry.deadline_us < now_us:
            m.error = DeadlineExceeded(
                f"deadline exceeded: it had to be run within "
                f"{(m.entry.deadline_us - m.entry.enqueued_us) / 1e3:.1f} ms "
                f"of arriving (its budget less the gateway's answer margin), and that passed while it waited for "
                f"model '{model_name}' on executor {executor_id} (it was not run; "
                "retry with a larger timeout or less load)")
    return [m for m in members if m.error is None]


async def run(model: LoadedModel, members: list[Member], executor_id: str = "") -> int:
    """Run the members (in as few model runs as their shapes allow); return the units run. A
    member whose deadline passes before its run begins is answered without running (its gateway
    gave up: nothing may run for it after its deadline, docs/design/sequences.md)."""
    batched = model.info.max_batch_size > 0
    groups = assemble([m.inputs for m in members], model.padding, batched)
    units = 0
    for n, group in enumerate(groups):
        group_members = [members[i] for i in group.members]
        if n and not expire_late(group_members, now_us(), model.name, executor_id):
            continue
        units += sum(group.rows) * row_length(model.info, {name: arr.shape for name, arr in group.inputs.items()})
        try:
            outputs = await asyncio.to_thread(_session_run, model, group.inputs)
            parts = split(outputs, group.rows, batched)
        except Exception as exc:  # noqa: BLE001
            if len(group_members) == 1:
                group_members[0].error = InvalidArgument(f"model '{model.name}' failed on this request: {exc}")
                continue
            # Someone in the group poisons the run (or its outputs cannot be split by rows): retry each
            # alone so only the culprit fails.
            log.warning("%s: batch of %d failed (%s); retrying members one by one", model.name, len(group_members), exc)
            units += await _run_singly(model, group_members, executor_id)
            continue
        for m, out in zip(group_members, parts):
            m.outputs = out
    return units


async def _run_singly(model: LoadedModel, members: list[Member], executor_id: str) -> int:
    """Run each member alone; return the units run (the batch's time counts these runs too)."""
    units = 0
    for m in members:
        if not expire_late([m], now_us(), model.name, executor_id):
            continue
        units += m.entry.rows * row_length(model.info, {name: arr.shape for name, arr in m.inputs.items()})
        try:
            outputs = await asyncio.to_thread(_session_run, model, m.inputs)
            if model.info.max_batch_size > 0:
                check_rows(outputs, m.entry.rows)
            m.outputs = outputs
        except Exception as exc:  # noqa: BLE001
            m.error = InvalidArgument(f"model '{model.name}' failed on this request: {exc}")
    return units


def _session_run(model: LoadedModel, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # A sequence model's state outputs too: the next step's state (executor/sequences.py).
    names = model.run_outputs
    return dict(zip(names, model.session.run(names, feeds)))


def reply(model: LoadedModel | None, m: Member) -> pb.Reply:
    if m.error is not None or m.outputs is None:
        error = m.error or Internal("the model produced no output for this request")
        return pb.Reply(request_id=m.entry.request_id, code=status_value(error), message=str(error),
                        region_unreadable=isinstance(error, RegionUnreadable))
    req = m.request
    r = pb.Reply(request_id=m.entry.request_id, code=0)
    # Filled in place: a response passed to Reply() would be copied into it.
    response = r.response
    response.model_name, response.model_version, response.id = model.name, model.version, req.id
    wanted = [o.name for o in req.outputs] or model.output_names
    for name in wanted:
        datatype, shape, raw = encode_array(m.outputs[name])
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        response.raw_output_contents.append(raw)
    try:
        shared_memory.write_outputs(req, response)
    except BatchlineError as exc:
        return pb.Reply(request_id=m.entry.request_id, code=status_value(exc), message=str(exc),
                        region_unreadable=isinstance(exc, RegionUnreadable))
    return r
