"""`batchline up --autoscale`: real services, a stock client, executors started and stopped as
the leader's demand asks; one stopped while clients send loses nothing."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tc
from prometheus_client.parser import text_string_to_metric_families

from batchline.testing.processes import poll

STARTUP_S = 120.0


class Up:
    """A `batchline up` process, its output collected line by line."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchline.cli", "up", "--log-level", "WARNING", "--gateway-port", "0",
             "--metrics-port", "0", "--http-port", "-1", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        def alive() -> None:
            if self.proc.poll() is not None:
                raise AssertionError(f"batchline up exited with {self.proc.returncode}:\n{self.output}")
        return poll(lambda: re.search(pattern, self.output), timeout, f"`{pattern}` in the output of batchline up",
                    check=alive)

    def scale_events(self) -> dict[tuple[str, str], float]:
        port = re.search(r"counted at http://[^:]+:(\d+)/metrics", self.output).group(1)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return {(s.labels["direction"], s.labels["reason"]): s.value for f in text_string_to_metric_families(text)
                if f.name == "batchline_scale_events" for s in f.samples if s.name.endswith("_total")}

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        code = self.proc.wait(120)
        self.reader.join(10)
        return code


class Clients:
    """Closed-loop clients of mlp, counting what every call came back with."""

    def __init__(self, address: str, n: int) -> None:
        self.address = address
        self.stop_event = threading.Event()
        self.answers: list[str] = []
        self.threads = [threading.Thread(target=self._send, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _send(self) -> None:
        client = tc.InferenceServerClient(self.address)
        features = tc.InferInput("features", [1, 32], "FP32")
        features.set_data_from_numpy(np.ones((1, 32), np.float32))
        while not self.stop_event.is_set():
            try:
                client.infer("mlp", [features], client_timeout=30)
                self.answers.append("ok")
            except tc.InferenceServerException as exc:
                self.answers.append(f"{exc.status()}: {exc.message()}")

    def stop(self) -> list[str]:
        self.stop_event.set()
        for t in self.threads:
            t.join(60)
        return self.answers


@pytest.fixture
def mlp_repository(model_repository, tmp_path):
    repo = tmp_path / "repository"
    shutil.copytree(model_repository / "mlp", repo / "mlp")
    return repo


def test_scaling_down_under_load_loses_nothing(mlp_repository):
    """Two executors where one suffices: after the cool-down one stops while four clients send, and
    every call is answered."""
    up = Up("--model-repository", str(mlp_repository), "--autoscale", "1:2", "--executors", "2",
            "--scale-down-cool-down-s", "2")
    clients = None
    try:
        address = up.wait_for(r"listening on (\S+);", STARTUP_S).group(1)
        clients = Clients(address, 4)
        up.wait_for(r"scaling executors down from 2 to 1 \(cool_down: at most [0-9.]+ executors wanted", 60)
        up.wait_for(r"executor-1 stopped \(exit code 0\)", 60)
        sent = len(clients.answers)
        poll(lambda: len(clients.answers) > sent + 50, 30, "calls answered by the executor left")
        answers = clients.stop()
        clients = None
        assert answers.count("ok") == len(answers), [a for a in answers if a != "ok"][:5]
        assert up.scale_events() == {("down", "cool_down"): 1.0}
        assert "restarted executor-1" not in up.output
    finally:
        if clients is not None:
            clients.stop()
        assert up.stop() == 0


def test_more_wanted_starts_executors_up_to_max(mlp_repository):
    """A target utilisation so low that any traffic wants more executors than MAX: one more starts
    (and registers), no more than MAX."""
    up = Up("--model-repository", str(mlp_repository), "--autoscale", "1:2",
            env={"BATCHLINE_SCHEDULER_TARGET_UTILISATION": "0.0001"})
    clients = None
    try:
        address = up.wait_for(r"listening on (\S+);", STARTUP_S).group(1)
        assert "started executor-1" not in up.output
        clients = Clients(address, 1)
        up.wait_for(r"scaling executors up from 1 to 2 \(forecast: [0-9.]+ executors wanted: mlp:1 ", 60)
        up.wait_for(r"started executor-1 \(pid", 10)
        time.sleep(3)  # the demand still wants more: nothing beyond MAX starts
        assert "executor-2" not in up.output
        assert up.scale_events() == {("up", "forecast"): 1.0}
        answers = clients.stop()
        clients = None
        assert answers and answers.count("ok") == len(answers)
    finally:
        if clients is not None:
            clients.stop()
        assert up.stop() == 0
