"""`batchline up --autoscale`: real services, a stock client, executors started and stopped as
the leader's demand asks; one stopped while clients send loses nothing."""
from __future__ import annotations

import re
import shutil
import threading
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tc
from prometheus_client.parser import text_string_to_metric_families

from batchline.testing.processes import poll
from batchline.testing.up import STARTUP_S, Up

# Ports of its own (any free one) and no REST port: tests in parallel must not meet on the defaults.
PORTS = ("--gateway-port", "0", "--metrics-port", "0", "--http-port", "-1")


def families(up: Up) -> list:
    port = re.search(r"counted at http://[^:]+:(\d+)/metrics", up.output).group(1)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return list(text_string_to_metric_families(text))


def scale_events(up: Up) -> dict[tuple[str, str], float]:
    return {(s.labels["direction"], s.labels["reason"]): s.value for f in families(up)
            if f.name == "batchline_scale_events" for s in f.samples if s.name.endswith("_total")}


def demand_reads(up: Up) -> float:
    return sum(s.value for f in families(up) if f.name == "batchline_demand_reads" for s in f.samples
               if s.name.endswith("_total"))


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
    up = Up(*PORTS, "--model-repository", str(mlp_repository), "--autoscale", "1:2", "--executors", "2",
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
        assert scale_events(up) == {("down", "cool_down"): 1.0}
        assert "restarted executor-1" not in up.output
    finally:
        if clients is not None:
            clients.stop()
        assert up.stop() == 0


def test_more_wanted_starts_executors_up_to_max(mlp_repository):
    """A target utilisation so low that any traffic wants more executors than MAX: one more starts
    (and registers), no more than MAX."""
    up = Up(*PORTS, "--model-repository", str(mlp_repository), "--autoscale", "1:2",
            env={"BATCHLINE_SCHEDULER_TARGET_UTILISATION": "0.0001"})
    clients = None
    try:
        address = up.wait_for(r"listening on (\S+);", STARTUP_S).group(1)
        assert "started executor-1" not in up.output
        clients = Clients(address, 1)
        up.wait_for(r"scaling executors up from 1 to 2 \(forecast: [0-9.]+ executors wanted: mlp:1 ", 60)
        up.wait_for(r"started executor-1 \(pid", 10)
        # The demand still wants more: three more decisions at MAX start nothing.
        reads = demand_reads(up)
        poll(lambda: demand_reads(up) >= reads + 3, 30, "three more reads of the demand")
        assert "executor-2" not in up.output
        assert scale_events(up) == {("up", "forecast"): 1.0}
        answers = clients.stop()
        clients = None
        assert answers and answers.count("ok") == len(answers)
    finally:
        if clients is not None:
            clients.stop()
        assert up.stop() == 0
