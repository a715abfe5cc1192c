"""A load call's override (RepositoryModelLoad's `config` and `file:` parameters, read from Redis)
made into a model directory of its own, which the executor loads the model from instead of the
repository's: a temporary directory per call, removed when the next call of the model (or the
executor's stop) replaces it. The repository itself is never written.

Triton's ModelConfig JSON replaces the model's config.toml: the fields batchline serves are
translated to config.toml keys (every other key takes its default); the fields that describe
what the graph already says (names, data types, dims) are accepted and left to the graph; any
other field is refused, named, and so is a key within the served fields that asks for what
batchline does not do (one holding Triton's default asks for nothing, and is accepted).
"""
from __future__ import annotations

import json
import pathlib
import shutil
import tempfile
from typing import Any

from batchline.protocol import internal_pb2 as pb
from executor.model_config import ConfigError, check_model_config

# Fields the graph or the executor decides; accepted so that a config Triton takes is taken here.
_DESCRIPTIVE = {"name", "platform", "backend", "input", "output", "parameters"}
OVERRIDE_JSON = "config.json"  # the override's config as sent, beside the files: what a reload is told by


def _int(value: Any, field: str) -> int:
    # Protobuf's JSON mapping writes 64-bit integers as strings ("16"); both are taken.
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{field} must be an integer (got {value!r})") from None


def _version_policy(policy: dict[str, Any]) -> dict[str, Any]:
    if "latest" in policy:
        return {"latest": _int(policy["latest"].get("num_versions", 1), "version_policy.latest.num_versions")}
    if "all" in policy:
        return {"all": True}
    if "specific" in policy:
        return {"specific": [_int(v, "version_policy.specific.versions")
                             for v in policy["specific"].get("versions", [])]}
    raise ConfigError(f"version_policy must hold latest, all or specific (got {sorted(policy)})")


# Within the fields served, the keys batchline takes; any other is refused unless it holds Triton's
# default (or is empty), which asks for nothing batchline does not do: a ModelConfig read back from
# a server writes its defaults out.
_SERVED = {
    "dynamic_batching": {"preferred_batch_size", "max_queue_delay_microseconds", "priority_levels",
                         "default_priority_level", "default_queue_policy"},
    "dynamic_batching.default_queue_policy": {"default_timeout_microseconds", "max_queue_size",
                                              "allow_timeout_override"},
    "instance_group[]": {"count", "name"},
}
# Triton's default of each such key (a key not listed asks for nothing only when empty).
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    # KIND_CPU too: Triton's own examples ask for it, and a CPU executor runs there; where an
    # executor has a GPU, its providers place the model (docs/guides/model-repository.md).
    "preserve_ordering": (False,), "timeout_action": ("REJECT", 0), "kind": ("KIND_AUTO", "KIND_CPU", 0),
}


def _asks_nothing(key: str, value: Any) -> bool:
    # Compared with the type too: False == 0 would let a 0 pass for any boolean's default.
    return value in (None, "") or value == {} or value == [] or any(
        value == d and type(value) is type(d) for d in _DEFAULTS.get(key, ()))


def _only_served(where: str, fields: Any) -> None:
    if not isinstance(fields, dict):
        raise ConfigError(f"{where} must be a JSON object (got {fields!r})")
    asked = sorted(k for k, v in fields.items() if k not in _SERVED[where] and not _asks_nothing(k, v))
    if asked:
        raise ConfigError(f"{where}: {asked} are not served by batchline's load overrides; it takes "
                          f"{sorted(_SERVED[where])}")


