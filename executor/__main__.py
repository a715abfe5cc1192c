"""python -m executor: run one executor."""
from __future__ import annotations

import time

# Before the imports below (ONNX Runtime's among them): they are part of an executor's start-to-serving time.
STARTED_S = time.time()

import os  # noqa: E402
import sys  # noqa: E402

from batchline import logs  # noqa: E402
from batchline.lifecycle import run_service  # noqa: E402
from batchline.settings import parse_settings  # noqa: E402
from executor.app import ExecutorApp  # noqa: E402
from executor.settings import ExecutorSettings  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(
        ExecutorSettings,
        argv,
        prog="python -m executor",
        description="batchline executor: loads a model repository into ONNX Runtime "
        "(TensorRT -> CUDA -> CPU, whichever the host has) and runs the batches the scheduler dispatches.",
    )
    logs.configure(settings.log_level, "executor", settings.log_format)
    if settings.nice:
        os.nice(settings.nice)  # before ONNX Runtime starts its threads, which inherit it

    async def start():
        app = await ExecutorApp(settings, STARTED_S).start()
        return app.stop

    run_service("executor", start, settings.redis_url, settings.redis_timeout_s)


if __name__ == "__main__":
    main(sys.argv[1:])
