"""One generation request on an executor: its prompt and parameters, its tokens streamed to its gateway.

The first token made here goes at once, alone (time to first token); the next ones are held and go
as one response of several tokens (a partial Reply numbered by its last token's index in the output)
when `FLUSH_TOKENS` are held or `FLUSH_S` has passed since the model's last write, whichever comes
first, in one Redis round trip with the other streams' writes of that step (executor/generation_writes.py).
Each write also records the tokens sent so far, where an executor that takes the request over after
this one died continues from (prompt plus those tokens, recomputed); the gateway drops a response
whose last index it has forwarded already, so the client's stream has neither a duplicate nor a gap.
The rest of the output travels in the final Reply, with the batch's own write, so that the client
sees it flagged final.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from batchline import metrics
from batchline.codec import decode_inputs, encode_array
from batchline.contract.executor_store import ExecutorStore
from batchline.errors import BatchlineError, Internal, InvalidArgument, Unavailable, status_value
from batchline.heartbeats import HeartbeatTrust
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS
from batchline.sampling import SamplingParams, sampling_params
from executor.generation_trace import SequenceTrace
from executor.generation_writes import StreamWrites
from executor.generation_serving import IDS_INPUT, TEXT_INPUT, TEXT_OUTPUT, TOKENS_OUTPUT, GenerationModel

log = logging.getLogger(__name__)

FLUSH_TOKENS = 8
FLUSH_S = 0.05

def prompt_ids(request: ipb.ModelInferRequest, model: GenerationModel) -> list[int]:
    """The prompt's token ids, from `input_ids` or from the text in `text_input`."""
    inputs = decode_inputs(request)
    if IDS_INPUT in inputs:
        return inputs[IDS_INPUT].reshape(-1).tolist()  # the engine checks them against the vocabulary
    text = inputs[TEXT_INPUT].reshape(-1)[0] if TEXT_INPUT in inputs and inputs[TEXT_INPUT].size else None
    if text is None:
        raise InvalidArgument(f"model '{model.info.name}' needs the prompt in input '{TEXT_INPUT}' (BYTES [1]) or "
                              f"'{IDS_INPUT}' (INT64 [n])")
    try:
        prompt = text.decode() if isinstance(text, bytes) else str(text)
    except UnicodeDecodeError:
        raise InvalidArgument(f"input '{TEXT_INPUT}' is not UTF-8 text") from None
    return model.tokenizer.encode(prompt, add_special_tokens=False).ids


def token_response(model: GenerationModel, request: ipb.ModelInferRequest, text: str,
                   tokens: list[int]) -> ipb.ModelInferResponse:
    """A response of `tokens` and the `text` they add."""
    response = ipb.ModelInferResponse(model_name=model.info.name, model_version=model.info.version, id=request.id)
    for name, array in ((TEXT_OUTPUT, np.array([text.encode()], dtype=object)),
                        (TOKENS_OUTPUT, np.array(tokens, dtype=np.int64))):
        datatype, shape, raw = encode_array(array)
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        response.raw_output_contents.append(raw)
    return response


