"""`batchline up` keeps its mesh running: real services SIGKILLed under load from a stock client,
a real crash loop (a model ONNX Runtime cannot load), and an embedded Redis that cannot come back
(another process took its port)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import threading
import urllib.request
from collections import Counter

import numpy as np
import psutil
import pytest
import tritonclient.grpc as tc
from prometheus_client.parser import text_string_to_metric_families

from batchline.testing.polling import poll
from batchline.testing.up import STARTUP_S, Up

RESTART_S = 60.0


def _restarts(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.labels["service"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "batchline_restarts" for s in f.samples if s.name == "batchline_restarts_total"}


@pytest.fixture
def mlp_repository(model_repository, tmp_path):
    repo = tmp_path / "repository"
    shutil.copytree(model_repository / "mlp", repo / "mlp")
    return repo


_counted = threading.Lock()


def _load(address: str, stop: threading.Event, outcomes: Counter, messages: Counter) -> None:
    """A stock client sending mlp requests one after another until `stop`, counting how each ended
    (and why, when it failed). Like any client, it pauses a moment before trying again after a
    failure: one that spins would count an outage's length in thousands of calls."""
    client = tc.InferenceServerClient(address)
    x = np.random.default_rng(0).standard_normal((1, 32)).astype(np.float32)
    while not stop.is_set():
        inp = tc.InferInput("features", [1, 32], "FP32")
        inp.set_data_from_numpy(x)
        with _counted:
            outcomes["sent"] += 1
        try:
            client.infer("mlp", [inp], client_timeout=15)
            outcome = "ok"
        except tc.InferenceServerException as exc:
            outcome = exc.status() or "error"
            with _counted:
                messages[(exc.message() or "")[:80]] += 1
        with _counted:
            outcomes[outcome] += 1
        if outcome != "ok":
            stop.wait(0.02)
    client.close()


def test_killed_services_are_restarted_under_load_and_every_call_is_answered(mlp_repository):
    up = Up("--model-repository", str(mlp_repository), "--executors", "3", "--gateways", "2",
            "--gateway-port", "0", "--metrics-port", "0", "--http-port", "-1")
    stop, outcomes, messages, clients = threading.Event(), Counter(), Counter(), []
    try:
        ready = up.wait_for(r"listening on (\S+);.*restarts counted at http://\S+:(\d+)/metrics", STARTUP_S)
        address, metrics_port = ready.group(1), int(ready.group(2))
        for _ in range(4):
            clients.append(threading.Thread(target=_load, args=(address, stop, outcomes, messages), daemon=True))
            clients[-1].start()
        poll(lambda: outcomes["ok"] >= 50, 30, "the load to be served")
        kills = ["executor-0"] * 3 + ["scheduler", "gateway-0"]
        for n, service in enumerate(kills, 1):
            before = outcomes["ok"]
            os.kill(up.pid_of(service), signal.SIGKILL)
            count = kills[:n].count(service)
            # The count goes up a moment before the log line that names the new pid, which the next
            # kill of this service reads: wait for both.
            poll(lambda: _restarts(metrics_port).get(service) == count
                 and len(re.findall(rf"restarted {service} \(pid", up.output)) == count, RESTART_S,
                 f"{service} restarted {count} time(s)", check=up.check_alive)
            poll(lambda: outcomes["ok"] > before + 20, RESTART_S, f"the load served again after killing {service}")
        # Enough calls that the few in flight on the killed gateway's connections weigh under 1%.
        poll(lambda: outcomes["sent"] >= 1000, RESTART_S, "1000 calls sent")
    finally:
        stop.set()
        for c in clients:
            c.join(30)
        code = up.stop()
    output = up.output
    print(f"calls: {dict(outcomes)}; failures: {dict(messages)}")  # for a reader of -s output
    answered = sum(v for k, v in outcomes.items() if k != "sent")
    assert answered == outcomes["sent"], (outcomes, output[-3000:])  # every call answered, none hangs
    assert outcomes["ok"] >= 0.99 * outcomes["sent"], (outcomes, messages, output[-3000:])
    assert code == 0 and "batchline: stopped" in output, output[-3000:]
    assert "exited with code -9; restarting it" in output
    assert [len(re.findall(rf"restarted {s} \(pid", output))
            for s in ("executor-0", "scheduler", "gateway-0")] == [3, 1, 1]


def test_a_crash_loop_stops_up_and_names_the_service_with_its_last_output(tmp_path):
    version = tmp_path / "repository" / "broken" / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(b"this is not an ONNX model")
    up = Up("--model-repository", str(tmp_path / "repository"), "--gateway-port", "0", "--metrics-port", "-1",
            "--http-port", "-1",
            "--max-restarts", "1", "--startup-timeout", "300")
    code = up.proc.wait(180)
    up.reader.join(10)
    output = up.output
    assert code == 1, output
    message = re.search(r"batchline: executor-0 crashed 2 times within 60 s .*stopping the mesh", output)
    assert message, output
    # Its last output follows: ONNX Runtime's reason.
    assert "INVALID_PROTOBUF" in output[message.end():] or "Protobuf parsing failed" in output[message.end():], output
    assert "restarting it in 0.5 s" in output
    assert "batchline: stopped" in output


