"""One command for a GPU machine: the executor on ONNX Runtime's CUDA provider, FP16 against FP32, the
mesh through 1-8 gateways against ONNX Runtime alone, CPU per request per process, and the CPU
provider's scale-out over the machine's cores.

    python benchmarks/gpu.py [--out DIR] [--budget-s 420] [--provider cuda|cpu] [--quick]

Phases, in order, each skipped (with the reason in the results) when the budget is spent:

1. environment: the GPU (nvidia-smi), ONNX Runtime's version and providers, the cores;
2. models: the demo repository (built if missing), and minilm's FP16 variant;
3. ceiling: ONNX Runtime alone on the provider, FP32 and FP16, 16 and 128 tokens, at batch sizes up to
   minilm's max_batch_size, one run at a time and two sessions at once (benchmarks/gpu_ceiling.py); then
   the CUDA options (IO binding, CUDA graphs, TF32) at 128 tokens, batch 32; and FP16's largest
   difference from the CPU provider's FP32;
4. optimize: `batchline optimize minilm --variants fp16` judging and timing FP16 on the provider, with
   calibration inputs of real sentences at 16 and at 128 tokens; the 128-token run writes the version
   the mesh then serves (when FP16 passes and gains; else the script places the variant, and says so);
5. mesh: the executor's provider as `batchline status` reports it, then minilm FP16 at 128 tokens,
   closed loop, 64 requests in flight per gateway: 1 gateway and 1 executor, 4 and 2 unary, 8 and 4 on
   streams, then 4 and 6 on streams with four sequences a request (--mesh-steps chooses others);
   mesh/ceiling and CPU per sequence per process (benchmarks/gpu_mesh.py);
6. tests: `pytest -m gpu tests/e2e/test_gpu.py`;
7. cpu-scaling: the CPU provider only, mlp and minilm 16 tokens, the mesh pinned to 2, 4, 8 and 16
   cores (gateways and executors growing with them), the clients on 4 cores of their own where the
   machine has them.

Writes gpu.json (everything measured, after each phase, so a run cut short keeps what it did) and
gpu.txt (the tables) in --out. `--provider cpu` runs it all on the CPU provider (phases that need a GPU
say why they were skipped); `--quick` shortens every step, for a check that the script works.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import _common
import gpu_ceiling
import gpu_report

ROOT = _common.ROOT
# Gateways x executors: one executor fed by more and more gateways, then a second executor.
MESH_STEPS = "1x1,4x2,8x4s,4x6s/4"
IN_FLIGHT_PER_GATEWAY = 64
SCALING_CORES = (2, 4, 8, 16)
CLIENT_CORES = 4


class Run:
    """The results so far, written out after each phase, and the time left."""

    def __init__(self, out: pathlib.Path, budget_s: float) -> None:
        self.out, self.deadline = out, time.monotonic() + budget_s
        self.results: dict = {"phases": {}, "skipped": {}, "errors": {}}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def phase(self, name: str, needs_s: float, fn, *args) -> object:
        if self.left() < needs_s:
            self.results["skipped"][name] = f"{self.left():.0f} s left of the budget, the phase needs ~{needs_s:.0f}"
            print(f"[gpu] {name}: skipped ({self.results['skipped'][name]})", flush=True)
            return None
        began = time.monotonic()
        print(f"[gpu] {name} ...", flush=True)
        try:
            value = fn(*args)
            self.results["phases"][name] = {"seconds": round(time.monotonic() - began, 1)}
            return value
        except Exception as exc:  # noqa: BLE001 - the next phases still run
            self.results["errors"][name] = "".join(traceback.format_exception(exc))[-3000:]
            print(f"[gpu] {name} failed: {type(exc).__name__}: {exc}", flush=True)
            return None
        finally:
            print(f"[gpu] {name}: {time.monotonic() - began:.0f} s, {self.left():.0f} s left", flush=True)
            self.save()

    def save(self) -> None:
        (self.out / "gpu.json").write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        (self.out / "gpu.txt").write_text(gpu_report.render(self.results) + "\n")


def environment(run: Run, provider: str) -> None:
    import onnxruntime as ort

    env = {"python": platform.python_version(), "cores": os.cpu_count(), "cpu": _common.cpu_model(),
           "onnxruntime": ort.__version__, "onnxruntime_file": ort.__file__,
           "available_providers": ort.get_available_providers(), "provider": provider}
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        env["gpu"] = q.stdout.strip() or q.stderr.strip()
    run.results["environment"] = env
    print(f"[gpu] {env}", flush=True)


def models(run: Run, repo_arg: str, work: pathlib.Path) -> dict:
    from batchline.optimize.variants import Int8Options, build

    repo = _common.ensure_repository(repo_arg)
    fp16 = build("fp16", repo / "minilm" / "1" / "model.onnx", work, Int8Options(), None)
    run.results["models"] = {"repository": str(repo), "fp16": str(fp16.path)}
    return {"repo": repo, "fp32": repo / "minilm" / "1" / "model.onnx", "fp16": fp16.path}


def max_batch(repo: pathlib.Path) -> int:
    from executor.repository import read_config

    return int(read_config(repo / "minilm")["max_batch_size"])


def ceiling(run: Run, paths: dict, provider: str, quick: bool) -> None:
    seconds = 0.15 if quick else 0.4
    top = max_batch(paths["repo"])
    batches = sorted({1, 4, 8, 16, top, 2 * top})
    out: dict = {"max_batch_size": top, "seconds_per_point": seconds, "curves": {}, "best": {}}
    for label in ("fp32", "fp16"):
        if label == "fp16" and provider == gpu_ceiling.CPU:
            run.results["skipped"]["ceiling fp16"] = "FP16 runs on the CPU through casts, slower than FP32: GPU only"
            continue
        sessions = [gpu_ceiling.session(paths[label], provider, threads=0 if provider != gpu_ceiling.CPU else 1)
                    for _ in range(2)]
        for seq in (16, 128):
            c = gpu_ceiling.curve(sessions, seq, batches, seconds)
            out["curves"][f"{label} {seq}"] = c
            rate, at, way = gpu_ceiling.best(c, top)
            out["best"][f"{label} {seq}"] = {"seq_per_s": rate, "batch": at, "way": way}
            print(f"[gpu] ONNX Runtime alone, minilm {label} {seq} tokens: {rate:.0f} seq/s at batch {at} ({way})",
                  flush=True)
        del sessions
    run.results["ceiling"] = out
    if provider == gpu_ceiling.CUDA:
        run.results["cuda_options"] = gpu_ceiling.options(paths["fp32"], paths["fp16"], 128, top, seconds)
        run.results["fp16_vs_cpu_fp32_max_abs"] = gpu_ceiling.max_abs_difference(
            paths["fp16"], paths["fp32"], gpu_ceiling.CUDA, gpu_ceiling.CPU, 128, 16)


def _calibration(repo: pathlib.Path, seq_len: int, path: pathlib.Path, rows: int = 256) -> pathlib.Path:
    """Real sentences tokenized as the gateway does, cut or padded to exactly `seq_len` tokens."""
    import numpy as np
    from tokenizers import Tokenizer

    from batchline.bench.sentences import python_doc_sentences

    tok = Tokenizer.from_file(str(repo / "minilm" / "tokenizer" / "tokenizer.json"))
    tok.enable_truncation(seq_len)
    tok.enable_padding(length=seq_len, pad_id=0)
    enc = tok.encode_batch(python_doc_sentences(rows))
    np.savez(path, input_ids=np.array([e.ids for e in enc], dtype=np.int64),
             attention_mask=np.array([e.attention_mask for e in enc], dtype=np.int64))
    return path


def optimize(run: Run, paths: dict, work: pathlib.Path) -> pathlib.Path:
    """FP16 judged and timed by `batchline optimize` at 16 and 128 tokens; the repository the mesh serves."""
    from batchline.optimize.run import Options
    from batchline.optimize.run import optimize as run_optimize

    reports = {}
    served = work / "served"
    if served.exists():
        shutil.rmtree(served)
    shutil.copytree(paths["repo"], served, ignore=shutil.ignore_patterns("trt_cache"))
    for seq in (16, 128):
        target = served if seq == 128 else work / f"repo-{seq}"
        if seq != 128:
            shutil.copytree(paths["repo"], target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("trt_cache"))
        npz = _calibration(paths["repo"], seq, work / f"calibration-{seq}.npz")
        report = run_optimize(Options("minilm", target, variants=("fp16",), calibration=npz,
                                      scratch=work / f"scratch-{seq}"))
        reports[str(seq)] = {k: report[k] for k in ("chosen", "why", "written_version", "serves_on", "seconds")}
        reports[str(seq)]["variants"] = report["variants"]
        print(f"[gpu] optimize fp16 at {seq} tokens: {report['why']}", flush=True)
    run.results["optimize"] = reports
    if reports["128"]["written_version"] is None:
        # The mesh's figure is for FP16 whatever optimize decided; the results say it was placed.
        version = served / "minilm" / "2"
        version.mkdir()
        shutil.copyfile(paths["fp16"], version / "model.onnx")
        run.results["optimize"]["placed_by_script"] = "optimize wrote no version; the FP16 variant served as version 2"
    return served


def parse_steps(text: str) -> list[tuple[int, int, bool, int]]:
    """'1x1,8x2,8x2s,8x4s/4': gateways x executors, s for ModelStreamInfer streams, /R for R sequences
    in each request (default 1); executors never decrease (the script adds executors to the running
    mesh, it does not stop them)."""
    steps = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        layout, _, rows = item.partition("/")
        streams = layout.endswith("s")
        g, _, e = layout.rstrip("s").partition("x")
        if not (g.isdigit() and e.isdigit() and int(g) > 0 and int(e) > 0) or (rows and not rows.isdigit()) \
                or rows == "0":
            raise SystemExit(f"--mesh-steps: {item!r} is not GATEWAYSxEXECUTORS[s][/ROWS], e.g. 8x2, 8x2s or 8x4s/4")
        steps.append((int(g), int(e), streams, int(rows or 1)))
    if [e for _, e, _, _ in steps] != sorted(e for _, e, _, _ in steps):
        raise SystemExit(f"--mesh-steps: executors must not decrease from step to step ({text})")
    return steps


def mesh(run: Run, served: pathlib.Path, provider: str, quick: bool, steps: list[tuple[int, int, bool, int]]) -> None:
    import gpu_mesh

    warmup, duration = (1.0, 2.0) if quick else (2.0, 6.0)
    env = {"BATCHLINE_EXECUTOR_PROVIDERS": json.dumps(
        ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
        if provider == gpu_ceiling.CUDA else ["CPUExecutionProvider"])}
    out: dict = {"steps": [], "warmup_s": warmup, "duration_s": duration}
    run.results["mesh"] = out
    clients = gpu_mesh.Clients(max(CLIENT_CORES, max(g for g, _, _, _ in steps)))
    try:
        with gpu_mesh.GrowingMesh(served, env=env) as m:
            out["providers"] = m.providers()
            print(f"[gpu] providers as batchline status reports them: {out['providers']}", flush=True)
            for g, e, streams, rows in steps:
                calls = ("streams" if streams else "unary") + (f", {rows} rows a request" if rows > 1 else "")
                if run.left() < warmup + duration + 20:
                    run.results["skipped"][f"mesh {g} gateways {e} executors {calls}"] = "budget spent"
                    continue
                while m.executors < e:
                    m.add_executor()
                step = clients.step(m.gateways(g), "minilm", IN_FLIGHT_PER_GATEWAY * g, duration, warmup, seq_len=128,
                                    streaming=streams, rows=rows)
                step["executors"] = e
                out["steps"].append(step)
                print(f"[gpu] mesh {g} gateways, {e} executors, {calls}: {gpu_report.step_line(step)}", flush=True)
                run.save()
            out["providers_after"] = m.providers()
    finally:
        clients.close()


def tests(run: Run) -> None:
    # Whichever folder of tests/ holds it (scripts/test_groups.toml).
    path = next((ROOT / "tests").rglob("test_gpu.py"), None)
    if path is None:
        run.results["skipped"]["tests"] = "test_gpu.py is not in this checkout's tests/"
        return
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", str(path), "-p", "no:cacheprovider", "-q", "-rs"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(30.0, min(150.0, run.left() - 5)))
    text = proc.stdout + proc.stderr
    (run.out / "gpu-tests.txt").write_text(text)
    run.results["tests"] = {"returncode": proc.returncode,
                            "summary": text.strip().splitlines()[-1] if text.strip() else ""}
    print(f"[gpu] gpu tests: {run.results['tests']['summary']}", flush=True)


def scaling(run: Run, repo: pathlib.Path, quick: bool) -> None:
    import gpu_mesh

    warmup, duration = (1.0, 2.0) if quick else (1.5, 4.0)
    cores = sorted(os.sched_getaffinity(0))
    counts = [c for c in SCALING_CORES if c <= len(cores)] or [len(cores)]
    if quick:
        counts = counts[:2]
    out: dict = {"steps": [], "warmup_s": warmup, "duration_s": duration}
    run.results["cpu_scaling"] = out
    env = {"BATCHLINE_EXECUTOR_PROVIDERS": json.dumps(["CPUExecutionProvider"])}
    for c in counts:
        if run.left() < 2 * (warmup + duration) + 25:
            run.results["skipped"][f"cpu-scaling {c} cores"] = "budget spent"
            continue
        mesh_cores = cores[:c]
        spare = cores[c:]
        client_cores = spare[:CLIENT_CORES] if len(spare) >= CLIENT_CORES else cores
        gateways, executors = max(1, c // 2 - (1 if c >= 8 else 0)), max(1, c // 8)
        env_c = {**env, "BATCHLINE_EXECUTOR_CPU_CORES": str(max(1, c // executors))}
        clients = gpu_mesh.Clients(max(2, min(gateways, CLIENT_CORES * 2)), cores=client_cores)
        try:
            with gpu_mesh.GrowingMesh(repo, env=env_c, cores=mesh_cores) as m:
                while m.executors < executors:
                    m.add_executor()
                for model, seq in (("mlp", None), ("minilm", 16)):
                    step = clients.step(m.gateways(gateways), model, IN_FLIGHT_PER_GATEWAY * gateways, duration, warmup,
                                        seq_len=seq)
                    step.update(model=model, cores=c, executors=executors, clients_share_cores=client_cores == cores)
                    out["steps"].append(step)
                    print(f"[gpu] cpu {c} cores, {model}: {gpu_report.step_line(step)}", flush=True)
                    run.save()
        finally:
            clients.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-repository", default=str(ROOT / ".cache" / "model_repository"),
                   help="demo model repository, built if missing (default: .cache/model_repository)")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-results", help="where gpu.json and gpu.txt go "
                   "(default: $OUT, else ./gpu-results)")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting phases after this many seconds "
                   "(default: 420)")
    p.add_argument("--provider", choices=("cuda", "cpu"), default="cuda", help="execution provider of the GPU phases "
                   "(default: cuda)")
    p.add_argument("--phases", default="environment,models,ceiling,optimize,mesh,tests,cpu-scaling",
                   help="comma-separated subset, in the order above")
    p.add_argument("--mesh-steps", default=MESH_STEPS, help="the mesh phase's steps, GATEWAYSxEXECUTORS each, "
                   "s appended for ModelStreamInfer streams instead of unary calls, /R for R sequences a request, "
                   "executors never decreasing "
                   f"(default: {MESH_STEPS}; --quick: 1x1,2x1,2x2)")
    p.add_argument("--quick", action="store_true", help="short steps: check that the script works")
    args = p.parse_args()
    provider = gpu_ceiling.CUDA if args.provider == "cuda" else gpu_ceiling.CPU
    steps = parse_steps("1x1,2x1,2x2" if args.quick and args.mesh_steps == MESH_STEPS else args.mesh_steps)
    wanted = set(args.phases.split(","))
    run = Run(pathlib.Path(args.out), args.budget_s)
    run.results["argv"] = sys.argv[1:]
    work = pathlib.Path(tempfile.mkdtemp(prefix="batchline-gpu-"))
    try:
        if "environment" in wanted:
            run.phase("environment", 0, environment, run, provider)
            import onnxruntime as ort

            if provider not in ort.get_available_providers():
                print(f"[gpu] ONNX Runtime offers no {provider} here ({ort.get_available_providers()}): "
                      "the GPU phases will fail; --provider cpu runs them on the CPU", flush=True)
        paths = run.phase("models", 30, models, run, args.model_repository, work)
        if paths is None:
            return 1
        if "ceiling" in wanted:
            run.phase("ceiling", 40, ceiling, run, paths, provider, args.quick)
        served = paths["repo"]
        if "optimize" in wanted:
            if provider == gpu_ceiling.CPU:
                run.results["skipped"]["optimize"] = "FP16 is judged and timed on CUDA, which --provider cpu leaves out"
            else:
                served = run.phase("optimize", 60, optimize, run, paths, work) or served
        if "mesh" in wanted:
            run.phase("mesh", 40, mesh, run, served, provider, args.quick, steps)
        if "tests" in wanted:
            run.phase("tests", 30, tests, run)
        if "cpu-scaling" in wanted:
            run.phase("cpu-scaling", 40, scaling, run, paths["repo"], args.quick)
    finally:
        run.save()
        shutil.rmtree(work, ignore_errors=True)
    print(gpu_report.render(run.results), flush=True)
    return 1 if run.results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