@dataclass
class Stream:
    """One request's tokens on their way to its gateway."""

    writes: StreamWrites
    model: GenerationModel
    request: ipb.ModelInferRequest
    entry: pb.QueueEntry
    tokens: list[int]  # every output token, those another executor sent included
    held: list[tuple[str, list[int]]] = field(default_factory=list)  # the steps' outputs not pushed yet
    awaited: bool = True
    trace: SequenceTrace | None = None
    heartbeats: HeartbeatTrust = field(default_factory=HeartbeatTrust)

    def __post_init__(self) -> None:
        self.resumed = len(self.tokens)
        self.flushed_at = time.monotonic()  # this stream's own flush clock

    @property
    def pushed(self) -> int:
        """Of `tokens`, those its gateway was sent (or another executor sent it)."""
        return len(self.tokens) - sum(len(ids) for _, ids in self.held)

    def add(self, text: str, tokens: list[int]) -> None:
        self.tokens += tokens
        self.held.append((text, tokens))

    def due(self) -> bool:
        """Whether the held tokens go now: the first one made here at once (time to first token), then
        when FLUSH_TOKENS are held or FLUSH_S has passed since this stream's last write, or with a write
        another stream asked for in this turn (it costs no round trip more). Not a clock of the model's
        writes: whichever stream reaches FLUSH_TOKENS every step would reset it, and hold the others'
        tokens until they had as many."""
        held = sum(len(ids) for _, ids in self.held)
        return bool(held) and (self.pushed == self.resumed or held >= FLUSH_TOKENS
                               or time.monotonic() - self.flushed_at >= FLUSH_S or self.writes.asked)

    def due_in(self) -> float | None:
        """Seconds until the held tokens go by the clock (None: none held): what a stream whose next
        token is slow in coming (a long step, or its sequence preempted) waits at most."""
        if not self.held:
            return None
        return max(0.0, FLUSH_S - (time.monotonic() - self.flushed_at))

    def take(self, limit: int | None = None) -> list[pb.Reply]:
        """The held outputs (whole, FLUSH_TOKENS tokens at most unless one output has more) as
        responses of one or more tokens, numbered by their last token's index. A continued sequence's
        first FLUSH_TOKENS tokens go one a response: the executor before it may have pushed up to a
        write's worth past its record, and the gateway drops what it forwarded already by index, a
        whole response at a time."""
        start = self.pushed
        single = self.resumed + FLUSH_TOKENS if self.resumed else 0
        groups: list[tuple[int, list[str], list[int]]] = []  # each response's first index, texts and tokens
        n = 0
        while self.held and (n == 0 or limit is None or n + len(self.held[0][1]) <= limit):
            text, ids = self.held.pop(0)
            if not groups or start + n < single or groups[-1][0] < single:
                groups.append((start + n, [], []))
            groups[-1][1].append(text)
            groups[-1][2].extend(ids)
            n += len(ids)
        return [pb.Reply(request_id=self.entry.request_id, partial=True, index=first + len(ids) - 1,
                         response=token_response(self.model, self.request, "".join(texts), ids))
                for first, texts, ids in groups]

    async def flush(self) -> None:
        """Push the held tokens (a write's FLUSH_TOKENS at most) with the other streams' writes; whether
        the request is still awaited (its payload is there and its gateway's heartbeat too) is read in
        the same round trip."""
        before = self.pushed
        self.flushed_at = time.monotonic()
        replies = self.take(FLUSH_TOKENS)
        entry = self.entry
        self.awaited = await self.writes.write(
            entry.gateway_id, [r.SerializeToString() for r in replies], entry.request_id,
            np.asarray(self.tokens[:self.pushed], np.int64).tobytes(), self.heartbeats.heartbeats_tell(),
            entry.deadline_us)
        if self.trace is not None:
            self.trace.flush(len(replies), self.pushed - before)


async def serve(store: ExecutorStore, model: GenerationModel, entry: pb.QueueEntry, blob: bytes,
                sent: bytes | None, heartbeats: HeartbeatTrust | None = None) -> pb.Reply | None:
    """Generate the request's tokens, streaming them; its final Reply (None: nobody awaits it any more).
    `sent`: the tokens already sent for it by an executor that died (int64 bytes), continued from.
    `heartbeats`: whether a gateway's missing heartbeat says it died (then the sequence ends)."""
    key = (model.info.name, model.info.version)
    request_id = entry.request_id
    try:
        request = ipb.ModelInferRequest.FromString(blob)
        params = sampling_params(request, request_id)
        prompt = prompt_ids(request, model)
    except BatchlineError as exc:
        return pb.Reply(request_id=request_id, code=status_value(exc), message=str(exc))
    made = np.frombuffer(sent, np.int64).tolist() if sent else []
    if model.loop.generating(request_id):
        # Delivered again while its first delivery still generates here (its batch was handed back
        # while this executor looked gone): that one streams and answers it; this one adds nothing.
        log.warning("request %s is already generating on this executor: its second delivery is dropped", request_id)
        return None
    trace = SequenceTrace(entry, *key, len(prompt), len(made))
    finish = "cancelled"
    reply: pb.Reply | None = None
    try:
        if model.writes is None or model.writes.store is not store:
            model.writes = StreamWrites(store, key)
        stream = Stream(model.writes, model, request, entry, list(made), trace=trace,
                        heartbeats=heartbeats or HeartbeatTrust())
        reply, finish = await _generate(stream, trace, model, request, params, prompt, made)
        return reply
    finally:
        # A reply of an error ends its span failed; None: nobody awaits the sequence any more.
        failed = reply is not None and reply.code != 0
        trace.end("error" if failed else finish, reply.message if failed else "")


