"""The batching rule's settings as one value (batchline.planning.BatchingRule): built from a model's
config by the scheduler, carried to the gateways in the load view, and rebuilt there the same.

Pure: protobuf messages built in the test, no I/O.
"""
from __future__ import annotations

from batchline.planning import BatchingRule
from batchline.protocol import internal_pb2 as pb

TEXT = pb.ModelInfo(name="m", version="1", max_batch_size=8, preferred_batch_sizes=[4, 8], padded_inputs=["ids"])


def test_a_models_rule_takes_its_batch_sizes_from_its_config():
    rule = BatchingRule.of_model(TEXT)
    assert (rule.max_batch_size, rule.preferred_batch_sizes) == (8, (4, 8))
    assert rule.deadline_aware and not rule.length_aware
    assert (rule.over_share_rows, rule.join_lead) == (0, 0.0)


def test_length_aware_batching_needs_padded_inputs_and_the_deadline_aware_policy():
    assert BatchingRule.of_model(TEXT, length_aware=True).length_aware
    fixed = pb.ModelInfo(name="m", version="1", max_batch_size=8)
    assert not BatchingRule.of_model(fixed, length_aware=True).length_aware
    fifo = BatchingRule.of_model(TEXT, deadline_aware=False, length_aware=True)
    assert not fifo.deadline_aware and not fifo.length_aware


def test_batches_evened_over_lanes_need_the_deadline_aware_policy():
    assert BatchingRule.of_model(TEXT, even_lanes=True).even_lanes
    assert not BatchingRule.of_model(TEXT).even_lanes
    assert not BatchingRule.of_model(TEXT, deadline_aware=False, even_lanes=True).even_lanes


def test_a_gateway_rebuilds_from_the_load_view_the_rule_the_scheduler_played_by():
    played_by = BatchingRule(8, (4, 8), over_share_rows=2, length_aware=True, even_lanes=True)
    view = pb.ModelLoad(**played_by.load_fields())
    assert BatchingRule.of_load(TEXT, view) == played_by
    # An arriving request joins no batch leaving within the gateway's join lead.
    assert BatchingRule.of_load(TEXT, view, join_lead=0.005).join_lead == 0.005
    # A view without the rule's fields: no over-share cap, the head's prefix.
    plain = BatchingRule.of_load(TEXT, pb.ModelLoad())
    assert (plain.over_share_rows, plain.length_aware, plain.even_lanes) == (0, False, False)
