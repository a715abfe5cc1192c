"""Triton's generate extension on the REST port: `POST .../generate` answers one JSON object,
`.../generate_stream` server-sent events, one per response as the model makes them.

A body is a JSON object: `id`, `parameters` (request parameters, as on `infer`) and every other
field an input of the same name: a string is a BYTES `[1]` tensor (`text_input`), a list of
integers an INT64 `[n]` one (`input_ids`). An answer is `model_name`, `model_version`, `id` and
each output by name: a one-element BYTES output as its string (`text_output`), any other as a
list (`token_ids`). The stream's events go through the same gateway path as ModelStreamInfer's decoupled
responses; a refusal before the first event is the REST port's error answer, one after it an
event `{"error": ...}` that ends the stream.
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Awaitable, Callable

import numpy as np

from batchline.codec import decode_tensor, encode_array
from batchline.errors import BatchlineError, InvalidArgument
from batchline.protocol import inference_pb2 as ipb
from gateway.rest_tensors import given, set_parameter, shown

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_RESERVED = ("id", "parameters")


def generate_request(body: dict, model: str, version: str) -> ipb.ModelInferRequest:
    try:
        return _request(body, model, version)
    except UnicodeEncodeError:
        # JSON may carry a lone surrogate (\ud800), which no protobuf string holds, nor UTF-8.
        raise InvalidArgument("the body holds a string that is not valid Unicode (a lone surrogate escape such "
                              "as \\ud800) in its id, a parameter or the prompt") from None


def _request(body: dict, model: str, version: str) -> ipb.ModelInferRequest:
    request = ipb.ModelInferRequest(model_name=model, model_version=version)
    request_id = body.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument(f"`id` must be a string, got {shown(request_id)}")
    request.id = request_id
    parameters = given(body, "parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgument("`parameters` must be an object")
    for key, value in parameters.items():
        set_parameter(request.parameters, key, value)
    for name, value in body.items():
        if name in _RESERVED:
            continue
        if isinstance(value, str):
            array = np.array([value.encode()], dtype=object)
        elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63
                                             for v in value):
            array = np.array(value, dtype=np.int64)
        else:
            raise InvalidArgument(f"input '{name}' must be a string or a list of 64-bit integers, got "
                                  f"{json.dumps(value)[:80]}")
        datatype, shape, raw = encode_array(array)
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    if not request.inputs:
        raise InvalidArgument("the body names no input: send the prompt as `text_input` (a string) "
                              "or `input_ids` (a list of token ids)")
    return request


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