async def _generate(stream: Stream, trace: SequenceTrace, model: GenerationModel, request: ipb.ModelInferRequest,
                    params: SamplingParams, prompt: list[int], made: list[int]) -> tuple[pb.Reply | None, str]:
    """The request's final Reply (None: cancelled) and why its sequence ended."""
    entry, request_id = stream.entry, stream.entry.request_id
    engine = model.engine
    if made and (len(made) >= params.max_tokens or len(prompt) + len(made) >= engine.config.max_context
                 or (made[-1] in engine.eos and not params.ignore_eos)):
        # Every token was sent before the executor died, all but the final write.
        return pb.Reply(request_id=request_id, code=0, index=len(made)), "length"
    if made:
        log.info("request %s continues from the %d tokens sent before its executor failed", request_id, len(made))
    labels = (model.info.name, model.info.version)
    first_s = last_s = 0.0
    finish = "cancelled"
    generated = model.loop.generate(request_id, prompt, params, entry.priority or 1, made, idle=stream.due_in)
    try:
        async for out in generated:
            # None: no token came before the held ones were due (a long step, the sequence preempted).
            if out is not None:
                if out.token_ids:
                    last_s = time.time()
                    if not first_s:
                        first_s = last_s
                        if not made:
                            metrics.GENERATION_TTFT.labels(*labels).observe(
                                max(0.0, first_s - entry.enqueued_us / 1e6))
                trace.step(out, len(stream.tokens))
                stream.add(out.text, list(out.token_ids))
                if out.finished:
                    finish = out.finish_reason or finish
                    break
                if model.ending:  # released here while it generates: what it made is sent, then the refusal
                    await stream.flush()
                    error = Unavailable(model.ending)
                    return pb.Reply(request_id=request_id, code=status_value(error), message=str(error)), "unloaded"
            if out is None or stream.due():
                await stream.flush()
                if not stream.awaited:  # cancelled, timed out, or its gateway died: leaving frees its cache
                    log.info("request %s: nobody awaits it any more (cancelled, timed out or its gateway %s is "
                             "gone): its sequence ends after %d tokens", request_id, entry.gateway_id,
                             len(stream.tokens))
                    return None, "cancelled"
    except ValueError as exc:
        if made and "stop string" in str(exc):
            return pb.Reply(request_id=request_id, code=0, index=len(made)), "stop"  # it ended before the executor died
        error = InvalidArgument(str(exc))
        return pb.Reply(request_id=request_id, code=status_value(error), message=str(error)), "error"
    except REDIS_ERRORS:
        raise  # Redis stayed away through the writes' patience: the batch goes back to its queue by recovery
    except Exception as exc:  # noqa: BLE001 - a failed run ends the request, not the executor
        error = Internal(f"generation failed on the executor: {exc}")
        return pb.Reply(request_id=request_id, code=status_value(error), message=str(error)), "error"
    finally:
        await generated.aclose()
    if finish == "cancelled":
        return None, "cancelled"  # ended by a cancel: never a success, whoever reads it
    made_here = len(stream.tokens) - len(made)
    if made_here > 1:
        metrics.GENERATION_TPOT.labels(*labels).observe((last_s - first_s) / (made_here - 1))
    while len(stream.tokens) - stream.pushed > FLUSH_TOKENS:  # (the final Reply carries one response)
        await stream.flush()
    if not stream.awaited:
        return None, "cancelled"
    if not stream.held:
        return pb.Reply(request_id=request_id, code=0, index=len(stream.tokens)), finish
    # The rest travels in the final Reply, with the batch's own write: the client sees it flagged final.
    *before, last = stream.take()
    if before:
        await stream.writes.write(entry.gateway_id, [r.SerializeToString() for r in before], request_id,
                                  np.asarray(stream.tokens[:before[-1].index + 1], np.int64).tobytes(),
                                  stream.heartbeats.heartbeats_tell(), entry.deadline_us)
    return pb.Reply(request_id=request_id, code=0, index=last.index, response=last.response), finish
