"""`batchline up` as a user runs it: a real subprocess tree, served to a stock client, stopped by Ctrl-C."""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading

import numpy as np
import psutil
import pytest
import redis
import tritonclient.grpc as tc

from batchline import contract
from batchline.mesh import executors_up
from batchline.embedded_redis import EmbeddedRedis
from batchline.testing.polling import MeshError, poll

IN_FLIGHT = 96


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent may not have reaped it yet).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The processes of `pids` still alive after waiting up to `timeout` for all to end."""
    try:
        poll(lambda: not any(_pid_alive(p) for p in pids), timeout, "the processes to end", interval=0.1)
    except MeshError:
        pass
    return [p for p in pids if _pid_alive(p)]


REDIS_PASSWORD = "pw-of-the-test"


def test_up_serves_and_ctrl_c_stops_everything(model_repository):
    # In a process group of its own, so that the Ctrl-C below reaches every process in
    # it the way a terminal's does.
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchline.cli", "up", "--model-repository", str(model_repository),
         "--gateway-port", "0", "--metrics-port", "0", "--http-port", "-1", "--executors", "2",
         "--log-level", "WARNING", "--redis-password", REDIS_PASSWORD],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    ready = threading.Event()
    address: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"listening on (\S+);", line)
            if m:
                address.append(m.group(1))
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(120), "".join(lines)
        client = tc.InferenceServerClient(address[0])
        assert client.is_server_ready()
        x = np.zeros((1, 32), dtype=np.float32)
        inp = tc.InferInput("features", [1, 32], "FP32")
        inp.set_data_from_numpy(x)
        assert client.infer("mlp", [inp]).as_numpy("probability").shape == (1, 1)
        # "up" means every executor asked for, not just as many lanes (minilm runs two per executor).
        # The password is printed as ***, never in the clear.
        redis_url = re.search(r"started Redis \S+ at (\S+) ", "".join(lines)).group(1)
        assert REDIS_PASSWORD not in "".join(lines) and ":***@" in redis_url
        redis_url = redis_url.replace("***", REDIS_PASSWORD)
        with redis.Redis.from_url(redis_url) as r:
            registered = {e.decode().split("#")[0] for e in r.smembers(contract.EXECUTORS)}
        assert registered == {"executor-0", "executor-1"}
        redis_pids = [c.pid for c in psutil.Process(proc.pid).children() if "redis-server" in c.name()]
        assert len(redis_pids) == 1
        # Nor on any process's command line, which every user of the host may read (ps).
        for child in psutil.Process(proc.pid).children(recursive=True):
            assert REDIS_PASSWORD not in " ".join(child.cmdline()), child.cmdline()
        # Requests in flight when Ctrl-C comes are answered: the gateway drains while the scheduler
        # and the executors still run. 128-token minilm rows keep the four lanes busy for a second or two.
        ids = np.random.default_rng(0).integers(1000, 29000, size=(1, 128), dtype=np.int64)
        answers: list = []
        done = threading.Event()

        def on_answer(result, error):
            answers.append(error or result)
            if len(answers) == IN_FLIGHT:
                done.set()

        for _ in range(IN_FLIGHT):
            inputs = [tc.InferInput("input_ids", [1, 128], "INT64"), tc.InferInput("attention_mask", [1, 128], "INT64")]
            inputs[0].set_data_from_numpy(ids)
            inputs[1].set_data_from_numpy(np.ones_like(ids))
            # A minute's budget: this is about draining, not latency (5 s, the default, is short on a busy host).
            client.async_infer("minilm", inputs, on_answer, client_timeout=60)
        # Admitted: each is answered already or has its payload in Redis until it is.
        with redis.Redis.from_url(redis_url) as r:
            poll(lambda: len(answers)
                 + sum(1 for _ in r.scan_iter(contract.payload(("*", "*"), "*"), count=1000)) >= IN_FLIGHT,
                 30, f"all {IN_FLIGHT} sent to be answered or queued", interval=0.01)
        assert len(answers) < IN_FLIGHT  # most still wait for a lane
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(60)
        reader.join(10)
    output = "".join(lines)
    assert done.wait(30), output
    client.close()
    errors = [a for a in answers if isinstance(a, Exception)]
    assert not errors, ([str(e) for e in errors[:3]], output)
    assert all(a.as_numpy("sentence_embedding").shape == (1, 384) for a in answers)
    assert code == 0, output
    assert "batchline: stopped" in output
    assert "the services use unix://" in output  # they served the requests above through Redis's socket
    # ... whose directory goes with it: nothing is left in the temp directory.
    assert not os.path.exists(re.search(r"the services use unix://:\*\*\*@(\S+)/redis\.sock", output).group(1))
    # Redis, in a session of its own, outlived the services' drain: they stopped without losing it.
    assert "Redis failed" not in output and "Redis is unreachable" not in output, output
    pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", output)]
    assert len(pids) == 4, output  # two executors, scheduler, gateway
    assert not _wait_dead(pids + redis_pids), output


def test_services_go_with_a_killed_up(model_repository):
    # The services run in sessions of their own (a Ctrl-C reaches only `up`, which stops them in
    # order), so nothing else would take them down if `up` itself were SIGKILLed.
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchline.cli", "up", "--model-repository", str(model_repository),
         "--gateway-port", "0", "--metrics-port", "-1", "--http-port", "-1", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "listening on" in line:
            break
    output = "".join(lines)
    pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", output)]
    assert len(pids) == 3, output
    children = [c.pid for c in psutil.Process(proc.pid).children()]
    proc.kill()
    proc.wait(10)
    proc.stdout.close()
    assert not _wait_dead(pids + children, timeout=30), output


def test_up_waits_for_every_executor_not_for_as_many_lanes():
    assert not executors_up(["executor-0", "executor-0#1"], 2)  # one executor with two lanes
    assert executors_up(["executor-0", "executor-0#1", "executor-1"], 2)
    assert executors_up(["executor-1", "executor-0"], 2)
    assert not executors_up([], 1)


def test_embedded_redis_of_a_killed_owner_goes_with_it():
    owner = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom batchline.embedded_redis import EmbeddedRedis\n"
         "r = EmbeddedRedis(die_with_parent=True).start()\nprint(r.proc.pid, flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )
    redis_pid = int(owner.stdout.readline())
    assert _pid_alive(redis_pid)
    directory = pathlib.Path(psutil.Process(redis_pid).cwd())
    assert directory.name.startswith(f"batchline-redis-{owner.pid}-")
    owner.kill()
    owner.wait(10)
    owner.stdout.close()
    assert not _wait_dead([redis_pid]), "redis-server outlived its SIGKILLed owner"
    # Its directory is left (a killed process cleans nothing up): the next embedded Redis removes it.
    assert directory.exists()
    EmbeddedRedis().close()
    assert not directory.exists()



def test_an_embedded_redis_that_cannot_start_says_why_even_with_its_port_answered_by_another():
    with EmbeddedRedis() as first:
        second = EmbeddedRedis(port=first.port)
        with pytest.raises(RuntimeError) as info:
            second.start()  # the first server answers on that port: only the second's own socket tells
        assert not os.path.exists(second.dir)  # a server that failed to start leaves nothing behind
        second.close()
    message = str(info.value)
    assert message.startswith("redis-server exited with 1: ") and "\n" not in message
    assert f"127.0.0.1:{first.port}" in message and "Address already in use" in message

def test_up_whose_redis_cannot_start_says_why_in_one_line_and_leaves_nothing_behind(model_repository, tmp_path):
    # A redis-server that fails the way a real one does on a bad configuration.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").write_text("#!/bin/sh\necho 'FATAL CONFIG FILE ERROR: Bad directive' >&2\nexit 1\n")
    (bin_dir / "redis-server").chmod(0o755)
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchline.cli", "up", "--model-repository", str(model_repository),
         "--gateway-port", "0", "--metrics-port", "-1", "--http-port", "-1"],
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stdout + stderr
    assert stderr == ("batchline: cannot start Redis: redis-server exited with 1: "
                      "FATAL CONFIG FILE ERROR: Bad directive\n")
    assert "started" not in stdout  # no service was started without its Redis
    assert not list(pathlib.Path(tempfile.gettempdir()).glob(f"batchline-redis-{proc.pid}-*"))


def test_service_help_texts_list_their_settings():
    for module, flag in (("gateway", "--max-message-bytes"), ("scheduler", "--max-batches-per-executor"),
                         ("executor", "--model-repository")):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert flag in out.stdout and "--redis-url" in out.stdout
        assert "BATCHLINE_" in out.stdout
