"""What one request costs gRPC in Python on each side, against what the gateway spends on a refusal.

    python benchmarks/grpc_floor.py [--rate 300] [--duration 10]

On a host whose cores the model shares with the gateway and the load generator, every request's
gRPC handling on both sides comes out of the model's CPU. This measures that cost at its floor and
in the mesh, in CPU ms per request, with the load generator's own code and event loop (`batchline.bench`'s unary
calls and open-loop stream mux) sending Poisson arrivals at --rate:

1. The floor: a bare grpc.aio server (uvloop, like the gateway) in a subprocess that refuses every
   ModelInfer call with RESOURCE_EXHAUSTED and answers every ModelStreamInfer message with an error
   message, doing nothing else. Its CPU and the client's, per request, unary and over streams.
2. The gateway: the same load against a local mesh (minilm, 32 tokens) with a 1 ms `timeout`
   parameter (and no gRPC deadline), so admission control refuses every request at the door with
   DEADLINE_EXCEEDED: the gateway's CPU per refusal, and the client's.

The per-request cost c of a refusal bounds goodput under overload: with capacity C requests/s
costing k = cores / C each, twice C offered leaves goodput / capacity at most (k - 2c) / (k - c).
It bounds the ceiling ratios too: a model needing m CPU ms per request alone serves at most
m / (m + c') of its ceiling when each request also costs c' on the same cores.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import numpy as np

import _common
from batchline import eventloop
from batchline.bench.loadgen import Endpoint, arrival_times
from batchline.mesh import Mesh
from batchline.protocol import inference_pb2 as ipb

SERVICE = "inference.GRPCInferenceService"


def serve() -> None:
    """The bare server (run as a subprocess): prints its port, then serves until killed."""
    import grpc
    import uvloop

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full: retry later")

    async def refuse_each(request_iterator, context):
        async for request in request_iterator:
            yield ipb.ModelStreamInferResponse(error_message="[RESOURCE_EXHAUSTED] the queue is full: retry later",
                                               infer_response=ipb.ModelInferResponse(id=request.id))

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "ModelInfer": grpc.unary_unary_rpc_method_handler(
                refuse, request_deserializer=ipb.ModelInferRequest.FromString),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                refuse_each, request_deserializer=ipb.ModelInferRequest.FromString,
                response_serializer=ipb.ModelStreamInferResponse.SerializeToString),
        }),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def payload(timeout_us: int) -> bytes:
    request = ipb.ModelInferRequest(model_name="minilm")
    for name in ("input_ids", "attention_mask"):
        request.inputs.add(name=name, datatype="INT64", shape=[1, 32])
        request.raw_input_contents.append(np.ones((1, 32), np.int64).tobytes())
    request.parameters["timeout"].int64_param = timeout_us
    return request.SerializeToString()


async def drive(address: str, server_pid: int, rate: float, duration: float,
                streaming: bool) -> tuple[float, float, dict]:
    """Poisson arrivals for `duration` s; (server CPU ms, client CPU ms) per request, and the statuses."""
    blob = payload(1000)
    codes: dict[str, int] = {}
    async with Endpoint(address, "minilm") as ep:
        mux = ep.stream_mux() if streaming else None
        infer = mux.infer if mux else ep.infer

        async def one() -> None:
            code, _ = await infer(blob, None)
            codes[code] = codes.get(code, 0) + 1

        await asyncio.gather(*(one() for _ in range(20)))  # connect and warm up
        codes.clear()
        schedule = arrival_times(rate, duration, None, np.random.default_rng(0))
        server0, client0, start = cpu_s(server_pid), time.process_time(), time.perf_counter()
        tasks = []
        for t in schedule:
            if (wait := t - (time.perf_counter() - start)) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
        server, client = cpu_s(server_pid) - server0, time.process_time() - client0
        if mux:
            mux.close()
    n = len(schedule)
    return server / n * 1e3, client / n * 1e3, codes


def bare_floor(runner: asyncio.Runner, rate: float, duration: float, report=None) -> dict[str, float]:
    """gRPC's floor here: CPU ms per call, server and client together, of a bare grpc.aio server that
    refuses everything, driven by the bench's client at `rate` Poisson arrivals for `duration` s each
    way: {"unary": ms, "stream": ms}. `report(name, calls, server_ms, client_ms, codes)`, if given,
    sees each measurement."""
    floor = {}
    bare = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(bare.stdout.readline())
        for streaming in (False, True):
            server, client, codes = runner.run(drive(f"127.0.0.1:{port}", bare.pid, rate, duration, streaming))
            floor["stream" if streaming else "unary"] = server + client
            if report:
                report("bare grpc.aio", "stream" if streaming else "unary", server, client, codes)
    finally:
        bare.kill()
        bare.wait()
    return floor


def floor_here(rate: float = 300.0, duration: float = 5.0) -> dict[str, float]:
    """`bare_floor` on an event loop of its own, the bench's: what ceiling.py and overload.py measure
    before their meshes."""
    with asyncio.Runner(loop_factory=eventloop.loop_factory()) as runner:
        return bare_floor(runner, rate, duration)


def ceiling_cap(model_ms: float, floor_ms: float) -> float:
    """The most of the model's ceiling a request can reach when, besides the model's `model_ms` of CPU,
    it costs `floor_ms` on the same cores."""
    return model_ms / (model_ms + floor_ms)


def overload_cap(request_ms: float, refusal_ms: float, factor: float) -> float:
    """The most of the capacity that `factor` x capacity offered can leave as goodput, when the
    capacity fills the cores at `request_ms` of CPU a request and each refusal costs `refusal_ms`."""
    return (request_ms - factor * refusal_ms) / (request_ms - refusal_ms)


def main() -> int:
    if sys.argv[1:] == ["--serve"]:
        serve()
        return 0
    p = _common.arg_parser(__doc__.splitlines()[0], progress=False)
    p.add_argument("--rate", type=float, default=300.0, help="Poisson arrivals per second (default: 300)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement (default: 10)")
    args = p.parse_args()
    repo = _common.ensure_repository(args.model_repository)
    print(f"machine: {_common.machine()}; {args.rate:g} requests/s, {args.duration:g} s each")
    rows = [["server", "calls", "server CPU ms/request", "client CPU ms/request", "both", "statuses"]]

    # One event loop for every measurement, the bench's own (uvloop when installed): grpc.aio binds
    # its completion queue to the first loop it runs on, and a later asyncio.run() would leave its
    # poller calling into a closed one.
    runner = asyncio.Runner(loop_factory=eventloop.loop_factory())

    def report(name: str, calls: str, server: float, client: float, codes: dict) -> None:
        rows.append([name, calls, f"{server:.3f}", f"{client:.3f}", f"{server + client:.3f}",
                     " ".join(f"{k}={v}" for k, v in sorted(codes.items()))])
        print(f"  {name}, {calls}: server {server:.3f} ms, client {client:.3f} ms per request", flush=True)

    def measure(name: str, address: str, pid: int) -> None:
        for streaming in (False, True):
            server, client, codes = runner.run(drive(address, pid, args.rate, args.duration, streaming))
            report(name, "stream" if streaming else "unary", server, client, codes)

    bare_floor(runner, args.rate, args.duration, report)
    m = Mesh(_common.mesh_args(repo, args.log_level))
    try:
        address = m.start()
        [gateway] = [s.proc for s in m.supervisor.services if s.role == "gateway"]
        measure("gateway (admission refuses)", address, gateway.pid)
    finally:
        m.stop()
        runner.close()
    print()
    print(_common.table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
