"""The model repository: config files, the models loaded from them, and their metadata.

Layout: ``<repo>/<model>/config.toml`` and ``<repo>/<model>/<version>/model.onnx``.
The config.toml keys, their defaults and checks are `executor.model_config.ModelConfig`
(documented in docs/reference/settings.md). The sessions themselves, on the execution providers
a model asks for, are executor/sessions.py's.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort

from batchline.codec import DATATYPES, onnx_datatype
from batchline.optimize import tensorrt
from batchline.protocol import internal_pb2 as pb
from executor.model_config import ConfigError, declares_generation, read_model_config, select_versions
from executor.sequence_config import SequenceBatchingConfig, split_graph
from executor.sessions import (
    choose_providers, create_session, intra_op_threads_for, place_calibration_table, tensorrt_options,
)

log = logging.getLogger(__name__)


class RepositoryError(Exception):
    pass


@dataclass
class LoadedModel:
    info: pb.ModelInfo
    session: ort.InferenceSession
    padding: dict[str, Any] = field(default_factory=dict)
    instances: int = 1  # batches run at once: each instance is a lane the scheduler dispatches to
    fingerprint: tuple[int, ...] = ()  # of config.toml and model.onnx as loaded (executor/live.py reloads on change)
    tokenizer_json: bytes = b""  # config.toml [tokenizer]: published in Redis for the gateways

    # Asked for every batch or member: read off `info` once (its inputs and outputs are final by the
    # time a LoadedModel is made).
    @functools.cached_property
    def string_inputs(self) -> list[str]:
        return [s.name for s in self.info.inputs if s.datatype == "BYTES"]

    @functools.cached_property
    def output_names(self) -> list[str]:
        return [o.name for o in self.info.outputs]

    @functools.cached_property
    def run_outputs(self) -> list[str]:
        """What a run fetches: the outputs, then a sequence model's state outputs (the next step's state)."""
        return self.output_names + [s.output for s in self.info.sequence.states]

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def version(self) -> str:
        return self.info.version


def read_config(model_dir: pathlib.Path) -> dict[str, Any]:
    """The model's config.toml as a dict of every key (defaults filled in), checked on entry."""
    try:
        return read_model_config(model_dir / "config.toml").model_dump()
    except ConfigError as exc:
        raise RepositoryError(str(exc)) from None


def _tensor_specs(args, batched: bool) -> list[pb.TensorSpec]:
    specs = []
    for a in args:
        shape = [d if isinstance(d, int) and d >= 0 else -1 for d in a.shape]
        if batched and shape:
            shape[0] = -1
        specs.append(pb.TensorSpec(name=a.name, datatype=onnx_datatype(a.type), shape=shape))
    return specs


def _triton_fields(model_dir: pathlib.Path, config: dict[str, Any], inputs: list[pb.TensorSpec],
                   outputs: list[pb.TensorSpec]) -> None:
    """Set config.toml's input_format and label_filename (its labels read) on the tensors they name."""
    where = f"{model_dir}/config.toml"
    for key, specs in (("input_format", inputs), ("label_filename", outputs)):
        by_name = {s.name: s for s in specs}
        unknown = sorted(set(config[key]) - set(by_name))
        if unknown:
            raise RepositoryError(f"{where}: [{key}] names unknown tensors {unknown}; "
                                  f"the model's are {sorted(by_name)}")
    for name, fmt in config["input_format"].items():
        {s.name: s for s in inputs}[name].format = "" if fmt == "FORMAT_NONE" else fmt
    for name, filename in config["label_filename"].items():
        spec = {s.name: s for s in outputs}[name]
        # Judged by its name, not where links lead (a load's config alone links the repository's files):
        # its lines are published as labels, and a name leading out of the model's directory is not the model's.
        path = pathlib.Path(os.path.normpath(model_dir / filename))
        if not path.is_relative_to(os.path.normpath(model_dir)):
            raise RepositoryError(f"{where}: [label_filename] {name}: {filename!r} is outside the model's directory")
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise RepositoryError(f"{where}: [label_filename] {name}: cannot read {model_dir / filename} "
                                  f"({exc.strerror})") from None
        spec.label_filename = filename
        spec.labels.extend(lines)


