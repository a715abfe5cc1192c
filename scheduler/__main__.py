"""python -m scheduler: run the scheduler."""
from __future__ import annotations

import sys

from batchline import logs
from batchline.lifecycle import run_service
from batchline.settings import parse_settings
from scheduler.app import SchedulerApp
from scheduler.settings import SchedulerSettings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(
        SchedulerSettings,
        argv,
        prog="python -m scheduler",
        description="batchline scheduler: watches the Redis queues, forms dynamic batches "
        "(earliest deadline first within a priority, max_batch_size, max_queue_delay while company is expected, "
        "deadlines) and dispatches them to the executor holding the model that is predicted free first "
        "(of idle ones, the one "
        "idle longest).",
    )
    logs.configure(settings.log_level, "scheduler", settings.log_format)

    async def start():
        app = await SchedulerApp(settings).start()
        return app.stop

    run_service("scheduler", start, settings.redis_url, settings.redis_timeout_s)


if __name__ == "__main__":
    main(sys.argv[1:])
