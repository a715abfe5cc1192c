"""The Redis contract: key layout, message schema, expiry, and the calls that write them.

Redis is the only state the services share, so everything a restarted
service needs lives here, and every key expires so that nothing leaks when
a service dies (the TTLs bound how long anything can outlive its use).
`keys` holds the layout (its docstring is the table), `scripts` the Lua
scripts, `calls` the functions that run them from typed arguments, `slots` what differs on a
Redis Cluster. Each role's store (`gateway_store`, `scheduler_store`, `executor_store`,
`recovery`, `admin_store`, on `store`) owns every command that role issues: the services hold a
store, never a client. `memory` has in-memory stores for unit tests.
"""
from batchline.contract.calls import (  # noqa: F401
    Abandoned,
    FinishedBatch,
    QueueWrite,
    batch_done,
    count,
    dispatch,
    enqueue,
    push_with_ttl,
    release_lease,
    report,
    shed,
    take_lease,
    take_token,
)
from batchline.contract.keys import *  # noqa: F403
from batchline.contract.slots import Rounds, get_many, on_cluster  # noqa: F401
from batchline.contract.scripts import (  # noqa: F401
    ANNOUNCE_LUA,
    HAND_OVER_LUA,
    REPORT_LUA,
    BATCH_DONE_LUA,
    COUNT_WITH_TTL_LUA,
    DISPATCH_LUA,
    ENQUEUE_LUA,
    LEASE_LUA,
    PUSH_WITH_TTL_LUA,
    RELEASE_LUA,
    TAKE_TOKEN_LUA,
)
