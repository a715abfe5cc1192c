"""Triton's generate extension on the REST port: `POST .../generate` answers one JSON object,
`.../generate_stream` server-sent events, one per response as the model makes them.

A body is a JSON object, read as Triton reads it: `id`; every other field that names one of the
model's inputs is that input, a value `[1]` or a list `[n]` of the input's datatype (`text_input`
a string, `input_ids` a list of token ids); any other field is a request parameter
(`"max_tokens": 20`, as TensorRT-LLM's examples send it), and so is each field of `parameters`
that names no input. An answer is `model_name`, `model_version`, `id` and
each output by name: a one-element BYTES output as its string (`text_output`), any other as a
list (`token_ids`). The stream's events go through the same gateway path as ModelStreamInfer's decoupled
responses; a refusal before the first event is the REST port's error answer, one after it an
event `{"error": ...}` that ends the stream.
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Awaitable, Callable

from batchline.codec import decode_tensor
from batchline.errors import BatchlineError, InvalidArgument
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from gateway.rest_tensors import given, json_tensor, set_parameter, shown

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_RESERVED = ("id", "parameters")


def generate_request(body: dict, model: pb.ModelInfo, version: str) -> ipb.ModelInferRequest:
    """The request `body` asks of `model`, at the URL's `version` ("" for the newest)."""
    try:
        return _request(body, model, version)
    except UnicodeEncodeError:
        # JSON may carry a lone surrogate (\ud800), which no protobuf string holds, nor UTF-8.
        raise InvalidArgument("the body holds a string that is not valid Unicode (a lone surrogate escape such "
                              "as \\ud800) in its id, a parameter or the prompt") from None


def _request(body: dict, model: pb.ModelInfo, version: str) -> ipb.ModelInferRequest:
    request = ipb.ModelInferRequest(model_name=model.name, model_version=version)
    request_id = body.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument(f"`id` must be a string, got {shown(request_id)}")
    request.id = request_id
    parameters = given(body, "parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgument("`parameters` must be an object")
    inputs = {spec.name: spec for spec in model.inputs}
    fields = [(k, v) for k, v in body.items() if k not in _RESERVED] + list(parameters.items())
    seen: set[str] = set()
    for name, value in fields:
        if name in seen:
            raise InvalidArgument(f"'{name}' is given twice, in the body and in `parameters`: give it once")
        seen.add(name)
        if name in inputs:
            _add_input(request, inputs[name], value)
        else:
            set_parameter(request.parameters, name, value)
    if not request.inputs:
        raise InvalidArgument(f"the body names none of model '{model.name}''s inputs "
                              f"({', '.join(sorted(inputs))}): send the prompt as `text_input` (a string) "
                              "or `input_ids` (a list of token ids)")
    return request


def _add_input(request: ipb.ModelInferRequest, spec: pb.TensorSpec, value) -> None:
    """`value` (one element, or a flat list of them) as the input `spec` names, of its datatype."""
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, (list, dict)) for v in values):
        raise InvalidArgument(f"input '{spec.name}' must be a value or a flat list of values, got {shown(value)}")
    request.inputs.add(name=spec.name, datatype=spec.datatype, shape=[len(values)])
    request.raw_input_contents.append(json_tensor(values, spec.name, spec.datatype, f"'{spec.name}'"))


def generate_answer(response: ipb.ModelInferResponse) -> dict:
    answer: dict = {"model_name": response.model_name, "model_version": response.model_version, "id": response.id}
    for i, out in enumerate(response.outputs):
        array = decode_tensor(out.name, out.datatype, list(out.shape), response.raw_output_contents[i], None)
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
        answer[out.name] = values[0] if len(values) == 1 and out.datatype == "BYTES" else values
    return answer


def event(value: dict) -> bytes:
    return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


Run = Callable[[Callable[[ipb.ModelInferResponse], None]], Awaitable[ipb.ModelInferResponse | None]]


async def first_then_rest(run: Run) -> AsyncIterator[bytes]:
    """The stream's events. Raises BatchlineError when the request fails before its first
    response (the caller answers it as an error status); later failures are an error event."""
    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(run(queue.put_nowait))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        first = await queue.get()
        if first is None:
            last = task.result()  # raises the refusal before anything was sent
            return _events_after(None, last, task, queue)
        return _events_after(first, None, task, queue)
    except BaseException:
        task.cancel()
        raise


async def _events_after(first, last, task: asyncio.Task, queue: asyncio.Queue) -> AsyncIterator[bytes]:
    try:
        if first is not None:
            yield event(generate_answer(first))
            while (item := await queue.get()) is not None:
                yield event(generate_answer(item))
            try:
                last = task.result()
            except BatchlineError as exc:
                yield event({"error": str(exc)})
                return
        if last is not None:
            yield event(generate_answer(last))
    finally:
        # A client that went away stops its sequence: the gateway's cancellation frees its slot.
        task.cancel()
