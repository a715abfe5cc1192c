"""A gateway SIGKILLed in the middle of generation streams: the executor notices that its heartbeat
is gone at the sequences' next write and ends them, freeing their cache slots, instead of
generating for nobody until their payloads expire (docs/design/generation.md#through-the-mesh)."""
from __future__ import annotations

import threading

import numpy as np
import tritonclient.grpc as grpcclient

from batchline import contract
from batchline.protocol import internal_pb2 as pb
from batchline.testing.decoder import build_gpt
from batchline.testing.polling import poll
from batchline.testing.processes import ProcessMesh

# Sixteen turns of four slots, each of 90 to 240 steps: streams still running or waiting when the
# dead gateway's heartbeat (0.2 s a beat, gone after 0.6 s) lapses, even on an engine at a fraction
# of a millisecond a step (the demo's, with its cache in place, on a quiet host). The lengths differ
# so that the four running ones end at different times: a sequence within its last write when the
# lapse is seen ends at that write, silently, and with one slot (or four in step) the streams after
# it are then dropped unread, leaving none to end mid-way and say so.
STREAMS = 64
SLOTS = 4
MAX_TOKENS = (240, 190, 140, 90)


def sequences(mesh: ProcessMesh) -> tuple[int, int]:
    """The executor's running and waiting sequences of gpt, as its last registration says."""
    blob = mesh.probe.redis.get(contract.executor("exec-0"))
    info = pb.ExecutorInfo.FromString(blob) if blob else pb.ExecutorInfo()
    gpt = [m for m in info.models if m.name == "gpt"]
    return (gpt[0].generation_running, gpt[0].generation_waiting) if gpt else (-1, -1)


def test_a_dead_gateways_sequences_end_at_their_next_write(tmp_path):
    repo = tmp_path / "repo"
    build_gpt(repo)
    # Four cache slots (1 MiB each for gpt): the streams take turns, so that some are still to run
    # when the gateway dies; they must not run either.
    with ProcessMesh(repo, tmp_path / "logs", models=("gpt",)) as mesh:
        mesh.start_redis()
        mesh.add_executor(flags=["--generation-cache-mb", str(SLOTS)])
        mesh.add_scheduler()
        mesh.add_gateway(flags=["--heartbeat-interval-s", "0.2"])
        mesh.probe.wait_for_executors(1)
        mesh.probe.wait_ready()
        tokens = threading.Semaphore(0)
        client = grpcclient.InferenceServerClient(mesh.probe.gateway_address())
        client.start_stream(callback=lambda result, error: tokens.release() if error is None else None)
        for i in range(STREAMS):
            tensor = grpcclient.InferInput("text_input", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([b"The"], dtype=object))
            parameters = {"max_tokens": MAX_TOKENS[i % len(MAX_TOKENS)], "ignore_eos": True, "temperature": 0,
                          "timeout": 120_000_000}
            client.async_stream_infer("gpt", [tensor], request_id=str(i), parameters=parameters)
        assert tokens.acquire(timeout=60), "no token came"
        poll(lambda: sequences(mesh)[0] > 0, 30, "the executor to register running sequences", check=mesh.check_alive)

        mesh.kill("gateway")
        poll(lambda: sequences(mesh) == (0, 0), 30, "the dead gateway's sequences to end")
        client.close()
        # Nobody cancelled: the client's calls died with the gateway, and their payloads live 120 s.
        # (The line may reach the log file after the registration that shows the sequence gone.)
        poll(lambda: "or its gateway gateway is gone): its sequence ends after" in
             (tmp_path / "logs" / "exec-0.log").read_text(), 10, "the log to say a sequence was ended")
