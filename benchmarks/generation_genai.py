"""ONNX Runtime GenAI's engine on the demo decoder's own graph: a peer of benchmarks/generation.py.

Runs in a virtualenv of its own (`onnxruntime-genai` pulls its own onnxruntime), as a child
process of the benchmark: one JSON job a line on stdin, one JSON answer a line on stdout.

    /work/peers/genai/bin/python benchmarks/generation_genai.py MODEL_DIR THREADS

MODEL_DIR holds the graph as `model.onnx` and the `genai_config.json` that `genai_config` (below)
writes: model type `decoder`, the cache in place (`past_present_share_buffer`), and the engine's
`static_batching` with up to 64 sequences a batch. Its `dynamic_batching` (continuous batching
over a paged cache) needs a graph from GenAI's own model builder (packed tokens, paged attention),
which has no GPT-2; with the demo's graph it refuses to start ("Packed hybrid execution requires
position_ids with dynamic int64 [num_tokens] ..."). A job: `{"prompts": [[ids]], "lengths": [n],
"in_flight": C}`, run closed loop (a new request as soon as one ends), greedy, each sequence
forced to its length (min = max generated tokens, as the mesh's ignore end-of-text). An answer:
`{"timed": [[tokens, ttft_s, tpot_s or null]], "cpu_s": ..., "wall_s": ...}`, the CPU this process
spent on the job.
"""
from __future__ import annotations

import json
import sys
import time


def genai_config(shape_layers: int, heads: int, width: int, vocabulary: int, context: int, threads: int,
                 max_batch: int = 64) -> dict:
    """The genai_config.json of the demo decoder's graph (batchline/decoder_graph.py)."""
    return {
        "model": {
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "context_length": context,
            "vocab_size": vocabulary, "type": "decoder",
            "decoder": {
                "session_options": {"log_id": "genai", "provider_options": [], "intra_op_num_threads": threads},
                "filename": "model.onnx", "head_size": width // heads, "hidden_size": width,
                "num_attention_heads": heads, "num_key_value_heads": heads, "num_hidden_layers": shape_layers,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "position_ids": "position_ids", "past_key_names": "past.%d.key",
                           "past_value_names": "past.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"max_length": context, "past_present_share_buffer": True, "do_sample": False, "num_beams": 1,
                   "num_return_sequences": 1, "top_k": 1, "top_p": 1.0, "temperature": 1.0},
        "engine": {"static_batching": {"max_batch_size": max_batch}},
    }


def run(engine, og, np, prompts: list[list[int]], lengths: list[int], in_flight: int) -> list[list]:
    buffer = engine.create_event_buffer(4096)
    pending = list(range(len(prompts)))
    live: dict[int, tuple[object, int, float, list[float]]] = {}  # id(request) -> (request, index, sent, stamps)
    timed: list[list] = []

    def add() -> None:
        i = pending.pop(0)
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(lengths[i])
        options.set_min_generated_tokens(lengths[i])
        live[id(request)] = (request, i, time.perf_counter(), [])
        request.begin_turn(np.asarray(prompts[i], np.int32), options)

    while pending and len(live) < in_flight:
        add()
    while live:
        for event in engine.run(buffer):
            entry = live.get(id(event.request))
            if entry is None:
                continue
            request, i, sent, stamps = entry
            if event.flags & og.EngineEventFlags.FAILED:
                raise SystemExit(f"GenAI failed request {i}: {event.error_code}")
            if event.flags & og.EngineEventFlags.TOKEN:
                stamps.append(time.perf_counter())
            if event.flags & og.EngineEventFlags.TURN_FINISHED:
                del live[id(event.request)]
                tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
                timed.append([len(stamps), stamps[0] - sent if stamps else float("nan"), tpot])
                request.close()
                if pending:
                    add()
    return timed


def main() -> int:
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(sys.argv[1])
    engine = og.Engine(model)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        start, cpu = time.perf_counter(), time.process_time()
        timed = run(engine, og, np, job["prompts"], job["lengths"], job["in_flight"])
        print(json.dumps({"timed": timed, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - start}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
