"""Protobuf answers built from the registry's ModelInfo and Redis's statistics: Triton's ModelStatistics and
ModelConfig."""
from __future__ import annotations

from batchline import contract
from batchline.protocol import inference_pb2 as ipb
from gateway.text import text_spec


def _duration(stats: dict[str, int], prefix: str) -> ipb.StatisticDuration:
    return ipb.StatisticDuration(count=stats.get(f"{prefix}_count", 0), ns=stats.get(f"{prefix}_ns", 0))


def _batch_duration(stats: dict[str, int], rows: int, field: str) -> ipb.StatisticDuration:
    return ipb.StatisticDuration(count=stats[contract.batch_stat(rows, "count")],
                                 ns=stats.get(contract.batch_stat(rows, field), 0))


def model_statistics(info, stats: dict[str, int]) -> ipb.ModelStatistics:
    batch_sizes = contract.batch_sizes(stats)
    return ipb.ModelStatistics(
        name=info.name,
        version=info.version,
        last_inference=stats.get("last_inference_ms", 0),
        inference_count=stats.get("inference_count", 0),
        execution_count=stats.get("execution_count", 0),
        inference_stats=ipb.InferStatistics(
            success=_duration(stats, "success"),
            fail=_duration(stats, "fail"),
            queue=_duration(stats, "queue"),
            compute_input=_duration(stats, "compute_input"),
            compute_infer=_duration(stats, "compute_infer"),
            compute_output=_duration(stats, "compute_output"),
        ),
        batch_stats=[
            ipb.InferBatchStatistics(
                batch_size=n,
                compute_input=_batch_duration(stats, n, "compute_input_ns"),
                compute_infer=_batch_duration(stats, n, "compute_infer_ns"),
                compute_output=_batch_duration(stats, n, "compute_output_ns"),
            )
            for n in batch_sizes
        ],
    )


def inputs_of(info) -> list:
    """The model's inputs as clients see them: the graph's, and its text input when it has one."""
    text = text_spec(info)
    return [*info.inputs, text] if text is not None else list(info.inputs)


def _data_type(datatype: str) -> int:
    # Triton names BYTES tensors TYPE_STRING; every other KServe datatype maps by name.
    return ipb.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


def model_config(info) -> ipb.ModelConfig:
    """Triton's view of a model (ModelConfig), from what the executor loaded and config.toml."""
    batched = info.max_batch_size > 0

    def dims(shape) -> list[int]:  # Triton leaves the batch dim out of a batched model's dims
        return list(shape[1:] if batched else shape)

    config = ipb.ModelConfig(
        name=info.name,
        platform=info.platform,
        backend="onnxruntime",
        max_batch_size=info.max_batch_size,
        input=[ipb.ModelInput(name=s.name, data_type=_data_type(s.datatype), dims=dims(s.shape),
                              format=ipb.ModelInput.Format.Value(s.format or "FORMAT_NONE")) for s in inputs_of(info)],
        output=[ipb.ModelOutput(name=s.name, data_type=_data_type(s.datatype), dims=dims(s.shape),
                                label_filename=s.label_filename) for s in info.outputs],
        parameters={
            "providers": ipb.ModelParameter(string_value=",".join(info.providers)),
            "padded_inputs": ipb.ModelParameter(string_value=",".join(info.padded_inputs)),
        },
    )
    if info.text.name:
        # Which input is text, sent instead of the token-id inputs (the bench reads it).
        config.parameters["text_input"].string_value = info.text.name
    if batched:
        config.dynamic_batching.CopyFrom(ipb.ModelDynamicBatching(
            preferred_batch_size=list(info.preferred_batch_sizes),
            max_queue_delay_microseconds=round(info.max_queue_delay_ms * 1000),
            priority_levels=info.priority_levels,
            default_priority_level=info.default_priority,
            # A request that cannot make its budget is answered DEADLINE_EXCEEDED (REJECT), and
            # a `timeout` parameter or the gRPC deadline overrides the default budget.
            default_queue_policy=ipb.ModelQueuePolicy(
                timeout_action=ipb.ModelQueuePolicy.REJECT,
                default_timeout_microseconds=round(info.default_timeout_ms * 1000),
                allow_timeout_override=True,
                max_queue_size=info.max_queue_size,
            ),
        ))
    if info.HasField("sequence"):
        config.ClearField("dynamic_batching")  # Triton's config has one or the other
        config.sequence_batching.CopyFrom(sequence_batching(info, dims))
    if info.decoupled:
        config.model_transaction_policy.decoupled = True
    return config


_CONTROL_KINDS = {"start": "CONTROL_SEQUENCE_START", "end": "CONTROL_SEQUENCE_END",
                  "ready": "CONTROL_SEQUENCE_READY", "corrid": "CONTROL_SEQUENCE_CORRID"}


def sequence_batching(info, dims) -> ipb.ModelSequenceBatching:
    """Triton's sequence_batching of a sequence model: its controls, its implicit state, its strategy."""
    seq = info.sequence
    control = ipb.ModelSequenceBatching.Control
    config = ipb.ModelSequenceBatching(max_sequence_idle_microseconds=seq.max_idle_us)
    delay_us = round(info.max_queue_delay_ms * 1000)
    if seq.strategy == "direct":
        config.direct.max_queue_delay_microseconds = delay_us
    else:
        config.oldest.max_queue_delay_microseconds = delay_us
    for c in seq.controls:
        entry = control(kind=control.Kind.Value(_CONTROL_KINDS[c.kind]))
        if c.kind == "corrid":
            entry.data_type = _data_type(c.datatype)
        elif c.datatype == "BOOL":
            entry.bool_false_true.extend([False, True])
        elif c.datatype.startswith("FP"):
            entry.fp32_false_true.extend([0.0, 1.0])
        else:
            entry.int32_false_true.extend([0, 1])
        config.control_input.add(name=c.name, control=[entry])
    for s in seq.states:
        config.state.add(input_name=s.input, output_name=s.output, data_type=_data_type(s.datatype), dims=list(s.shape))
    return config
