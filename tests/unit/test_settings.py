"""Settings: environment variables with the service's prefix, overridden by flags."""
from __future__ import annotations

import pytest

from batchline.settings import parse_settings
from executor.settings import ExecutorSettings
from gateway.settings import GatewaySettings
from scheduler.settings import SchedulerSettings


def test_environment_then_flags(monkeypatch):
    monkeypatch.setenv("BATCHLINE_GATEWAY_PORT", "9001")
    monkeypatch.setenv("BATCHLINE_GATEWAY_REDIS_URL", "redis://example:6380/2")
    s = parse_settings(GatewaySettings, [], prog="gw", description="")
    assert s.port == 9001 and s.redis_url == "redis://example:6380/2"
    s = parse_settings(GatewaySettings, ["--port", "0", "--max-message-bytes", "1024"], prog="gw", description="")
    assert s.port == 0 and s.max_message_bytes == 1024 and s.redis_url == "redis://example:6380/2"


def test_prefixes_do_not_leak_between_services(monkeypatch):
    monkeypatch.setenv("BATCHLINE_SCHEDULER_PORT", "7000")
    assert SchedulerSettings().port == 7000
    assert GatewaySettings().port == 8001


def test_lists_and_booleans_from_flags():
    s = parse_settings(ExecutorSettings, ["--models", "mlp", "minilm", "--no-warmup"], prog="ex", description="")
    assert s.models == ["mlp", "minilm"] and s.warmup is False


def test_every_setting_is_documented():
    for cls in (GatewaySettings, SchedulerSettings, ExecutorSettings):
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"


def test_bad_flag_value_is_refused():
    with pytest.raises(SystemExit):
        parse_settings(GatewaySettings, ["--port", "eighty"], prog="gw", description="")


def test_an_executor_id_that_could_clash_with_a_lane_is_refused():
    with pytest.raises(SystemExit):
        parse_settings(ExecutorSettings, ["--executor-id", "gpu-0#1"], prog="ex", description="")
    assert parse_settings(ExecutorSettings, ["--executor-id", "gpu-0"], prog="ex",
                          description="").executor_id == "gpu-0"


@pytest.mark.parametrize("flags", [["--heartbeat-ttl-s", "0"], ["--heartbeat-interval-s", "0"],
                                   ["--heartbeat-ttl-s", "1", "--heartbeat-interval-s", "1"]])
def test_an_executor_heartbeat_that_would_lapse_between_beats_is_refused(flags, capsys):
    # A ttl within one interval makes a live executor look dead, and its batches run twice.
    with pytest.raises(SystemExit):
        parse_settings(ExecutorSettings, flags, prog="ex", description="")
    assert parse_settings(ExecutorSettings, ["--heartbeat-ttl-s", "1.5", "--heartbeat-interval-s", "0.5"], prog="ex",
                          description="").heartbeat_ttl_s == 1.5
