"""Settings shared by the services, and a command line built from them.

Each service has one pydantic-settings class with its own environment
prefix (BATCHLINE_GATEWAY_, BATCHLINE_SCHEDULER_, BATCHLINE_EXECUTOR_); every
field is documented, and `--help` is generated from those descriptions, so
the flags, the environment variables and the docs cannot drift apart.
Precedence: command-line flag > environment variable > default.
"""
from __future__ import annotations

import argparse
from typing import Any, Literal, Sequence, TypeVar, get_args, get_origin

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)

# Triton's --model-control-mode: none (what is in the repository at start, fixed), poll (the
# repository re-scanned while serving), explicit (RepositoryModelLoad / RepositoryModelUnload).
ModelControlMode = Literal["none", "poll", "explicit"]


class CommonSettings(BaseSettings):
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis server holding the queues, payloads and registry: redis://, unix:// or, over TLS, "
        "rediss://...?ssl_ca_certs=CA.pem (with &ssl_certfile=...&ssl_keyfile=... for a client certificate); "
        "user:password@ (or :password@) before the host to authenticate. A Redis that refuses the credentials "
        "or whose certificate cannot be verified stops the service at start, in one line. Behind Sentinel: "
        "redis+sentinel://[user:password@]HOST:PORT[,HOST:PORT...]/MASTER[/DB] (rediss+sentinel:// for TLS; "
        "sentinel_password=... in the query when the sentinels require one); the service follows failovers, "
        "and sentinels that know no such master stop it at start. A Redis Cluster: "
        "redis+cluster://[user:password@]HOST:PORT[,HOST:PORT...] (rediss+cluster:// for TLS), any of its nodes; "
        "a cluster with a hash slot no node serves stops the service at start.",
    )
    host: str = Field("127.0.0.1", description="Interface the gRPC server binds to.")
    log_level: str = Field("INFO", description="Python logging level: DEBUG, INFO, WARNING or ERROR.")
    log_format: Literal["text", "json"] = Field(
        "text", description="text: one line for a terminal; json: one JSON object a line, with the service and, "
        "when there is one, the request id, the batch id and the trace id.")
    redis_timeout_s: float = Field(
        1.0, description="Seconds a Redis command may take before the service treats Redis as unavailable."
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_settings(cls: type[S], argv: Sequence[str] | None, prog: str, description: str) -> S:
    """Build `cls` from the environment, overridden by command-line flags."""
    env_prefix = cls.model_config.get("env_prefix", "")
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=f"Every flag can also be set as an environment variable {env_prefix}<NAME> "
               f"(e.g. {env_prefix}REDIS_URL).",
    )
    for name, info in cls.model_fields.items():
        annotation = info.annotation
        kwargs: dict[str, Any] = {"dest": name, "default": None}
        default = info.get_default(call_default_factory=True)
        help_text = f"{info.description} (default: {default!r})"
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(annotation) is Literal:
            kwargs["choices"] = get_args(annotation)
            kwargs["type"] = type(get_args(annotation)[0])
        elif get_origin(annotation) in (list, tuple):
            inner = get_args(annotation)[0] if get_args(annotation) else str
            kwargs["type"] = inner
            kwargs["nargs"] = "*"
            kwargs["action"] = "extend"  # --flag a b and --flag a --flag b alike
        elif annotation in (int, float, str):
            kwargs["type"] = annotation
        else:
            # Optionals: take the first concrete type.
            concrete = [a for a in get_args(annotation) if a is not type(None)]
            kwargs["type"] = concrete[0] if concrete else str
        parser.add_argument(_flag(name), help=help_text, **kwargs)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return cls(**overrides)
    except ValidationError as exc:
        # A value argparse took but the settings refuse (a flag's or an environment variable's):
        # say which, as argparse does, rather than with a traceback.
        parser.error("; ".join(
            f"{_flag(str(e['loc'][0]))} ({env_prefix}{str(e['loc'][0]).upper()}): {e['msg']}" if e["loc"] else e["msg"]
            for e in exc.errors()
        ))
