"""A request queued by reference to the client's shared-memory region, its executor killed while
holding its batch: the batch reruns on the other executor, which reads the same region, and every
answer lands in its own place in the client's region. Real processes on one host (so the
regions go by reference: docs/design/shared-memory.md)."""
from __future__ import annotations

import concurrent.futures
import signal
import threading
import uuid

import numpy as np
import pytest

from batchline.testing import triton_models
from batchline.testing.polling import poll
from batchline.testing.processes import ProcessMesh

# tritonclient 2.41's shared-memory utilities import pkg_resources, which warns that it is deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:pkg_resources is deprecated")

SLOTS = 32
ELEMENTS = 4096  # 16 KB in and out per request


def test_a_batch_by_reference_reruns_elsewhere_when_its_executor_dies(tmp_path):
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    repo = triton_models.build_repository(tmp_path / "repository", names=["passthrough"])
    data = np.random.default_rng(2).random((SLOTS, 1, ELEMENTS), dtype=np.float32)
    size = data[0].nbytes
    with ProcessMesh(repo, tmp_path / "logs", models=["passthrough"]) as mesh:
        mesh.start(executors=2)
        address = mesh.probe.wait_ready()
        key = f"/bl_test_{uuid.uuid4().hex[:8]}"
        handle = shm.create_shared_memory_region("io", key, 2 * SLOTS * size)
        shm.set_shared_memory_region(handle, [data])
        client = grpcclient.InferenceServerClient(address)
        client.register_system_shared_memory("io", key, 2 * SLOTS * size)
        try:
            def infer(slot: int) -> None:
                inputs = [grpcclient.InferInput("INPUT0", [1, ELEMENTS], "FP32")]
                inputs[0].set_shared_memory("io", size, offset=slot * size)
                outputs = [grpcclient.InferRequestedOutput("OUTPUT0")]
                outputs[0].set_shared_memory("io", size, offset=(SLOTS + slot) * size)
                grpcclient.InferenceServerClient(address).infer("passthrough", inputs, outputs=outputs,
                                                                 client_timeout=60)

            # Frozen, exec-0 keeps the batches it is given until its heartbeat expires; requests
            # go on being sent until it holds one, and it is killed holding it.
            mesh.kill("exec-0", signal.SIGSTOP)
            held = threading.Event()
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                def send_all() -> list:
                    futures = []
                    for slot in range(SLOTS):
                        futures.append(pool.submit(infer, slot))
                        if not held.is_set():
                            held.wait(0.05)
                    return futures

                sender = concurrent.futures.ThreadPoolExecutor(1)
                sent = sender.submit(send_all)
                poll(lambda: mesh.probe.held_batches("exec-0") > 0, 20, "exec-0 to hold a batch while frozen")
                held.set()
                mesh.kill("exec-0", signal.SIGKILL)
                for future in sent.result(timeout=60):
                    future.result(timeout=60)
                sender.shutdown()
            answers = shm.get_contents_as_numpy(handle, np.float32, (SLOTS, 1, ELEMENTS), offset=SLOTS * size)
            assert np.array_equal(answers, data)
            assert mesh.probe.scheduler_status("sched-0").redispatched_requests > 0  # exec-0's batch, rerun
        finally:
            client.unregister_system_shared_memory()
            shm.destroy_shared_memory_region(handle)
