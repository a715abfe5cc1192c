"""A gateway's heartbeat: its address under its id while it lives (executors skip the requests of
a gateway without one), and its entry in the set of live gateways, from which each gateway learns
how many share the refusals it spaces (gateway/admission.py: retry_spacing_s). Written by
GatewayStore.beat (batchline/contract/gateway_store.py)."""
from __future__ import annotations

# Heartbeat TTL, in heartbeat intervals: a gateway is gone after missing this many beats.
TTL_BEATS = 3


def heartbeat_ttl_ms(interval_s: float) -> int:
    return int(interval_s * 1000 * TTL_BEATS)
