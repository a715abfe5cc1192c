"""The scheduler writes a Batch's members as the queue holds them (scheduler.dispatch.with_members):
the bytes parse to the Batch that holds those entries, in order."""
from batchline.protocol import internal_pb2 as pb
from scheduler.dispatch import with_members


def test_members_appended_as_queued_parse_to_the_batch():
    # Lengths on both sides of a varint's one-byte limit (127), and a large one.
    entries = [pb.QueueEntry(request_id="r" * n, gateway_id="g", rows=i + 1, deadline_us=2**60 + i,
                             enqueued_us=2**50, priority=1 + i % 3, length=i)
               for i, n in enumerate([1, 100, 126, 127, 128, 20_000])]
    batch = pb.Batch(batch_id="b", model_name="m", model_version="1", executor_id="e", dispatched_us=5,
                     reason="full", attempt=1, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    blob = with_members(batch, [e.SerializeToString() for e in entries])
    whole = pb.Batch()
    whole.CopyFrom(batch)
    whole.members.extend(entries)
    parsed = pb.Batch.FromString(blob)
    assert parsed == whole
    assert list(parsed.members) == entries
    assert parsed.SerializeToString() == whole.SerializeToString()


def test_no_members():
    batch = pb.Batch(batch_id="b", model_name="m")
    assert with_members(batch, []) == batch.SerializeToString()
