"""Triton serving batchline's model repository, for side-by-side runs (benchmarks/vs_triton.py).

    LD_LIBRARY_PATH=$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))') \
        /work/peers/triton/bin/python benchmarks/peers/pytriton_server.py --model-repository model_repository

Runs in the peer's own virtualenv (`pip install nvidia-pytriton onnxruntime numpy`), so it imports
nothing from batchline. Each model's latest version is bound with Triton's dynamic batcher set from its
config.toml as batchline reads it: max_batch_size, max_queue_delay_ms, preferred_batch_sizes, and one
Triton model instance per `instance_count`, each an ONNX Runtime session on its share of the cores
(the way batchline's executor splits them), with ONNX Runtime's thread spinning off. Those are
batchline's settings, not Triton's best on a host: --max-queue-delay-ms, --instances, --threads and
--spinning set Triton's own, for vs_triton.py's sweep; --max-queue-size (with the REJECT queue
policy) and --queue-timeout-ms set its queue policy, for overload_vs_triton.py's. Requests are run by
ONNX Runtime in pytriton's Python process, as a Triton user without a GPU would serve an ONNX file
through pytriton. Inputs listed under
[padding] are padded to the batch's longest member, as batchline does; the benchmark sends
equal-length requests, so nothing is padded in practice.

Prints "ready <grpc port> <http port>" once Triton serves, then runs until SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import threading
import tomllib

import numpy as np
import onnxruntime as ort
from pytriton.model_config import DynamicBatcher, ModelConfig, QueuePolicy, Tensor, TimeoutAction
from pytriton.triton import Triton, TritonConfig

_NUMPY = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
          "tensor(double)": np.float64, "tensor(float16)": np.float16, "tensor(bool)": np.bool_}


def latest_version(model_dir: pathlib.Path) -> pathlib.Path:
    versions = [p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit() and (p / "model.onnx").exists()]
    if not versions:
        raise SystemExit(f"{model_dir}: no <version>/model.onnx")
    return max(versions, key=lambda p: int(p.name))


def session(path: pathlib.Path, threads: int, spinning: bool) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    # Off: as batchline's executor runs on a host it shares with its ingress.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def pad_concat(arrays: list[np.ndarray], value) -> np.ndarray:
    width = max(a.shape[1] for a in arrays)
    return np.concatenate([np.pad(a, [(0, 0), (0, width - a.shape[1])], constant_values=value)
                           if a.shape[1] < width else a for a in arrays])


def infer_function(sess: ort.InferenceSession, padding: dict):
    names = [o.name for o in sess.get_outputs()]

    def infer(requests):
        # Triton's dynamic batcher hands pytriton the batch as a list of requests; run them as one.
        feeds = {}
        for name in requests[0].keys():
            arrays = [r[name] for r in requests]
            if name in padding and len({a.shape[1:] for a in arrays}) > 1:
                feeds[name] = pad_concat(arrays, padding[name])
            else:
                feeds[name] = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
        outputs = dict(zip(names, sess.run(names, feeds)))
        answers, start = [], 0
        for r in requests:
            n = next(iter(r.values())).shape[0]
            answers.append({k: v[start:start + n] for k, v in outputs.items()})
            start += n
        return answers

    return infer


def bind(triton: Triton, model_dir: pathlib.Path, args: argparse.Namespace) -> str:
    cfg_path = model_dir / "config.toml"
    cfg = tomllib.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    instances = args.instances or int(cfg.get("instance_count", 1))
    threads = args.threads or max(1, args.cores // instances)
    delay_ms = float(cfg.get("max_queue_delay_ms", 2.0)) if args.max_queue_delay_ms is None else args.max_queue_delay_ms
    path = latest_version(model_dir) / "model.onnx"
    sessions = [session(path, threads, args.spinning) for _ in range(instances)]
    padding = cfg.get("padding", {})
    first = sessions[0]

    def tensors(args) -> list[Tensor]:
        return [Tensor(name=a.name, dtype=_NUMPY[a.type], shape=tuple(-1 if not isinstance(d, int) else d
                                                                      for d in a.shape[1:])) for a in args]

    config = ModelConfig(
        max_batch_size=int(cfg.get("max_batch_size", 8)),
        batcher=DynamicBatcher(
            max_queue_delay_microseconds=int(delay_ms * 1000),
            preferred_batch_size=list(cfg.get("preferred_batch_sizes", [])) or None,
            default_queue_policy=QueuePolicy(
                timeout_action=TimeoutAction.REJECT, max_queue_size=args.max_queue_size,
                default_timeout_microseconds=int(args.queue_timeout_ms * 1000), allow_timeout_override=True),
        ),
        batching=True,
    )
    triton.bind(
        model_name=model_dir.name,
        infer_func=[infer_function(s, padding) for s in sessions],
        inputs=tensors(first.get_inputs()),
        outputs=tensors(first.get_outputs()),
        config=config,
        strict=False,
    )
    return (f"{model_dir.name} ({instances} instance(s) x {threads} thread(s), "
            f"spinning {'on' if args.spinning else 'off'}, "
            f"queue delay {delay_ms:g} ms, queue cap {args.max_queue_size or 'none'}, {path.parent.name})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-repository", required=True)
    p.add_argument("--models", nargs="*", default=[], help="only these models (default: all)")
    p.add_argument("--grpc-port", type=int, default=0, help="0 = any free port")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--max-queue-delay-ms", type=float, default=None, help="default: each config.toml's")
    p.add_argument("--instances", type=int, default=0, help="model instances (default: each config.toml's)")
    p.add_argument("--threads", type=int, default=0,
                   help="ONNX Runtime threads per instance (default: cores / instances)")
    p.add_argument("--spinning", action=argparse.BooleanOptionalAction, default=False,
                   help="ONNX Runtime's intra-op thread spinning (default: off, as batchline's executor)")
    p.add_argument("--max-queue-size", type=int, default=0,
                   help="requests queued per model before Triton rejects more (REJECT policy; default: 0, unbounded)")
    p.add_argument("--queue-timeout-ms", type=float, default=0.0,
                   help="a request queued longer is rejected (default_timeout_microseconds; 0: none)")
    args = p.parse_args()
    repo = pathlib.Path(args.model_repository)
    ports = {}
    for key in ("grpc", "http", "metrics"):
        port = args.grpc_port if key == "grpc" else 0
        if not port:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        ports[key] = port
    config = TritonConfig(grpc_port=ports["grpc"], http_port=ports["http"], metrics_port=ports["metrics"],
                          log_verbose=0, exit_on_error=True)
    stop = threading.Event()
    with Triton(config=config) as triton:
        bound = [bind(triton, d, args) for d in sorted(repo.iterdir())
                 if d.is_dir() and (not args.models or d.name in args.models)]
        triton.run()
        # Only now: handlers installed before Triton starts break pytriton's model handshake.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"serving {', '.join(bound)}", file=sys.stderr, flush=True)
        print(f"ready {ports['grpc']} {ports['http']}", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