def load_model(
    model_dir: pathlib.Path,
    version_dir: pathlib.Path,
    config: dict[str, Any],
    providers: list[str],
    trt_cache_dir: str,
    intra_op_threads: int,
    allow_spinning: bool = True,
    cpu_cores: int = 0,
) -> LoadedModel:
    name, version = model_dir.name, version_dir.name
    path = version_dir / "model.onnx"
    options = {k: dict(v) for k, v in config["provider_options"].items()}
    options[tensorrt.PROVIDER] = tensorrt_options(options.get(tensorrt.PROVIDER, {}), name, version, version_dir,
                                                  trt_cache_dir)
    chosen = choose_providers(config["providers"] or providers, options, ort.get_available_providers())
    for provider, opts in list(chosen):
        if provider == tensorrt.PROVIDER:
            try:
                place_calibration_table(opts, version_dir)
            except OSError as exc:
                # An engine cache it cannot write (a read-only file system): the next provider serves.
                log.warning("%s version %s: TensorRT left out, its INT8 calibration table cannot be placed in %s "
                            "(%s)", name, version, opts.get("trt_engine_cache_path"), exc)
                chosen = [(p, o) for p, o in chosen if p != tensorrt.PROVIDER]
    instances = int(config["instance_count"])
    threads = intra_op_threads_for(instances, int(config["intra_op_threads"]) or intra_op_threads, cpu_cores)
    session = create_session(path, chosen, threads, allow_spinning,
                             f"{name} version {version}")
    batched = config["max_batch_size"] > 0
    inputs = _tensor_specs(session.get_inputs(), batched)
    outputs = _tensor_specs(session.get_outputs(), batched)
    if batched:
        for spec in [*inputs, *outputs]:
            if not spec.shape:
                raise RepositoryError(f"{path}: max_batch_size > 0 but '{spec.name}' has no batch dimension")
        for arg in session.get_inputs():
            first = arg.shape[0] if arg.shape else None
            fixed = isinstance(first, int) and first >= 0
            if fixed and not (first == 1 and config["max_batch_size"] == 1):
                # A fixed first dimension takes that many rows a run, whatever the batch: a warm-up or a batch
                # of another size would fail in ONNX Runtime.
                raise RepositoryError(
                    f"{path}: input '{arg.name}' has a fixed first dimension of {first}, but max_batch_size "
                    f"{config['max_batch_size']} batches requests along it: export the graph with a dynamic "
                    "batch dimension, or set max_batch_size = 0 in config.toml (each request then runs alone)")
    _triton_fields(model_dir, config, inputs, outputs)
    padding = dict(config["padding"])
    unknown_pad = set(padding) - {s.name for s in inputs}
    if unknown_pad:
        raise RepositoryError(f"{model_dir}/config.toml: [padding] names unknown inputs {sorted(unknown_pad)}")
    if padding:
        _check_unpadded_outputs(f"{model_dir}/config.toml", session, padding)
    info = pb.ModelInfo(
        name=name,
        version=version,
        platform="onnxruntime_onnx",
        max_batch_size=config["max_batch_size"],
        max_queue_delay_ms=float(config["max_queue_delay_ms"]),
        default_timeout_ms=float(config["default_timeout_ms"]),
        default_priority=int(config["default_priority"]),
        priority_levels=int(config["priority_levels"]),
        preferred_batch_sizes=list(config["preferred_batch_sizes"]),
        inputs=inputs,
        outputs=outputs,
        # What the session really runs on: onnxruntime-gpu lists CUDA/TensorRT
        # as available on hosts without CUDA and silently falls back.
        providers=session.get_providers(),
        padded_inputs=sorted(padding),
        max_queue_size=int(config["max_queue_size"]),
    )
    sequence = config.get("sequence_batching")
    try:
        split_graph(f"{model_dir}/config.toml", info, SequenceBatchingConfig(**sequence) if sequence else None,
                    bool(config.get("decoupled")))
    except ValueError as exc:
        raise RepositoryError(str(exc)) from None
    tokenizer_json = _text_input(model_dir, config.get("tokenizer"), info) if config.get("tokenizer") else b""
    log.info("loaded %s version %s on %s (max_batch_size %d, %d instance(s))",
             name, version, list(info.providers), info.max_batch_size, instances)
    return LoadedModel(info=info, session=session, padding=padding, instances=instances, tokenizer_json=tokenizer_json)


