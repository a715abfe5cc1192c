"""Generation streams' writes on an executor against a real Redis: the writes asked for in one turn
of the event loop go in one round trip, each recording its tokens and learning whether its request
is still awaited; a stream's held tokens go as responses of several tokens, a continued stream's
first ones alone (docs/design/generation.md#through-the-mesh)."""
from __future__ import annotations

import asyncio
import uuid

import numpy as np

from batchline.contract import keys as k
from batchline.contract.executor_store import ExecutorStore
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import connect, connect_blocking
from executor.generation_requests import FLUSH_S, FLUSH_TOKENS, Stream
from executor.generation_serving import GenerationModel
from executor.generation_writes import StreamWrites

MODEL = ("gpt", "1")


def test_writes_asked_in_one_turn_go_in_one_round_trip(redis_server):
    async def scenario() -> None:
        client = connect(redis_server.url, 2)
        store = ExecutorStore(client, connect_blocking(redis_server.url, 2))
        writes = StreamWrites(store, MODEL)
        gateways = [f"gw-{uuid.uuid4().hex[:8]}" for _ in range(2)]
        ids = [uuid.uuid4().hex for _ in range(6)]
        for request_id in ids[:5]:  # the sixth was answered or cancelled: its payload is gone
            await client.set(k.payload(MODEL, request_id), b"x", ex=60)
        sent = {r: np.arange(i + 1, dtype=np.int64).tobytes() for i, r in enumerate(ids)}
        awaited = await asyncio.gather(*(
            writes.write(gateways[i % 2], [f"{r}-a".encode(), f"{r}-b".encode()], r, sent[r], False)
            for i, r in enumerate(ids)))
        assert writes.round_trips == 1
        assert awaited == [True] * 5 + [False]
        for g, gateway_id in enumerate(gateways):
            pushed = await client.lrange(k.reply(gateway_id), 0, -1)
            assert pushed == [f"{r}-{x}".encode() for r in ids[g::2] for x in "ab"]
        assert [await client.get(k.generated(MODEL, r)) for r in ids] == [sent[r] for r in ids]
        assert await writes.write(gateways[0], [], ids[0], sent[ids[0]], False)
        assert writes.round_trips == 2

    asyncio.run(scenario())


def test_the_record_of_tokens_sent_lives_as_long_as_its_request_can_be_taken_over(redis_server):
    """A request with ten minutes of budget left may be taken over by another executor at any time in
    them: the record it continues from must not expire after the gateways' reply TTL."""
    from batchline.clock import now_us

    async def scenario() -> None:
        client = connect(redis_server.url, 2)
        writes = StreamWrites(ExecutorStore(client, connect_blocking(redis_server.url, 2)), MODEL)
        long, short = uuid.uuid4().hex, uuid.uuid4().hex
        sent = np.arange(3, dtype=np.int64).tobytes()
        await writes.write("gw", [b"r"], long, sent, False, deadline_us=now_us() + 600_000_000)
        await writes.write("gw", [b"r"], short, sent, False, deadline_us=now_us() + 1_000_000)
        assert await client.ttl(k.generated(MODEL, long)) >= 600
        assert 0 < await client.ttl(k.generated(MODEL, short)) <= k.REPLY_TTL
        await client.aclose()

    asyncio.run(scenario())


def _stream(tokens_before: list[int]) -> Stream:
    model = GenerationModel(pb.ModelInfo(name="gpt", version="1"), None, None)  # type: ignore[arg-type]
    return Stream(None, model, ipb.ModelInferRequest(id="r"), pb.QueueEntry(request_id="r"),  # type: ignore[arg-type]
                  list(tokens_before))


def _tokens(reply: pb.Reply) -> list[int]:
    return np.frombuffer(reply.response.raw_output_contents[1], np.int64).tolist()


def test_held_tokens_go_as_responses_of_several_numbered_by_their_last():
    stream = _stream([])
    for i in range(12):
        stream.add(f"<{i}>", [100 + i])
    replies = stream.take(FLUSH_TOKENS)
    assert [_tokens(r) for r in replies] == [list(range(100, 100 + FLUSH_TOKENS))]
    assert replies[0].index == FLUSH_TOKENS - 1 and replies[0].partial
    assert stream.pushed == FLUSH_TOKENS and len(stream.held) == 12 - FLUSH_TOKENS
    rest = stream.take()
    assert [_tokens(r) for r in rest] == [list(range(100 + FLUSH_TOKENS, 112))] and rest[0].index == 11


def test_each_stream_flushes_on_its_own_clock_or_with_a_write_asked_in_its_turn():
    first, second = _stream([]), _stream([])
    first.writes = second.writes = StreamWrites(None, MODEL)  # type: ignore[arg-type]  # two streams of one model
    for stream in (first, second):
        stream.add("a", [1])
        stream.take()  # the first token went at once
        stream.add("b", [2])
    assert not first.due() and not second.due()  # a token held, within its 50 ms
    # The model's other stream writing every step does not hold this one's tokens back: its own
    # clock says when 50 ms have passed since its own last write.
    first.flushed_at -= FLUSH_S + 0.01
    assert first.due() and not second.due()
    first.writes._asked.append(object())  # a write asked for in this turn: joining it is free
    assert second.due()


def test_a_continued_stream_sends_its_first_tokens_one_a_response():
    # The executor before may have pushed up to a write's tokens past its record: the gateway drops
    # what it forwarded already by index, a whole response at a time, so those go one a response.
    stream = _stream([1, 2, 3])
    for i in range(FLUSH_TOKENS + 4):
        stream.add(str(i), [10 + i])
    replies = stream.take()
    assert [len(_tokens(r)) for r in replies] == [1] * FLUSH_TOKENS + [4]
    assert [r.index for r in replies] == [3 + i for i in range(FLUSH_TOKENS)] + [3 + FLUSH_TOKENS + 3]
    texts = [r.response.raw_output_contents[0][4:].decode() for r in replies]
    last = "".join(str(i) for i in range(FLUSH_TOKENS, FLUSH_TOKENS + 4))
    assert texts == [str(i) for i in range(FLUSH_TOKENS)] + [last], "each response carries its own tokens' text"


def test_a_write_through_a_redis_blip_is_tried_again_and_the_streams_go_on(redis_server):
    import redis

    async def scenario() -> None:
        client = connect(redis_server.url, 2)
        store = ExecutorStore(client, connect_blocking(redis_server.url, 2))
        real, failures = store.stream_tokens, []

        async def once_dropped(*args):
            if not failures:  # the connection drops once, as in a failover
                failures.append(1)
                raise redis.ConnectionError("Connection closed by server.")
            return await real(*args)

        store.stream_tokens = once_dropped  # type: ignore[method-assign]
        writes = StreamWrites(store, MODEL)
        request_id, gateway_id = uuid.uuid4().hex, f"gw-{uuid.uuid4().hex[:8]}"
        await client.set(k.payload(MODEL, request_id), b"x", ex=60)
        sent = np.arange(3, dtype=np.int64).tobytes()
        assert await writes.write(gateway_id, [b"r1"], request_id, sent, False) is True
        assert failures and writes.round_trips == 2
        assert await client.lrange(k.reply(gateway_id), 0, -1) == [b"r1"]
        await client.aclose()

    asyncio.run(scenario())
