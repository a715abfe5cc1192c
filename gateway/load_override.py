"""RepositoryModelLoad's overrides, as Triton's model repository extension defines them: `config`,
a model configuration as JSON that replaces the model's own, and `file:<path>` parameters, the
files of a model directory sent with the call (which then need a `config`). The gateway checks
their form and size; the executors that apply the load read them from Redis, translate the
config (executor/load_override.py) and say why a load failed."""
from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Callable

from batchline.errors import Internal, InvalidArgument, ResourceExhausted
from batchline.protocol import internal_pb2 as pb

FILE_PREFIX = "file:"
NAME_MAX = 255  # bytes of one path component, as file systems allow


def _path_problem(path: str) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return "is not a relative path inside the model's directory"
    if not _is_unicode(path):
        return "is not valid Unicode (a lone surrogate)"
    if any(len(p.encode()) > NAME_MAX for p in parts):
        return f"has a path component longer than {NAME_MAX} bytes"
    return ""


def _is_unicode(text: str) -> bool:
    """Whether `text` encodes as UTF-8: JSON may carry a lone surrogate escape (\\ud800), which it does not."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _value(param: Any) -> Any:
    """A parameter's value: gRPC's ModelRepositoryParameter holds one of its kinds; REST's JSON is the value."""
    kind = param.WhichOneof("parameter_choice") if hasattr(param, "WhichOneof") else None
    return getattr(param, kind) if kind else param


def _file(name: str, key: str, value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):  # REST sends a file's contents base64-encoded, as Triton's HTTP protocol does
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error:
            pass
    raise InvalidArgument(f"failed to load '{name}': parameter '{key[:80]}' must hold the file's bytes "
                          f"(base64-encoded over REST)")


def override_maker(name: str, parameters: dict, max_bytes: int) -> Callable[[int], bytes] | None:
    """What makes the call's ModelOverride for its sequence number (None: a plain load, which
    returns the model to its repository's files and config.toml). `parameters` as gRPC (protobuf
    parameters) or REST (JSON values) gives them."""
    files: dict[str, bytes] = {}
    for key, param in parameters.items():
        if not key.startswith(FILE_PREFIX):
            continue
        path = key[len(FILE_PREFIX):]
        problem = _path_problem(path)
        if problem:
            # Triton's words and status (its example checks both), then which parameter is wrong.
            shown = key[:80] if _is_unicode(key) else ascii(key[:80])[1:-1]  # a message must encode too
            raise Internal(f"failed to poll from model repository: parameter '{shown}' {problem}")
        files[path] = _file(name, key, _value(param))
    folders = {"/".join(path.split("/")[:i]) for path in files for i in range(1, path.count("/") + 1)}
    clash = sorted(folders & set(files))
    if clash:
        raise Internal(f"failed to poll from model repository: parameter 'file:{clash[0][:80]}' names a file where "
                       "another parameter's path needs a folder")
    if "config" not in parameters:
        if files:
            raise InvalidArgument(f"failed to load '{name}': file parameters need a 'config' parameter with them "
                                  f"(the model's configuration, as JSON)")
        return None
    text = _value(parameters["config"])
    if not isinstance(text, str):
        raise InvalidArgument(f"failed to load '{name}': parameter 'config' must be a string holding JSON")
    if not _is_unicode(text):
        raise InvalidArgument(f"failed to load '{name}': parameter 'config' is not valid Unicode (a lone surrogate)")
    try:
        parsed = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"failed to load '{name}': parameter 'config' is not valid JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise InvalidArgument(f"failed to load '{name}': parameter 'config' must be a JSON object (a ModelConfig)")
    size = len(text.encode()) + sum(len(p) + len(b) for p, b in files.items())
    if size > max_bytes:
        raise ResourceExhausted(f"failed to load '{name}': its config and files are {size} bytes, over the gateway's "
                                f"load_files_max_bytes of {max_bytes}: put large models in the model repository")
    return lambda seq: pb.ModelOverride(seq=seq, config_json=text, files=files).SerializeToString()