def _check_unpadded_outputs(where: str, session: ort.InferenceSession, padding: dict[str, Any]) -> None:
    """Refuse [padding] where an output has a padded axis: outputs are split back by rows only, so
    a member's answer would have its batch's longest length, and depend on its neighbours."""
    padded = {d for arg in session.get_inputs() if arg.name in padding
              for d in (arg.shape or [])[1:] if isinstance(d, str)}
    for out in session.get_outputs():
        shared = sorted(padded & {d for d in (out.shape or [])[1:] if isinstance(d, str)})
        if shared:
            raise RepositoryError(
                f"{where}: [padding] pads the axis {shared} that output '{out.name}' carries too: each request would "
                "get an answer as long as its batch's longest member. Pad only models whose outputs do not have the "
                "padded length (pooled embeddings, classifiers), or remove [padding]: requests of other lengths "
                "then run in groups of their own")


def _text_input(model_dir: pathlib.Path, tok: dict[str, Any], info: pb.ModelInfo) -> bytes:
    """Check the [tokenizer] table against the graph, set the model's text input; tokenizer.json's bytes."""
    from tokenizers import Tokenizer

    where = f"{model_dir}/config.toml [tokenizer]"
    path = model_dir / tok["path"] / "tokenizer.json"
    try:
        blob = path.read_bytes()
        Tokenizer.from_str(blob.decode())
    except OSError as exc:
        raise RepositoryError(f"{where}: cannot read {path} ({exc.strerror})") from None
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        raise RepositoryError(f"{where}: {path} is not a tokenizer ({exc})") from None
    names = {s.name: s for s in info.inputs}
    for key in ("ids_input", "mask_input", "type_ids_input"):
        if tok[key] and tok[key] not in names:
            raise RepositoryError(f"{where}: {key} {tok[key]!r} is not an input of the graph; "
                                  f"its inputs are {sorted(names)}")
    if tok["input"] in names:
        raise RepositoryError(f"{where}: input {tok['input']!r} is already the name of one of the graph's inputs")
    expected = set(filter(None, (tok["ids_input"], tok["mask_input"], tok["type_ids_input"])))
    if set(names) != expected:
        raise RepositoryError(f"{where}: the graph's inputs {sorted(names)} are not the tokenizer's {sorted(expected)}")
    fixed = names[tok["ids_input"]].shape[1] if len(names[tok["ids_input"]].shape) == 2 else -1
    if fixed > 0 and tok["max_length"] > fixed:
        raise RepositoryError(f"{where}: max_length {tok['max_length']} is more than the {fixed} tokens the graph's "
                              f"input {tok['ids_input']!r} takes: set max_length = {fixed}")
    info.text.CopyFrom(pb.TextInput(
        name=tok["input"], max_length=tok["max_length"], truncate=tok["truncate"], ids_input=tok["ids_input"],
        mask_input=tok["mask_input"], type_ids_input=tok["type_ids_input"],
        tokenizer_sha256=hashlib.sha256(blob).hexdigest(),
    ))
    return blob


@dataclass
class ModelDir:
    """One model directory as scanned: its config and the versions its version_policy serves."""
    path: pathlib.Path
    config: dict[str, Any]
    versions: dict[str, tuple[int, ...]]  # selected version -> fingerprint of its files (a change reloads it)

    @property
    def name(self) -> str:
        return self.path.name


def fingerprint(*paths: pathlib.Path) -> tuple[int, ...]:
    """What tells a changed file from the one loaded: modification time and size of each."""
    out: list[int] = []
    for p in paths:
        try:
            st = p.stat()
            out += [st.st_mtime_ns, st.st_size]
        except OSError:
            out += [0, -1]
    return tuple(out)


