"""When a missing heartbeat is read as a death (batchline/heartbeats.py), on an explicit clock."""
from __future__ import annotations

from batchline.heartbeats import GRACE_S, HeartbeatTrust


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_heartbeats_tell_until_redis_is_in_trouble_and_again_a_grace_after_its_last_sign():
    clock = _Clock()
    trust = HeartbeatTrust(clock)
    assert trust.heartbeats_tell()
    trust.redis_trouble()
    clock.now += GRACE_S - 0.5
    assert not trust.heartbeats_tell()
    trust.redis_trouble()  # another sign starts the grace again
    clock.now += GRACE_S - 0.5
    assert not trust.heartbeats_tell()
    clock.now += 1.0
    assert trust.heartbeats_tell()
