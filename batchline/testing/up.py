"""`batchline up` as a subprocess, its output collected line by line: for the tests of the command
itself (restarts, explicit model control) rather than of the services it runs."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

from batchline.testing.polling import poll

# How long `batchline up` may take to serve: Redis, then every service, each loading its models.
STARTUP_S = 120.0


class Up:
    """A `batchline up` process, its output collected line by line."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchline.cli", "up", "--log-level", "WARNING", *flags],
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
        return poll(lambda: re.search(pattern, self.output), timeout, f"`{pattern}` in the output of batchline up",
                    check=self.check_alive)

    def check_alive(self) -> None:
        if self.proc.poll() is not None and not re.search(r"stopping the mesh", self.output):
            raise AssertionError(f"batchline up exited with {self.proc.returncode}:\n{self.output}")

    def pid_of(self, service: str) -> int:
        """The pid of the service's latest start."""
        return int(re.findall(rf"(?:started|restarted) {service} \(pid (\d+)\)", self.output)[-1])

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        code = self.proc.wait(120)
        self.reader.join(10)
        return code
