"""JSON log lines: the service, and the ids of the work a line was written for."""
from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np
import tritonclient.grpc as tc

from batchline import logs
from batchline.testing.polling import poll


def _logger(monkeypatch) -> tuple[logging.Logger, io.StringIO]:
    monkeypatch.setattr(logs, "_json", True)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter("gateway"))
    logger = logging.getLogger("test-logs")
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    return logger, out


def test_a_line_carries_the_ids_of_the_work_it_was_written_for(monkeypatch):
    logger, out = _logger(monkeypatch)
    logger.info("outside")
    with logs.context(request_id="r1", trace_id="t" * 32):
        with logs.context(batch_id="b1", trace_id=""):  # empty: left out, the outer one stands
            logger.warning("inside %d", 2)
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    first, second, third = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["service"] == "gateway" and first["message"] == "outside" and "request_id" not in first
    assert {k: second[k] for k in ("level", "message", "request_id", "batch_id", "trace_id")} == {
        "level": "WARNING", "message": "inside 2", "request_id": "r1", "batch_id": "b1", "trace_id": "t" * 32}
    assert "ValueError: boom" in third["exception"] and "request_id" not in third


async def test_concurrent_work_keeps_its_own_ids(monkeypatch):
    logger, out = _logger(monkeypatch)

    async def handle(request_id: str) -> None:
        with logs.context(request_id=request_id):
            await asyncio.sleep(0)
            logger.info("handled")

    await asyncio.gather(*(handle(f"r{i}") for i in range(5)))
    assert sorted(json.loads(line)["request_id"] for line in out.getvalue().splitlines()) == [f"r{i}" for i in range(5)]


def test_text_lines_carry_no_context_and_cost_nothing_to_enter(monkeypatch):
    logger, out = _logger(monkeypatch)
    monkeypatch.setattr(logs, "_json", False)  # configured for text: a context is not even kept
    assert not logs.structured()
    with logs.context(request_id="r1"):
        logger.info("inside")
    assert "request_id" not in json.loads(out.getvalue())
    assert logs.line("batchline", "up") == "up"
    assert json.loads(logs.line("batchline", "up", "json"))["service"] == "batchline"


def test_up_with_json_logs_writes_only_json_lines(model_repository, tmp_path):
    repo = tmp_path / "repository"
    shutil.copytree(model_repository / "mlp", repo / "mlp")
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchline.cli", "up", "--model-repository", str(repo), "--gateway-port", "0",
         "--metrics-port", "-1", "--http-port", "-1", "--log-format", "json", "--log-level", "DEBUG"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        up = poll(lambda: next((json.loads(x) for x in list(lines) if '"batchline: up.' in x), None), 120,
                  "batchline up to be up")
        address = re.search(r"listening on (\S+);", up["message"]).group(1)
        with tc.InferenceServerClient(address) as client:
            inp = tc.InferInput("features", [1, 32], "FP32").set_data_from_numpy(np.zeros((1, 32), np.float32))
            client.infer("mlp", [inp])
        poll(lambda: any('"batch_id"' in x and '"scheduler"' in x for x in list(lines)), 10,
             "the scheduler's line about the batch")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    parsed = [json.loads(x) for x in lines if x.strip()]  # every line is one JSON object
    assert {p["service"] for p in parsed} >= {"batchline", "gateway", "scheduler", "executor"}
    dispatched = [p for p in parsed if p["service"] == "scheduler" and "batch_id" in p]
    assert dispatched and re.fullmatch(r"[0-9a-f]{32}", dispatched[0]["batch_id"])