def _listen(port: int) -> socket.socket | None:
    """A socket listening on 127.0.0.1:`port`, or None while the port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen()
    except OSError:
        sock.close()
        return None
    return sock


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_embedded_redis_that_cannot_restart_stops_the_mesh_with_one_line_saying_why(mlp_repository):
    up = Up("--model-repository", str(mlp_repository), "--gateway-port", "0", "--metrics-port", "-1",
            "--http-port", "-1")
    squatter = None
    try:
        up.wait_for(r"listening on", STARTUP_S)
        output = up.output
        port = int(re.search(r"started Redis \S+ at redis://\S*:(\d+)/0 ", output).group(1))
        directory = re.search(r"the services use unix://:\*\*\*@(\S+)/redis\.sock", output).group(1)
        [redis_pid] = [c.pid for c in psutil.Process(up.proc.pid).children() if "redis-server" in c.name()]
        services = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", output)]
        # `up` is held still while Redis dies and this process takes its port: its restart must fail.
        os.kill(up.proc.pid, signal.SIGSTOP)
        try:
            os.kill(redis_pid, signal.SIGKILL)
            squatter = poll(lambda: _listen(port), 10, f"Redis's port {port} to be free")
        finally:
            os.kill(up.proc.pid, signal.SIGCONT)
        code = up.proc.wait(150)
        up.reader.join(10)
    finally:
        up.stop()
        if squatter is not None:
            squatter.close()
    output = up.output
    assert code == 1, output
    assert "Traceback" not in output, output
    why = re.findall(r"batchline: Redis exited with code -9 and could not be restarted: redis-server exited with 1: "
                     rf".*127\.0\.0\.1:{port}.*Address already in use.*; stopping the mesh\n", output)
    assert len(why) == 1, output
    assert "batchline: stopped" in output
    poll(lambda: not any(_alive(p) for p in [*services, redis_pid]), 30, "every process of the mesh to end")
    assert not os.path.exists(directory)


def test_up_without_the_demo_extra_says_what_to_install(monkeypatch, tmp_path):
    from batchline import mesh

    monkeypatch.setattr(mesh, "DEMO_MODULES", ("batchline_no_such_module",))
    with pytest.raises(SystemExit) as exc:
        mesh.build_demo(tmp_path / "repository")
    message = str(exc.value.code)
    assert "batchline_no_such_module" in message and "pip install 'batchline[demo]'" in message
    assert "--model-repository" in message and "\n" not in message


def test_a_demo_build_cut_short_is_marked_unfinished_until_a_build_ends(monkeypatch, tmp_path):
    """Ctrl-C during the first `up`'s build leaves the repository marked: the next `up` builds
    again (finishing what is missing) instead of serving a half-built repository."""
    from batchline import demo_models, mesh

    repo = tmp_path / "repository"

    def cut_short(path, **_):
        (path / "mlp" / "1").mkdir(parents=True)  # half of a model: no config.toml
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_models, "build_repository", cut_short)
    with pytest.raises(KeyboardInterrupt):
        mesh.build_demo(repo)
    assert (repo / mesh.BUILDING).exists()
    built: list = []
    monkeypatch.setattr(demo_models, "build_repository", lambda path, **_: built.append(path))
    mesh.build_demo(repo)
    assert built == [repo] and not (repo / mesh.BUILDING).exists()


def test_a_lone_gateway_on_a_port_chosen_at_start_comes_back_on_it(mlp_repository):
    """`--gateway-port 0` with one gateway: the port it bound is the mesh's address, printed at up;
    restarted, the gateway binds that port again rather than another one."""
    up = Up("--model-repository", str(mlp_repository), "--gateway-port", "0", "--metrics-port", "0",
            "--http-port", "-1")
    try:
        ready = up.wait_for(r"listening on (\S+);.*restarts counted at http://\S+:(\d+)/metrics", STARTUP_S)
        address, metrics_port = ready.group(1), int(ready.group(2))
        os.kill(up.pid_of("gateway-0"), signal.SIGKILL)
        poll(lambda: _restarts(metrics_port).get("gateway-0") == 1, RESTART_S, "gateway-0 restarted",
             check=up.check_alive)
        client = tc.InferenceServerClient(address)
        poll(lambda: _ready(client), RESTART_S, f"the restarted gateway to serve {address} again", check=up.check_alive)
        client.close()
    finally:
        assert up.stop() == 0, up.output[-3000:]


def _ready(client: tc.InferenceServerClient) -> bool:
    try:
        return client.is_server_ready()
    except tc.InferenceServerException:
        return False
