"""The gateway's CPU per request with 1 MB inputs (and outputs) through system shared memory
against the same tensors in the gRPC messages, in alternating rounds on one mesh; the executor's too.

One scheduler and executor and two gateways as subprocesses on this host, serving `passthrough`
(FP32 [1, N] in, the same out; batchline/testing/triton_models.py); one request in flight from
this process. The executor shares the gateways' /dev/shm, so the first gateway hands it the
regions by reference (docs/design/shared-memory.md); the second runs with
--no-shared-memory-by-reference and copies the tensors through Redis, as it does for executors on
other hosts. Each gateway is also sent the tensors in the message, which its own regions' mode is
compared with. A process's CPU is its user + system time over a round, divided by the requests.
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
            executor = mesh.add_executor()
            mesh.add_scheduler()
            mesh.add_gateway()
            mesh.add_gateway("copying", flags=["--no-shared-memory-by-reference"])
            mesh.probe.wait_for_executors(1)
            clients = {g: grpcclient.InferenceServerClient(mesh.probe.wait_ready(g)) for g in ("gateway", "copying")}
            pids = mesh.pids()
            procs = {name: psutil.Process(pids[name]) for name in ("gateway", "copying")}
            procs["executor"] = psutil.Process(pids[executor])
            key = f"/bl_bench_{uuid.uuid4().hex[:8]}"
            handle = shm.create_shared_memory_region("bench", key, 2 * size)
            shm.set_shared_memory_region(handle, [data])
            for client in clients.values():
                client.register_system_shared_memory("bench", key, 2 * size)
            try:
                in_message = [grpcclient.InferInput("INPUT0", list(data.shape), "FP32")]
                in_message[0].set_data_from_numpy(data)
                in_region = [grpcclient.InferInput("INPUT0", list(data.shape), "FP32")]
                in_region[0].set_shared_memory("bench", size)
                out_region = [grpcclient.InferRequestedOutput("OUTPUT0")]
                out_region[0].set_shared_memory("bench", size, offset=size)
                # Each mode: how it sends, and the gateway that serves it.
                # Each compared with the message on its own gateway: a process's CPU in one round
                # includes its background work (heartbeats, refreshes), alike on both.
                modes = {
                    "message": (lambda: clients["gateway"].infer("passthrough", in_message), "gateway"),
                    "by reference": (lambda: clients["gateway"].infer("passthrough", in_region, outputs=out_region),
                                     "gateway"),
                    "message (2nd)": (lambda: clients["copying"].infer("passthrough", in_message), "copying"),
                    "copied": (lambda: clients["copying"].infer("passthrough", in_region, outputs=out_region),
                               "copying"),
                }
                for mode, (send, _) in modes.items():  # warm up, and check each answers the input
                    for _ in range(10):
                        send()
                    if not mode.startswith("message"):
                        got = shm.get_contents_as_numpy(handle, np.float32, data.shape, offset=size)
                        assert np.array_equal(got, data), f"{mode}: the region holds another answer"
                        shm.set_shared_memory_region(handle, [np.zeros_like(data)], offset=size)
                assert np.array_equal(modes["message"][0]().as_numpy("OUTPUT0"), data)
                cpu: dict[tuple[str, str], list[float]] = {(p, m): [] for p in ("gateway", "executor") for m in modes}
                for r in range(args.rounds):
                    for mode, (send, gateway) in modes.items():
                        watched = {"gateway": procs[gateway], "executor": procs["executor"]}
                        before, started = {p: _cpu_s(proc) for p, proc in watched.items()}, time.perf_counter()
                        for _ in range(args.requests):
                            send()
                        per_request = {p: (_cpu_s(proc) - before[p]) / args.requests for p, proc in watched.items()}
                        for p, value in per_request.items():
                            cpu[(p, mode)].append(value)
                        print(f"round {r + 1} {mode:>13}: gateway CPU {per_request['gateway'] * 1e3:.2f} ms/request, "
                              f"executor {per_request['executor'] * 1e3:.2f}, "
                              f"{args.requests / (time.perf_counter() - started):.0f} req/s")
            finally:
                for client in clients.values():
                    client.unregister_system_shared_memory()
                shm.destroy_shared_memory_region(handle)
    print(f"{args.megabytes:g} MB in and out, median of {args.rounds} rounds, CPU ms per request:")
    for p in ("gateway", "executor"):
        median = {m: statistics.median(cpu[(p, m)]) for m in modes}
        print(f"  {p:>8}: " + ", ".join(f"{m} {v * 1e3:.2f}" for m, v in median.items())
              + f"; by reference / message {median['by reference'] / median['message']:.2f}"
              + (" (target <= 0.5)" if p == "gateway" else "")
              + f", copied / message (2nd gateway) {median['copied'] / median['message (2nd)']:.2f}")


if __name__ == "__main__":
    main()
