"""Where the scheduler sends a generative model's requests, and what the gateway admits: pure units."""
from __future__ import annotations

import pytest

from batchline.errors import InvalidArgument, ResourceExhausted
from batchline.planning import Pending
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from gateway.generation import admit
from scheduler.generation import place


def pending(n: int) -> list[Pending]:
    return [Pending(f"r{i}", 1, 1, 100.0, float(i)) for i in range(n)]


def test_requests_go_in_queue_order_to_the_most_free_slots_and_no_further():
    placed = place(pending(5), {"a": 1, "b": 3, "c": 0})
    assert [(e, p.request_id) for e, p in placed] == [("b", "r0"), ("b", "r1"), ("a", "r2"), ("b", "r3")]
    assert place(pending(2), {"a": 0}) == []


def request(prompt: bytes, **parameters) -> ipb.ModelInferRequest:
    r = ipb.ModelInferRequest(model_name="gpt")
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    r.raw_input_contents.append(len(prompt).to_bytes(4, "little") + prompt)
    for name, value in parameters.items():
        r.parameters[name].int64_param = value
    return r


def executor(running: int = 0, prefill: float = 0.001, step: float = 0.01) -> pb.ModelInfo:
    return pb.ModelInfo(name="gpt", version="1", generation=True, generation_slots=4, generation_running=running,
                        prefill_token_s=prefill, decode_step_s=step)


def test_admission_predicts_first_token_and_per_token_from_the_learned_costs():
    model = pb.ModelInfo(name="gpt", version="1", generation=True)
    prompt = b"x" * 100  # at most 100 tokens: 0.1 s of prefill and a 0.01 s step
    admit(request(prompt, ttft_ms=111, tpot_ms=10), model, [executor()])
    with pytest.raises(ResourceExhausted, match="110 ms to the first token") as err:
        admit(request(prompt, ttft_ms=109), model, [executor()])
    assert err.value.retry_after_s == pytest.approx(0.08)
    with pytest.raises(ResourceExhausted, match="per token"):
        admit(request(prompt, tpot_ms=9), model, [executor()])
    # A full executor is passed over for one with a free slot; all full is refused.
    admit(request(prompt, ttft_ms=111), model, [executor(running=4), executor()])
    with pytest.raises(ResourceExhausted, match="all its 4 sequences' cache in use"):
        admit(request(prompt, ttft_ms=111), model, [executor(running=4)])
    # No budget, or no costs measured yet: admitted.
    admit(request(prompt), model, [executor(running=4)])
    admit(request(prompt, ttft_ms=1), model, [executor(step=0.0)])
    with pytest.raises(InvalidArgument, match="'ttft_ms' must be milliseconds >= 0"):
        admit(request(prompt, ttft_ms=-1), model, [executor()])
