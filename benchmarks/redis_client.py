"""What a Redis round trip costs the client's CPU through redis-py's asyncio client, against a bare
connection of it, the contract's own connection (batchline.contract.link, which the services' hot
calls take) and a bare asyncio protocol, on the installed redis-py.

    python benchmarks/redis_client.py [--commands 20000] [--rounds 3]

Every service's hot path is Redis round trips (the gateway's group commit, the scheduler's scan and
writes, the executor's work list, payloads and answers), so redis-py's own Python per command and
per pipeline is paid per batch by each of them. Run it in a virtualenv with another redis-py
(`pip install redis==X`) to compare versions (8.0 and later only can serve: benchmarks/README.md).
One SET of 200 bytes a round trip (ten in a pipeline of ten), on one connection, uvloop, an
embedded Redis on a Unix socket as `batchline up` runs it; client CPU µs (process time) per round
trip, the median of the rounds, rounds in turn.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import redis
import redis.asyncio as aredis

from batchline import eventloop
from batchline.contract.link import Link
from batchline.embedded_redis import EmbeddedRedis

VALUE = b"x" * 200


class _Reply(asyncio.Protocol):
    def __init__(self) -> None:
        self.waiting: asyncio.Future | None = None

    def data_received(self, data: bytes) -> None:
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_result(data)


async def measure(socket: str, commands: int, rounds: int) -> dict[str, list[float]]:
    client = aredis.Redis(unix_socket_path=socket)
    await client.ping()
    conn = client.connection_pool.make_connection()
    await conn.connect()
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_unix_connection(_Reply, socket)
    packed = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$200\r\n" + VALUE + b"\r\n"

    async def pooled():
        await client.set("k", VALUE)

    async def pipeline_of(n: int):
        pipe = client.pipeline(transaction=False)
        for _ in range(n):
            pipe.set("k", VALUE)
        await pipe.execute()

    async def bare():
        await conn.send_command("SET", "k", VALUE)
        await conn.read_response()

    link = Link.of(client)
    assert link is not None

    async def linked():
        await link.execute_command("SET", "k", VALUE)

    async def link_pipeline():
        pipe = link.pipeline()
        for _ in range(10):
            pipe.set("k", VALUE)
        await pipe.execute()

    async def raw():
        proto.waiting = loop.create_future()
        transport.write(packed)
        await proto.waiting

    ways = {"redis-py, a command": (pooled, 1), "redis-py, a pipeline of 1": (lambda: pipeline_of(1), 1),
            "redis-py, a pipeline of 10": (lambda: pipeline_of(10), 10),
            "redis-py's connection alone, a command": (bare, 1), "the contract's Link, a command": (linked, 1),
            "the contract's Link, a pipeline of 10": (link_pipeline, 10),
            "a bare asyncio protocol, a command": (raw, 1)}
    out: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, (call, per) in ways.items():
            n = max(1, commands // per)
            started = time.process_time()
            for _ in range(n):
                await call()
            out[name].append((time.process_time() - started) / n * 1e6)
    transport.close()
    await link.aclose()
    await conn.disconnect()
    await client.aclose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commands", type=int, default=20000, help="round trips per way and round (default: 20000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each way in turn (default: 3)")
    a = p.parse_args()
    with EmbeddedRedis() as server:
        results = eventloop.run(measure(server.socket, a.commands, a.rounds))
    print(f"redis-py {redis.__version__}: client CPU µs per round trip, median of {a.rounds} rounds (rounds)")
    for name, values in results.items():
        print(f"  {name:42} {statistics.median(values):7.1f}  ({', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
