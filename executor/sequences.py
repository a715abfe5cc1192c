"""One step of each sequence in a batch: its control inputs filled from its flags, its state read
from Redis before the run and saved after it.

A step that runs twice (its batch handed to another executor after the first one died before
answering) finds its own request id as the last step applied and runs again from the state that
step ran from, so it gives the same answer and leaves the same state. A run of a batch that
another executor already finished (this one was only slow) finds its request among the steps
before the last and does not run; racing the next step's save, it finds the step count moved on
and its write is refused (batchline/contract/scripts.py SAVE_SEQUENCES_LUA).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchline.codec import DATATYPES
from batchline.contract.executor_store import ExecutorStore
from batchline.errors import InvalidArgument, Unavailable
from batchline.protocol import internal_pb2 as pb
from batchline.sequences import SequenceFlags, sequence_flags, sequence_key
from executor.repository import LoadedModel
from executor.running import Member

# How many steps before the last a sequence's state remembers, to refuse a stale run of one: a
# batch is handed to another executor only once its first one stopped answering for seconds, by
# which time a sequence has moved on a few steps at most unless its steps come faster than that.
EARLIER_KEPT = 16


@dataclass(slots=True)
class Step:
    member: Member
    flags: SequenceFlags
    found: int           # the sequence's step count as read
    before: list[bytes]  # the state this step runs from, one raw tensor per state
    again: bool = False  # the saved state's last step is this one: it runs again
    saved: pb.SequenceState | None = None  # as read

    @property
    def key(self) -> str:
        return sequence_key(self.flags, self.member.entry.tenant)


def is_sequence_model(model: LoadedModel | None) -> bool:
    return model is not None and model.info.HasField("sequence")


def _graph_shapes(model: LoadedModel) -> dict[str, list]:
    return {i.name: list(i.shape) for i in model.session.get_inputs()}


def _feed_shape(graph_shape: list, batched: bool) -> list[int]:
    """One request's (one row's) shape of a control input."""
    dims = [d if isinstance(d, int) and d > 0 else 1 for d in graph_shape]
    if batched and dims:
        dims[0] = 1
    return dims


def _start_message(flags: SequenceFlags, model: LoadedModel) -> str:
    # Triton's words first (its clients match them), then why batchline has no such sequence.
    return (f"inference request for sequence {flags.id} to model '{model.name}' must specify the START flag on the "
            "first request of the sequence: no sequence with this id is running (it never started, it ended, or it "
            f"was idle longer than max_sequence_idle_microseconds = {model.info.sequence.max_idle_us})")


async def begin(store: ExecutorStore, model: LoadedModel, members: list[Member]) -> list[Step]:
    """Read the runnable members' sequences and fill their control and state inputs; a member that
    cannot run (no START for an unknown sequence) gets its error."""
    seq = model.info.sequence
    steps: list[Step] = []
    seen: set[str] = set()
    for m in members:
        if m.error is not None or m.request is None:
            continue
        try:
            flags = sequence_flags(m.request)
        except InvalidArgument as exc:  # (the gateway checked them: a payload not from a gateway)
            m.error = exc
            continue
        key = sequence_key(flags, m.entry.tenant)
        if key in seen:
            # The gateway runs a sequence's requests one after another; two gateways may not.
            m.error = Unavailable(f"another request of sequence {flags.id} is in the same batch; send a sequence's "
                                  "requests one after another, through one gateway")
            continue
        seen.add(key)
        steps.append(Step(m, flags, 0, []))
    if not steps:
        return []
    # The idle time counts again from here: a step that reads its state just before it expires
    # must not find it gone when it saves, having run.
    blobs = await store.sequence_states((model.name, model.version), [s.key for s in steps],
                                        max(1, seq.max_idle_us // 1000))
    batched = model.info.max_batch_size > 0
    shapes = _graph_shapes(model)
    initial = [np.zeros([1, *s.shape], DATATYPES[s.datatype]).tobytes() for s in seq.states]
    runnable = []
    for step, blob in zip(steps, blobs):
        m, flags = step.member, step.flags
        saved = pb.SequenceState.FromString(blob) if blob is not None else None
        step.found, step.saved = (saved.steps, saved) if saved is not None else (0, None)
        if saved is not None and m.entry.request_id in saved.earlier:
            # A run of a batch that another executor finished (this one was only slow): already answered.
            m.error = Unavailable(f"this request of sequence {flags.id} ran already, and its sequence moved on")
            continue
        if saved is not None and saved.request_id == m.entry.request_id:
            step.before, step.again = list(saved.before), True  # from the state it ran from
        elif flags.start:
            step.before = initial
        elif saved is None or saved.ended:
            m.error = InvalidArgument(_start_message(flags, model))
            continue
        else:
            step.before = list(saved.after)
        values = {"start": int(flags.start), "end": int(flags.end), "ready": 1}
        try:
            for c in seq.controls:
                dtype = DATATYPES[c.datatype]
                value = flags.corrid(c.datatype) if c.kind == "corrid" else values[c.kind]
                m.inputs[c.name] = np.full(_feed_shape(shapes[c.name], batched), value,
                                           dtype=object if c.datatype == "BYTES" else dtype)
            for s, raw in zip(seq.states, step.before):
                m.inputs[s.input] = np.frombuffer(raw, DATATYPES[s.datatype]).reshape([1, *s.shape])
        except (OverflowError, ValueError, TypeError) as exc:
            # This member's id or saved state does not fit the model's inputs (an id past its CORRID
            # type, a state saved under another shape): it alone is refused; its batch runs.
            m.error = InvalidArgument(f"sequence {flags.id}: its controls or state do not fit model "
                                      f"'{model.info.name}' ({exc})")
            continue
        runnable.append(step)
    return runnable


async def finish(store: ExecutorStore, model: LoadedModel, steps: list[Step]) -> None:
    """Save the state each step that ran left; a step whose sequence moved on meanwhile (a stale
    run) is answered UNAVAILABLE instead (its gateway has its answer already)."""
    seq = model.info.sequence
    done = [s for s in steps if s.member.error is None and s.member.outputs is not None]
    writes = []
    for s in done:
        m = s.member
        after = [np.ascontiguousarray(m.outputs[st.output], DATATYPES[st.datatype]).tobytes() for st in seq.states]
        state = pb.SequenceState(request_id=m.entry.request_id, before=s.before, after=after, ended=s.flags.end,
                                 steps=s.found if s.again else s.found + 1, earlier=_earlier(s))
        writes.append((s.key, m.entry.request_id, s.found, state.steps, state.SerializeToString()))
    ttl_ms = max(1, seq.max_idle_us // 1000)
    saved = await store.save_sequence_states((model.name, model.version), writes, ttl_ms)
    for s, ok in zip(done, saved):
        if ok == 2:
            # Another run of this very request saved the step, and its answer is on its way: this
            # stale run's refusal must not reach the gateway first.
            s.member.outputs = None
            s.member.answered_elsewhere = True
        elif not ok:
            s.member.outputs = None
            s.member.error = Unavailable(f"sequence {s.flags.id} moved on while this request ran (it ran twice, "
                                         "or its client gave up on it): its step is not applied")



def _earlier(step: Step) -> list[str]:
    """The steps applied before this one, as its state will remember them."""
    if step.saved is None:
        return []
    kept = list(step.saved.earlier)
    if not step.again:
        kept.append(step.saved.request_id)
    return kept[-EARLIER_KEPT:]
