"""Which members of a taken batch someone still waits for, read from what the batch's fetch
returned: each member's payload and each of its gateways' heartbeat.

A payload that is gone was answered elsewhere, cancelled or timed out; a gateway whose heartbeat is
gone died with its clients' calls (when the heartbeats can be read so: batchline/heartbeats.py).
Nobody waits for either, so neither is read or run. Both are counted
(`batchline_requests_dropped_total`), and a dead gateway's are logged at debug level: dropped
quietly, they would leave no trace of why a queued request was never run."""
from __future__ import annotations

import logging
from collections.abc import Sequence

from batchline import metrics
from batchline.heartbeats import HeartbeatTrust
from batchline.protocol import internal_pb2 as pb

log = logging.getLogger(__name__)


def awaited(batch: pb.Batch, entries: Sequence[pb.QueueEntry], payloads: Sequence[bytes | None],
            gateways: Sequence[str], beats: Sequence[object], trust: HeartbeatTrust) -> list[int]:
    """The indices in `entries` of the members still awaited. `payloads` are the members' (None
    where gone), `beats` the heartbeats of the sorted distinct `gateways` (None where gone)."""
    gone = {g for g, beat in zip(gateways, beats) if beat is None} if trust.heartbeats_tell() else set()
    kept = [i for i, (entry, blob) in enumerate(zip(entries, payloads))
            if blob is not None and entry.gateway_id not in gone]
    if len(kept) < len(entries):  # (rare: counted apart, off the common path)
        unawaited = sum(blob is None for blob in payloads)
        orphans = len(entries) - len(kept) - unawaited
        for reason, count in (("payload_gone", unawaited), ("gateway_gone", orphans)):
            if count:
                metrics.REQUESTS_DROPPED.labels(batch.model_name, batch.model_version, reason).inc(count)
        if orphans:
            log.debug("batch %s: %d request(s) of model '%s' version '%s' dropped unread: gateway(s) %s gone "
                      "(no heartbeat)", batch.batch_id, orphans, batch.model_name, batch.model_version,
                      ", ".join(sorted(gone)))
    return kept
