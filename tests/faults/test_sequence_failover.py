"""Sequences outlive their executor: 64 sequences of 20 steps each, interleaved, on two executor
processes; one is SIGKILLed in the middle, and every sequence's answers are still those of an
uninterrupted run (its state was in Redis; the steps it held ran on the other executor)."""
from __future__ import annotations

import pathlib
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient

from batchline.testing.processes import ProcessMesh, poll
from batchline.testing.stateful_models import save_accumulator

SEQUENCES, STEPS = 64, 20
STEP_TIMEOUT_S = 30.0


def step_value(seq: int, step: int) -> int:
    return (seq * 7 + step * 3) % 11 - 5


def uninterrupted(repo) -> dict[int, list[int]]:
    """Every sequence's answers from a local ONNX Runtime run, step after step, from zero state."""
    session = ort.InferenceSession(str(repo / "accumulator" / "1" / "model.onnx"))
    answers = {}
    for seq in range(SEQUENCES):
        acc, outs = np.zeros((1, 1), np.int32), []
        for step in range(STEPS):
            feeds = {"INPUT": np.array([[step_value(seq, step)]], np.int32), "ACC_IN": acc,
                     "END": np.zeros((1, 1), np.int32), "CORRID": np.zeros((1, 1), np.int64),
                     "READY": np.ones((1, 1), np.int32)}
            out, acc = session.run(["OUTPUT", "ACC_OUT"], feeds)
            outs.append(int(out[0, 0]))
        answers[seq] = outs
    return answers


@pytest.fixture
def mesh(tmp_path):
    repo = tmp_path / "repo"
    save_accumulator(repo)
    m = ProcessMesh(repo, tmp_path / "logs", models=("accumulator",))
    try:
        yield m.start(executors=2)
    except BaseException:
        print(m.logs(80))
        raise
    finally:
        m.stop()


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_an_executor_lost_mid_sequence_loses_nothing(mesh, fault):
    """kill: SIGSTOPped, then SIGKILLed once it holds steps. freeze: SIGSTOPped until declared dead,
    its steps run elsewhere, then woken: its late runs of steps its sequences have moved past must
    change nothing."""
    expected = uninterrupted(pathlib.Path(mesh.repo))
    address = mesh.probe.gateway_address()
    done_steps = 0
    lock = threading.Lock()
    # Every sequence's last step waits for exec-0 to be frozen: the steps sent after that are sure
    # to leave it some to hold, where the rest of the run could otherwise end between two looks.
    frozen = threading.Event()

    def run(seq: int) -> list[int]:
        outs = []
        with grpcclient.InferenceServerClient(address) as client:
            for step in range(STEPS):
                if step == STEPS - 1:
                    frozen.wait(STEP_TIMEOUT_S)
                tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                tensor.set_data_from_numpy(np.array([[step_value(seq, step)]], np.int32))
                result = client.infer("accumulator", [tensor], sequence_id=seq + 1, sequence_start=step == 0,
                                      sequence_end=step == STEPS - 1, client_timeout=STEP_TIMEOUT_S)
                outs.append(int(result.as_numpy("OUTPUT")[0, 0]))
                nonlocal done_steps
                with lock:
                    done_steps += 1
        return outs

    with ThreadPoolExecutor(SEQUENCES) as pool:
        futures = [pool.submit(run, seq) for seq in range(SEQUENCES)]
        poll(lambda: done_steps >= SEQUENCES * STEPS // 2, 120, "half the steps")
        # Lost while it holds steps, so that some must run again elsewhere: frozen first, it holds
        # what it is sent until it is declared dead.
        mesh.kill("exec-0", signal.SIGSTOP)
        frozen.set()
        poll(lambda: mesh.probe.held_batches("exec-0") > 0, 10, "exec-0 to hold a batch")
        killed_at, held = done_steps, mesh.probe.held_batches("exec-0")
        if fault == "kill":
            mesh.kill("exec-0", signal.SIGKILL)
            mesh.wait_exit("exec-0", 10)
        else:
            mesh.probe.wait_executor_gone("exec-0")
            poll(lambda: mesh.probe.scheduler_status("sched-0").redispatched_requests > 0, 30,
                 "the frozen executor's steps to be handed to exec-1")
            poll(lambda: done_steps >= killed_at + SEQUENCES, 60, "steps to go on without exec-0")
            mesh.kill("exec-0", signal.SIGCONT)
        started = time.monotonic()
        answers = {seq: f.result(timeout=180) for seq, f in enumerate(futures)}
    assert killed_at < SEQUENCES * STEPS, "the kill came after every step was answered"
    assert answers == expected
    redispatched = mesh.probe.scheduler_status("sched-0").redispatched_requests
    assert redispatched > 0, "no step the killed executor held ran again elsewhere"
    print(f"{fault}: exec-0 holding {held} batch(es) after {killed_at} of {SEQUENCES * STEPS} steps; "
          f"{redispatched} steps ran again on exec-1; the rest took {time.monotonic() - started:.1f} s")