def config_keys(triton: dict[str, Any]) -> dict[str, Any]:
    """config.toml's keys from Triton's ModelConfig as JSON; ConfigError names what cannot be served."""
    batching = triton.get("dynamic_batching") or {}
    _only_served("dynamic_batching", batching)
    _only_served("dynamic_batching.default_queue_policy", batching.get("default_queue_policy") or {})
    for group in triton.get("instance_group") or []:
        _only_served("instance_group[]", group)
    unknown = sorted(set(triton) - _DESCRIPTIVE - {"max_batch_size", "dynamic_batching", "instance_group",
                                                   "version_policy"})
    if unknown:
        raise ConfigError(f"fields {unknown} are not served by batchline's load overrides; it takes max_batch_size, "
                          f"dynamic_batching, instance_group, version_policy, and input format / output label_filename")
    backend = triton.get("backend") or triton.get("platform") or "onnxruntime"
    if not backend.startswith("onnxruntime"):
        raise ConfigError(f"backend {backend!r}: batchline serves ONNX models with ONNX Runtime only")
    keys: dict[str, Any] = {}
    if "max_batch_size" in triton:
        keys["max_batch_size"] = _int(triton["max_batch_size"], "max_batch_size")
    if "preferred_batch_size" in batching:
        keys["preferred_batch_sizes"] = [_int(v, "preferred_batch_size") for v in batching["preferred_batch_size"]]
    if "max_queue_delay_microseconds" in batching:
        keys["max_queue_delay_ms"] = _int(batching["max_queue_delay_microseconds"],
                                          "max_queue_delay_microseconds") / 1000
    if "priority_levels" in batching:
        keys["priority_levels"] = _int(batching["priority_levels"], "priority_levels")
    if "default_priority_level" in batching:
        keys["default_priority"] = _int(batching["default_priority_level"], "default_priority_level")
    policy = batching.get("default_queue_policy") or {}
    if "default_timeout_microseconds" in policy:
        keys["default_timeout_ms"] = _int(policy["default_timeout_microseconds"], "default_timeout_microseconds") / 1000
    if "max_queue_size" in policy:
        keys["max_queue_size"] = _int(policy["max_queue_size"], "max_queue_size")
    if triton.get("instance_group"):
        keys["instance_count"] = sum(_int(g.get("count", 1), "instance_group.count") for g in triton["instance_group"])
    if "version_policy" in triton:
        keys["version_policy"] = _version_policy(triton["version_policy"])
    formats = {t["name"]: t["format"] for t in triton.get("input", []) if t.get("format") and "name" in t}
    if formats:
        keys["input_format"] = formats
    labels = {t["name"]: t["label_filename"] for t in triton.get("output", []) if t.get("label_filename")
              and "name" in t}
    if labels:
        keys["label_filename"] = labels
    return keys


class Overrides:
    """The override directories of this executor's models, under one temporary directory named
    after the executor (`owner`, its id when it has a stable one): an executor that was killed
    and starts again with the same id removes what the killed one left."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._root: pathlib.Path | None = None  # made at the first override
        self.dirs: dict[str, pathlib.Path] = {}    # model -> its override directory (named as the model)
        self.configs: dict[str, dict[str, Any]] = {}  # model -> its config.toml keys, checked

    def apply(self, name: str, blob: bytes | None, seq: int, repository: pathlib.Path) -> None:
        """Make the model's directory the override of call `seq` (None, or another call's: the repository's)."""
        override = pb.ModelOverride.FromString(blob) if blob else None
        if override is None or override.seq != seq:
            self.drop(name)
            return
        # Checked before anything changes: a config that cannot be served leaves the model as it was.
        try:
            triton = json.loads(override.config_json or "{}")
            if not isinstance(triton, dict):
                raise ConfigError("the config must be a JSON object (a ModelConfig)")
            config = check_model_config(config_keys(triton), "the load's config")
        except (ConfigError, AttributeError, TypeError, ValueError) as exc:
            raise ConfigError(str(exc) if isinstance(exc, ConfigError) else f"the load's config: {exc}") from None
        self.drop(name)
        if self._root is None:
            self._root = pathlib.Path(tempfile.gettempdir()) / f"batchline-overrides-{self.owner}"
            shutil.rmtree(self._root, ignore_errors=True)
            self._root.mkdir(mode=0o700)
        model_dir = self._root / str(seq) / name
        model_dir.mkdir(parents=True)
        self.dirs[name], self.configs[name] = model_dir, config
        (model_dir / OVERRIDE_JSON).write_text(override.config_json)
        if override.files:
            for path, data in override.files.items():
                target = model_dir / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        elif (repository / name).is_dir():
            # A config alone: the repository's files, under the new config.
            for entry in (repository / name).iterdir():
                if entry.name != "config.toml":
                    (model_dir / entry.name).symlink_to(entry.resolve())

    def drop(self, name: str) -> None:
        self.configs.pop(name, None)
        old = self.dirs.pop(name, None)
        if old is not None:
            shutil.rmtree(old.parent, ignore_errors=True)  # links are removed, never what they point to

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
