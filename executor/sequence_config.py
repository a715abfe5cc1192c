"""config.toml's `[sequence_batching]` table and `decoupled` key, and what they make of a loaded graph.

A sequence model's graph takes, besides the inputs clients send, control inputs the executor
fills from each request's sequence flags (Triton's START, END, READY, CORRID) and state inputs
paired with state outputs (Triton's implicit state): the step's state output is the next step's
state input. Neither kind is shown to clients: `split_graph` takes them out of the model's inputs
and outputs and records them in `ModelInfo.sequence`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from batchline.protocol import internal_pb2 as pb

CONTROL_KINDS = ("start", "end", "ready", "corrid")
# Triton's default max_sequence_idle_microseconds.
DEFAULT_IDLE_US = 1_000_000


class SequenceBatchingConfig(BaseModel):
    """`[sequence_batching]`: the model is stateful; a client's requests carry `sequence_id`."""

    model_config = ConfigDict(extra="forbid")

    max_sequence_idle_microseconds: int = Field(
        DEFAULT_IDLE_US, ge=1, description="A sequence with no request for this long is forgotten: its state "
        "expires, and its next request must start it again.")
    strategy: Literal["oldest", "direct"] = Field(
        "oldest", description="Triton's scheduling strategy. Both run a sequence's requests in order, one at a "
        "time, batched with other sequences' requests (docs/guides/model-repository.md#sequence-models).")
    control: dict[str, Literal["start", "end", "ready", "corrid"]] = Field(
        default_factory=dict, description="Graph input = start | end | ready | corrid: inputs the executor fills "
        "per row with the request's sequence_start, sequence_end, 1 (a request is there) and sequence_id.")
    state: dict[str, str] = Field(
        default_factory=dict, description="State input = state output: the graph's output whose value is the "
        "input's value at the sequence's next step (zeros at its start); kept in Redis between steps.")


def split_graph(where: str, info: pb.ModelInfo, config: SequenceBatchingConfig | None, decoupled: bool) -> None:
    """Move the control and state tensors out of `info`'s inputs and outputs into `info.sequence`;
    set `info.decoupled`. Raises ValueError naming what the graph lacks."""
    if decoupled:
        if info.max_batch_size:
            raise ValueError(f"{where}: decoupled = true needs max_batch_size = 0 (each request runs alone, and "
                             "each row of its outputs' first dim is one response)")
        info.decoupled = True
        # Clients see one response's outputs: the first dim counts the responses.
        for spec in info.outputs:
            del spec.shape[:1]
    if config is None:
        return
    inputs = {s.name: s for s in info.inputs}
    outputs = {s.name: s for s in info.outputs}
    seq = pb.SequenceBatching(max_idle_us=config.max_sequence_idle_microseconds, strategy=config.strategy)
    for name, kind in config.control.items():
        if name not in inputs:
            raise ValueError(f"{where}: [sequence_batching] control input {name!r} is not an input of the graph; "
                             f"its inputs are {sorted(inputs)}")
        seq.controls.add(name=name, kind=kind, datatype=inputs[name].datatype)
    for name, out in config.state.items():
        if name not in inputs:
            raise ValueError(f"{where}: [sequence_batching] state input {name!r} is not an input of the graph; "
                             f"its inputs are {sorted(inputs)}")
        if out not in outputs:
            raise ValueError(f"{where}: [sequence_batching] state output {out!r} is not an output of the graph; "
                             f"its outputs are {sorted(outputs)}")
        spec = inputs[name]
        shape = list(spec.shape[1:] if info.max_batch_size else spec.shape)
        if any(d < 0 for d in shape) or spec.datatype != outputs[out].datatype:
            raise ValueError(f"{where}: [sequence_batching] state {name!r} -> {out!r} must have one fixed shape "
                             f"and datatype (got {spec.datatype}{shape} -> {outputs[out].datatype})")
        seq.states.add(input=name, output=out, datatype=spec.datatype, shape=shape)
    if not info.max_batch_size and seq.states:
        raise ValueError(f"{where}: [sequence_batching] state needs max_batch_size > 0 (the states of the "
                         "batch's sequences are stacked along the batch dim)")
    hidden_in = set(config.control) | set(config.state)
    hidden_out = set(config.state.values())
    kept_in = [s for s in info.inputs if s.name not in hidden_in]
    kept_out = [s for s in info.outputs if s.name not in hidden_out]
    del info.inputs[:]
    info.inputs.extend(kept_in)
    del info.outputs[:]
    info.outputs.extend(kept_out)
    info.sequence.CopyFrom(seq)
