"""The autoscaler's policy (batchline/autoscale.py): pure, with explicit times and demands."""
from __future__ import annotations

import pytest

from batchline.autoscale import ScalePolicy, parse_bounds
from batchline.protocol import internal_pb2 as pb


def demand(by_forecast: float, by_backlog: float = 0.0) -> pb.MeshDemand:
    return pb.MeshDemand(models=[pb.MeshDemand.Model(name="m", version="1", by_forecast=by_forecast,
                                                     by_backlog=by_backlog, forecast_rate=10, capacity=5)])


def test_bounds_parse_and_say_what_is_wrong():
    assert parse_bounds("1:4") == (1, 4)
    assert parse_bounds("3") == (3, 3)
    for bad in ("0:2", "3:2", "a:b", ""):
        with pytest.raises(ValueError, match="--autoscale"):
            parse_bounds(bad)


def test_more_wanted_starts_executors_at_once_up_to_max():
    p = ScalePolicy(1, 4)
    d = p.decide(0.0, 1, demand(2.3))
    assert (d.target, d.direction, d.reason) == (3, "up", "forecast")
    assert "2.30 executors wanted" in d.why
    assert p.decide(0.0, 1, demand(9.0)).target == 4


def test_the_backlog_names_itself_as_the_reason():
    assert ScalePolicy(1, 4).decide(0.0, 1, demand(0.5, by_backlog=2.5)).reason == "backlog"


def test_fewer_wanted_stops_only_after_a_whole_cool_down():
    p = ScalePolicy(1, 4, cool_down_s=30)
    assert p.decide(0.0, 3, demand(0.5)) is None
    assert p.decide(29.0, 3, demand(0.5)) is None
    d = p.decide(30.0, 3, demand(0.5))
    assert (d.target, d.direction, d.reason) == (1, "down", "cool_down")


def test_a_rise_during_the_cool_down_restarts_it():
    p = ScalePolicy(1, 4, cool_down_s=30)
    p.decide(0.0, 3, demand(0.5))
    assert p.decide(20.0, 3, demand(2.9)) is None  # 3 are needed again
    assert p.decide(40.0, 3, demand(0.5)) is None  # a new cool-down began at 40
    assert p.decide(70.0, 3, demand(0.5)).target == 1


def test_it_stops_no_more_than_the_cool_downs_peak_leaves_spare():
    p = ScalePolicy(1, 4, cool_down_s=30)
    p.decide(0.0, 4, demand(0.5))
    p.decide(10.0, 4, demand(2.5))  # 2.5 + the hysteresis fits 3, not 4: still cooling down
    assert p.decide(30.0, 4, demand(0.5)).target == 3


def test_hysteresis_keeps_an_executor_a_demand_at_the_boundary_needs():
    p = ScalePolicy(1, 4, cool_down_s=0)
    assert p.decide(0.0, 2, demand(0.9)) is None  # 0.9 + 0.2 does not fit in one
    assert p.decide(1.0, 2, demand(0.7)).target == 1


def test_no_published_demand_keeps_what_runs_within_the_bounds():
    p = ScalePolicy(2, 4)
    assert p.decide(0.0, 3, None) is None
    d = p.decide(0.0, 1, None)
    assert (d.target, d.direction, d.reason) == (2, "up", "bounds")
    assert p.decide(0.0, 5, demand(9)).target == 4


def test_a_surge_the_queue_shows_is_named_in_the_decision_and_in_status():
    from batchline import status

    surge = pb.MeshDemand(executors_wanted=5, models=[pb.MeshDemand.Model(
        name="m", version="1", by_forecast=4.5, forecast_rate=100, queued_rate=2000, capacity=888, budget_s=1.0)])
    d = ScalePolicy(1, 8).decide(0.0, 1, surge)
    assert (d.target, d.reason) == (5, "queue") and "2000.0/s arriving now by its queue" in d.why
    text = status.render({"leader": "s", "executors": [], "gateways": [], "queues": [],
                          "demand": status.demand(surge.SerializeToString())})
    assert "100.0/s forecast, 2000.0/s by its queue" in text
    # A queue that shows less than the forecast is not mentioned.
    calm = pb.MeshDemand(models=[pb.MeshDemand.Model(name="m", version="1", forecast_rate=100, queued_rate=50)])
    assert "by its queue" not in ScalePolicy(1, 8).decide(0.0, 0, calm).why


def ahead(by_forecast: float, arriving: float, horizon_s: float = 5.0, by_backlog: float = 0.0) -> pb.MeshDemand:
    """A demand whose forecast asks for `by_forecast` executors while the rate arriving now fills
    `arriving` of them (capacity 100/s each), with the forecast looking `horizon_s` ahead."""
    return pb.MeshDemand(horizon_s=horizon_s, models=[pb.MeshDemand.Model(
        name="m", version="1", by_forecast=by_forecast, by_backlog=by_backlog, forecast_rate=by_forecast * 100,
        arrival_rate=arriving * 100, capacity=100)])


def test_while_the_forecast_has_foreseen_every_rise_the_cool_down_is_its_horizon():
    p = ScalePolicy(1, 4, cool_down_s=30)
    assert p.decide(0.0, 1, ahead(2.5, arriving=0.9)).target == 3  # asked for before the rate came
    assert p.decide(10.0, 3, ahead(0.5, arriving=0.5)) is None
    d = p.decide(15.0, 3, ahead(0.5, arriving=0.5))
    assert (d.target, d.reason) == (1, "cool_down") and "wanted for 5 s" in d.why
    # With no horizon published the whole cool-down holds.
    q = ScalePolicy(1, 4, cool_down_s=30)
    q.decide(0.0, 3, ahead(0.5, arriving=0.5, horizon_s=0))
    assert q.decide(29.0, 3, ahead(0.5, arriving=0.5, horizon_s=0)) is None


@pytest.mark.parametrize("surprise", [ahead(2.5, arriving=2.2), ahead(0.5, arriving=0.5, by_backlog=2.5)],
                         ids=["the rate came before its executors", "a backlog asked"])
def test_after_a_rise_the_forecast_did_not_ask_for_the_whole_cool_down_holds_for_ten(surprise):
    p = ScalePolicy(1, 4, cool_down_s=30)
    assert p.decide(0.0, 1, surprise).target == 3
    assert p.decide(10.0, 3, ahead(0.5, arriving=0.5)) is None
    assert p.decide(39.0, 3, ahead(0.5, arriving=0.5)) is None  # the horizon (5 s) long past
    assert p.decide(40.0, 3, ahead(0.5, arriving=0.5)).target == 1
    # Ten cool-downs after the surprise the forecast's horizon is the cool-down again.
    assert p.decide(300.0, 1, ahead(2.5, arriving=0.9)).target == 3
    p.decide(310.0, 3, ahead(0.5, arriving=0.5))
    assert p.decide(315.0, 3, ahead(0.5, arriving=0.5)).target == 1
