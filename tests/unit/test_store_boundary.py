"""Redis is reached through the stores of batchline/contract/ only: no module of the services or
of batchline outside contract/ calls a Redis command on a client or a pipeline. An AST scan, so
that a command added in a service fails here rather than in a reviewer's search."""
from __future__ import annotations

import ast

from batchline.testing.checkout import ROOT

SCANNED = ("gateway", "scheduler", "executor", "batchline")
# The contract owns the commands; the test helpers may inspect Redis directly.
ALLOWED = ("batchline/contract/", "batchline/testing/")
# The connection layer: reaching a Redis and telling what kind it is (plain, Sentinel, Cluster)
# before any role's store is made on the client it returns.
CONNECTING = {"batchline/redis_client.py", "batchline/sentinel.py", "batchline/cluster.py"}

COMMANDS = frozenset("""
append blmove blmpop blpop brpop bzpopmin dbsize decr decrby delete eval evalsha execute_command exists
expire expireat get getdel getex hdel hexists hget hgetall hincrby hkeys hlen hmget hset hsetnx hvals incr
incrby info keys lindex linsert llen lmove lpop lpush lrange lrem lset ltrim mget mget_nonatomic mset
persist pexpire pexpireat ping pipeline psetex pttl publish rpop rpush sadd scan scan_iter scard script_load
set setex setnx sismember smembers smismember spop srandmember srem ttl type unlink watch zadd zcard zcount
zincrby zmscore zpopmin zrange zrangebyscore zrank zrem zremrangebyscore zrevrange zscore
""".split())
# The contract's functions that take a client: a store calls them, with its own.
CLIENT_CALLS = frozenset({"enqueue", "dispatch", "batch_done", "take_lease", "release_lease", "take_token",
                          "get_many", "shed", "count", "report", "push_with_ttl", "Rounds"})
# Names a Redis client or pipeline goes by here; `dict.get` and the like on other names are not commands.
CLIENT_NAMES = ("redis", "pipe", "client", "blocking", "conn")


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    if isinstance(node, ast.BoolOp):
        return " ".join(_name(v) for v in node.values)
    return ""


def redis_commands(source: str) -> list[tuple[int, str]]:
    """(line, receiver.command) of each call of a Redis command on a client or a pipeline, and of
    each contract function that takes a client."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver, attr = _name(node.func.value), node.func.attr
        if attr in COMMANDS and any(n in receiver.lower() for n in CLIENT_NAMES) or \
                receiver == "contract" and attr in CLIENT_CALLS:
            found.append((node.lineno, f"{receiver}.{attr}"))
    return sorted(found)


def test_the_scan_finds_commands_on_clients_and_pipelines_only():
    source = """
async def f(self, redis, store, options):
    await self.redis.get("k")
    async with redis.pipeline() as pipe:
        pipe.zadd("q", {})
    await self.blocking.blpop(["w"])
    options.get("x")
    await store.beat("g", "a", 1)
    await contract.take_token(self.redis, "t", 1.0, 1.0)
"""
    assert [c for _, c in redis_commands(source)] == [
        "redis.get", "redis.pipeline", "pipe.zadd", "blocking.blpop", "contract.take_token"]


def test_no_module_outside_the_contract_issues_redis_commands():
    offenders = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED) or rel in CONNECTING or rel.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            found = redis_commands(path.read_text())
            if found:
                offenders[rel] = found
    assert not offenders, ("Redis commands outside batchline/contract/ (give the role's store a method for "
                           f"them): {offenders}")
