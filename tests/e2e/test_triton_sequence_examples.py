"""Triton's own client examples for sequence batching and decoupled models, run unmodified
(tests/triton_examples/) against a mesh serving models with the examples' names and tensors."""
from __future__ import annotations

import subprocess
import sys

import pytest

from batchline.testing.checkout import TRITON_EXAMPLES as EXAMPLES
from batchline.testing.stateful_models import save_repeat_int32, save_simple_sequence



@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from batchline.testing.in_process import InProcessMesh

    repo = tmp_path_factory.mktemp("repo")
    save_simple_sequence(repo)
    save_repeat_int32(repo)
    with InProcessMesh(None, str(repo)) as m:
        yield m


@pytest.mark.parametrize("example, passed", [
    ("simple_grpc_sequence_stream_infer_client.py", "PASS: Sequence"),
    ("simple_grpc_sequence_sync_infer_client.py", "PASS: Sequence"),
    ("simple_grpc_aio_sequence_stream_infer_client.py", "PASS: grpc aio sequence stream"),
    ("simple_grpc_custom_repeat.py", "PASS: Decoupled API"),
])
def test_the_example_passes_unmodified(served, example, passed):
    done = subprocess.run([sys.executable, str(EXAMPLES / example), "-u", served.address],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and passed in done.stdout, f"{example}:\n{done.stdout}\n{done.stderr}"
