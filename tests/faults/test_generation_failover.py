"""An executor SIGKILLed in the middle of 32 generation streams: its sequences continue on the other
executor from prompt plus the tokens already sent, and every stream's tokens are those of an
uninterrupted greedy run, without a duplicate or a gap (docs/design/generation.md#nothing-lost)."""
from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from batchline.testing.decoder import Reference, build_gpt, mixed_prompts
from batchline.testing.polling import poll
from batchline.testing.processes import ProcessMesh

STREAMS = 32
MAX_TOKENS = 120
FINAL = "triton_final_response"


@pytest.fixture
def mesh(tmp_path):
    repo = tmp_path / "repo"
    build_gpt(repo)
    with ProcessMesh(repo, tmp_path / "logs", models=("gpt",)) as m:
        m.start(executors=2)
        yield m


def test_streams_continue_on_another_executor_without_a_duplicate_or_a_gap(mesh, tmp_path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "repo" / "gpt" / "tokenizer" / "tokenizer.json"))
    reference = Reference()
    prompts, want = [], []
    for candidate in mixed_prompts(3 * STREAMS, seed=5):
        text = tokenizer.decode(candidate[:30])
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        tokens = reference.greedy(ids, MAX_TOKENS)
        if reference.clear(ids, tokens) and len(prompts) < STREAMS:
            prompts.append(text)
            want.append(tokens)
    assert len(prompts) == STREAMS
    parameters = {"max_tokens": MAX_TOKENS, "temperature": 0, "timeout": 120_000_000}

    got: dict[str, list] = {str(i): [] for i in range(STREAMS)}
    errors: queue.Queue = queue.Queue()
    lock = threading.Lock()

    def on_result(result, error):
        if error is not None:
            errors.put(error)
            return
        with lock:
            got[result.get_response().id].append(result)

    def tokens_received() -> int:
        with lock:
            return sum(len(r.as_numpy("token_ids")) for v in got.values() for r in v)

    with grpcclient.InferenceServerClient(mesh.probe.gateway_address()) as client:
        client.start_stream(callback=on_result)
        for i, prompt in enumerate(prompts):
            tensor = grpcclient.InferInput("text_input", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
            client.async_stream_infer("gpt", [tensor], request_id=str(i), parameters=parameters)
        poll(lambda: tokens_received() >= STREAMS * 4, 60, "the streams to get going", check=mesh.check_alive)
        mesh.kill("exec-0")
        finished_at_kill = sum(1 for v in got.values() if v and v[-1].get_response().parameters[FINAL].bool_param)
        poll(lambda: all(v and v[-1].get_response().parameters[FINAL].bool_param for v in got.values()), 120,
             "every stream to end")
        client.stop_stream()
    assert errors.empty(), errors.get_nowait()
    assert finished_at_kill < STREAMS, "every stream had ended before the executor was killed: nothing was tested"
    assert "tokens sent before its executor failed" in (tmp_path / "logs" / "exec-1.log").read_text()
    for i in range(STREAMS):
        tokens = [r.as_numpy("token_ids").tolist() for r in got[str(i)]]
        assert sum(tokens, []) == want[i], f"stream {i}"
        text = "".join(r.as_numpy("text_output")[0].decode() for r in got[str(i)])
        # An output that ends inside a character ends before it (the engine sends no U+FFFD).
        assert text == tokenizer.decode(want[i], skip_special_tokens=True).removesuffix("\ufffd")
