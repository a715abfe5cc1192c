"""Regenerate the checked-in gRPC/protobuf stubs from protos/.

Usage: python scripts/gen_protos.py [--out DIR]

The stubs register their descriptors in batchline's own descriptor pool
instead of protobuf's default one: tritonclient registers Triton's
`inference.*` messages in the default pool, and two definitions of the same
symbol there make whichever imports second fail. With a private pool the
server and stock clients can live in one process (tests, the bench tool).
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PKG = "batchline/protocol"


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    sources = sorted((PROTOS / PKG).glob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(s) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in sorted((out / PKG).glob("*_pb2.py")):
        text = path.read_text()
        text, n = re.subn(
            r"_descriptor_pool\.Default\(\)",
            "_pool.POOL",
            text,
        )
        if n != 1:
            raise SystemExit(f"{path}: expected one default-pool registration, found {n}")
        text = text.replace(
            "from google.protobuf import descriptor_pool as _descriptor_pool\n",
            "from google.protobuf import descriptor_pool as _descriptor_pool\n"
            "from batchline.protocol import _pool\n",
        )
        path.write_text(text)
    for path in sorted((out / PKG).glob("*_pb2*.py*")):
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT, help="output root (default: the repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
