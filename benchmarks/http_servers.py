"""Which HTTP server the gateway's REST port runs on: requests/s of the candidates on one trivial
binary-infer-shaped exchange (a JSON header plus 128 bytes in, a JSON header plus 8 bytes out), 32
keep-alive connections in flight, each server alone in its own process on uvloop.

    .venv/bin/python benchmarks/http_servers.py [--seconds 3]

The numbers measure the server's own cost per request (parsing, the app interface, writing),
the part the REST port adds beside gRPC; docs/design/rest.md records a run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import time

HEADER = json.dumps({"inputs": [{"name": "x", "shape": [1, 32], "datatype": "FP32",
                                 "parameters": {"binary_data_size": 128}}]}).encode()
BODY = HEADER + bytes(128)
ANSWER_HEADER = json.dumps({"outputs": [{"name": "y", "shape": [1, 2], "datatype": "FP32",
                                         "parameters": {"binary_data_size": 8}}]}).encode()
ANSWER = ANSWER_HEADER + bytes(8)


def _answer(body: bytes, header_length: int) -> bytes:
    json.loads(body[:header_length])
    return ANSWER


def _asgi_app():
    async def app(scope, receive, send):
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        length = int(dict(scope["headers"]).get(b"inference-header-content-length", b"0"))
        answer = _answer(b"".join(chunks), length)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/octet-stream"), (b"content-length", str(len(answer)).encode()),
            (b"inference-header-content-length", str(len(ANSWER_HEADER)).encode())]})
        await send({"type": "http.response.body", "body": answer})
    return app


def serve(kind: str, sock: socket.socket) -> None:
    import uvloop

    if kind.startswith("uvicorn"):
        import uvicorn

        config = uvicorn.Config(_asgi_app(), http=kind.split("-")[1], loop="none", lifespan="off",
                                log_config=None, access_log=False)
        uvloop.run(uvicorn.Server(config).serve(sockets=[sock]))
    elif kind == "aiohttp":
        from aiohttp import web

        async def infer(request):
            body = await request.read()
            answer = _answer(body, int(request.headers.get("Inference-Header-Content-Length", "0")))
            return web.Response(body=answer, content_type="application/octet-stream",
                                headers={"Inference-Header-Content-Length": str(len(ANSWER_HEADER))})

        async def main():
            app = web.Application()
            app.router.add_post("/v2/models/{model}/infer", infer)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.SockSite(runner, sock).start()
            await asyncio.Event().wait()

        uvloop.run(main())


async def _drive(port: int, in_flight: int, seconds: float) -> float:
    request = (b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
               b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (len(HEADER), len(BODY))) + BODY
    done = 0
    stop = time.perf_counter() + seconds

    async def connection():
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < stop:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            done += 1
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(in_flight)))
    return done / (time.perf_counter() - started)


def measure(kind: str, seconds: float, in_flight: int = 32) -> float:
    import uvloop

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    process = multiprocessing.get_context("spawn").Process(target=serve, args=(kind, sock), daemon=True)
    process.start()
    try:
        time.sleep(1.5)
        return uvloop.run(_drive(sock.getsockname()[1], in_flight, seconds))
    finally:
        process.terminate()
        process.join(5)
        sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per server, alternating")
    args = parser.parse_args()
    import _common

    print(f"machine: {_common.machine()}")
    kinds = ["uvicorn-httptools", "uvicorn-h11", "aiohttp"]
    results: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            results[kind].append(measure(kind, args.seconds))
    for kind in kinds:
        best = sorted(results[kind])[len(results[kind]) // 2]
        print(f"{kind:18s} {best:8.0f} req/s (rounds: {', '.join(f'{r:.0f}' for r in results[kind])})")


if __name__ == "__main__":
    main()
