"""The gateway's CPU per request with 1 MB inputs (and outputs) through system shared memory
against the same tensors in the gRPC messages, in alternating rounds on one mesh.

One gateway, scheduler and executor as subprocesses serving `passthrough` (FP32 [1, N] in, the
same out; batchline/testing/triton_models.py); one request in flight from this process. The
gateway's CPU is its process's user + system time over a round, divided by the requests.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np
import psutil

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import _common
from batchline.testing import triton_models
from batchline.testing.processes import ProcessMesh


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100, help="requests per round and mode (default: 100)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    p.add_argument("--megabytes", type=float, default=1.0, help="size of the input, and of the output (default: 1)")
    args = p.parse_args()

    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    print(f"machine: {_common.machine()}")
    elements = int(args.megabytes * 1024 * 1024) // 4
    data = np.random.default_rng(0).random((1, elements), dtype=np.float32)
    size = data.nbytes
    with tempfile.TemporaryDirectory() as tmp:
        repo = triton_models.build_repository(pathlib.Path(tmp) / "repository")
        with ProcessMesh(repo, pathlib.Path(tmp) / "logs", models=["passthrough"], log_level="WARNING") as mesh:
            mesh.start_redis()
            mesh.add_executor()
            mesh.add_scheduler()
            mesh.add_gateway(flags=["--http-port", "-1"])  # REST is not measured here
            mesh.wait_for_executors(1)
            address = mesh.wait_ready()
            gateway = psutil.Process(mesh.pids()["gateway"])
            client = grpcclient.InferenceServerClient(address)
            key = f"/bl_bench_{uuid.uuid4().hex[:8]}"
            handle = shm.create_shared_memory_region("bench", key, 2 * size)
            shm.set_shared_memory_region(handle, [data])
            client.register_system_shared_memory("bench", key, 2 * size)
            try:
                in_message = [grpcclient.InferInput("INPUT0", list(data.shape), "FP32")]
                in_message[0].set_data_from_numpy(data)
                in_region = [grpcclient.InferInput("INPUT0", list(data.shape), "FP32")]
                in_region[0].set_shared_memory("bench", size)
                out_region = [grpcclient.InferRequestedOutput("OUTPUT0")]
                out_region[0].set_shared_memory("bench", size, offset=size)
                modes = {
                    "message": lambda: client.infer("passthrough", in_message),
                    "shared memory": lambda: client.infer("passthrough", in_region, outputs=out_region),
                }
                for send in modes.values():  # warm up, and check both answer the input
                    for _ in range(10):
                        send()
                assert np.array_equal(client.infer("passthrough", in_message).as_numpy("OUTPUT0"), data)
                assert np.array_equal(shm.get_contents_as_numpy(handle, np.float32, data.shape, offset=size), data)
                cpu: dict[str, list[float]] = {m: [] for m in modes}
                for r in range(args.rounds):
                    for mode, send in modes.items():
                        before, started = _cpu_s(gateway), time.perf_counter()
                        for _ in range(args.requests):
                            send()
                        per_request = (_cpu_s(gateway) - before) / args.requests
                        cpu[mode].append(per_request)
                        print(f"round {r + 1} {mode:>13}: gateway CPU {per_request * 1e3:.2f} ms/request, "
                              f"{args.requests / (time.perf_counter() - started):.0f} req/s")
            finally:
                client.unregister_system_shared_memory()
                shm.destroy_shared_memory_region(handle)
    message, region = statistics.median(cpu["message"]), statistics.median(cpu["shared memory"])
    print(f"{args.megabytes:g} MB in and out, median of {args.rounds} rounds: gateway CPU per request "
          f"{message * 1e3:.2f} ms in the message, {region * 1e3:.2f} ms through shared memory: "
          f"ratio {region / message:.2f} (target <= 0.5)")


if __name__ == "__main__":
    main()