def _version_files(version_dir: pathlib.Path) -> list[pathlib.Path]:
    """The files of a version whose change is a new version: model.onnx first, then every other
    file beside it (a graph's external weights, a calibration table, labels), by name."""
    others = sorted(p for p in version_dir.iterdir() if p.name != "model.onnx" and p.is_file())
    return [version_dir / "model.onnx", *others]


def model_names(root: pathlib.Path, only: list[str] | None = None) -> list[str]:
    """The model directories of the repository (those in `only`, when given) that batches of whole requests serve.

    Generative models (config.toml `[generation]`) are left out: the executor serves them with the
    generation engine (executor/generation_serving.py).
    """
    if not root.is_dir():
        raise RepositoryError(f"model repository {root} does not exist")
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and (not only or p.name in only) and not declares_generation(p))


def scan_model(model_dir: pathlib.Path, config: dict[str, Any] | None = None,
               config_file: str = "config.toml") -> ModelDir:
    """The model's config and selected versions; RepositoryError when its config cannot be served.

    `config`: the model's config.toml keys given (a load call's override), with the file in the
    directory whose change tells a new config (`config_file`)."""
    if ":" in model_dir.name:
        # Redis keys are built as prefix:model:version (batchline.contract).
        raise RepositoryError(f"{model_dir}: a model name may not contain ':'")
    if not model_dir.is_dir():
        raise RepositoryError(f"model '{model_dir.name}' is not in the repository {model_dir.parent}")
    try:
        if config is None:
            config = read_config(model_dir)
        present = [p.name for p in model_dir.iterdir() if p.is_dir() and (p / "model.onnx").exists()]
        selected = select_versions(config["version_policy"], present)
        config_path = model_dir / config_file
        prints = {v: fingerprint(config_path, *_version_files(model_dir / v)) for v in selected}
    except OSError as exc:
        # A folder this executor may not read (an ext4 volume's lost+found) is that model's failure alone.
        raise RepositoryError(f"model '{model_dir.name}' cannot be read: {exc}") from None
    return ModelDir(model_dir, config, prints)


def load_repository(
    root: str | pathlib.Path,
    only: list[str] | None = None,
    providers: list[str] | None = None,
    trt_cache_dir: str = "",
    intra_op_threads: int = 0,
    allow_spinning: bool = True,
    cpu_cores: int = 0,
) -> list[LoadedModel]:
    """Every model's selected versions, or RepositoryError at the first that fails (model control mode none)."""
    root = pathlib.Path(root)
    models = []
    for name in model_names(root, only):
        scanned = scan_model(root / name)
        for version in scanned.versions:
            model = load_model(
                scanned.path, scanned.path / version, scanned.config, providers or ["CPUExecutionProvider"],
                trt_cache_dir, intra_op_threads, allow_spinning, cpu_cores,
            )
            model.fingerprint = scanned.versions[version]
            models.append(model)
    # Generative models are the generation engine's (executor/generation_serving.py).
    generative = {p.name for p in root.iterdir() if p.is_dir() and declares_generation(p)}
    if only:
        missing = set(only) - {m.name for m in models} - generative
        if missing:
            raise RepositoryError(f"models {sorted(missing)} not found in {root}")
    if not models and not generative & set(only or generative):
        raise RepositoryError(f"no models found in {root} (expected <model>/<version>/model.onnx)")
    return models


def warmup_inputs(model: LoadedModel, rows: int = 1) -> dict[str, np.ndarray]:
    """Zero-filled inputs with every free dimension set small, for a warm-up run."""
    feeds = {}
    # The graph's inputs, sequence control and state inputs too (they are not among the model's).
    for spec in _tensor_specs(model.session.get_inputs(), model.info.max_batch_size > 0):
        shape = [d if d >= 0 else 8 for d in spec.shape]
        if model.info.max_batch_size > 0:
            shape[0] = rows
        dtype = DATATYPES[spec.datatype]
        feeds[spec.name] = np.zeros(shape, dtype=dtype if spec.datatype != "BYTES" else object)
    return feeds
