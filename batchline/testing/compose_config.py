"""What `docker compose -f A -f B --profile P config` does to the compose files, without Docker.

Each file is parsed, interpolated from the environment (${VAR}, ${VAR:-default}, ...) and
validated against the Compose Specification's JSON schema (the copy check-jsonschema ships,
Apache-2.0). The files are merged in order as Compose merges them: mappings key by key, lists
appended to, but for those a later file replaces (command, entrypoint, a healthcheck's test,
profiles). The services of inactive profiles are dropped. Then come the consistency checks Compose
makes on the result: what services depend on, and the volumes, networks, secrets and configs they
name, exist; each service has an image or a build whose context exists; durations and port
mappings parse. A problem raises ComposeError, naming the file and where in it. `extends` and
`include` are not resolved here: a file that uses them is refused, so that nothing goes unchecked.
"""
from __future__ import annotations

import copy
import importlib.resources
import json
import os
import pathlib
import re
from typing import Iterable, Mapping

import jsonschema
import yaml


class ComposeError(ValueError):
    """The files are not a valid Compose project: the message says where and why."""


def _schema_validator() -> jsonschema.protocols.Validator:
    text = (importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
    schema = json.loads(text)
    return jsonschema.validators.validator_for(schema)(schema)


_VALIDATOR = _schema_validator()

# ${NAME}, ${NAME:-default} and the like; $NAME; $$ for a literal $.
_DOLLAR = re.compile(r"\$(?:(?P<escaped>\$)|(?P<named>[_a-zA-Z][_a-zA-Z0-9]*)|\{(?P<braced>[^{}]*)\}|)")
_BRACED = re.compile(r"(?P<name>[_a-zA-Z][_a-zA-Z0-9]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", re.S)
# Go's time.ParseDuration, which Compose uses.
_DURATION = re.compile(r"0|[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+")
# The short port syntax: [[IP:][HOST[-HOST]]:]CONTAINER[-CONTAINER][/PROTOCOL].
_PORT = re.compile(r"(?:(?:(?P<ip>\[[0-9a-fA-F:.]+\]|[0-9.]+):)?(?P<host>\d*(?:-\d+)?):)?"
                   r"(?P<container>\d+(?:-\d+)?)(?:/(?P<protocol>tcp|udp|sctp))?")
# Compose replaces these lists whole when a later file sets them; it appends to every other list.
_REPLACED = {"command", "entrypoint", "test", "profiles"}
_DURATIONS = ("interval", "timeout", "start_period", "start_interval")


def config(*files: pathlib.Path, profiles: Iterable[str] = (), env: Mapping[str, str] | None = None) -> dict:
    """The project `files` make, merged in order, with the services `profiles` leave active."""
    env = os.environ if env is None else env
    project = pathlib.Path(files[0]).resolve().parent
    merged: dict = {}
    for path in files:
        merged = _merge(merged, _load(pathlib.Path(path), env))
    active = set(profiles)
    services = merged.get("services", {})
    merged["services"] = {name: s for name, s in services.items()
                          if not s.get("profiles") or active & set(s["profiles"])}
    _check(merged, services, project, ", ".join(pathlib.Path(f).name for f in files))
    return merged


def _load(path: pathlib.Path, env: Mapping[str, str]) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ComposeError(f"{path.name}: not valid YAML: {exc}") from None
    data = _interpolate(data, env, path.name, ())
    errors = sorted(_VALIDATOR.iter_errors(data), key=lambda e: list(e.absolute_path))
    # A property whose value fails also counts as "unevaluated" at its parent: that says nothing more.
    errors = [e for e in errors if e.validator != "unevaluatedProperties" or not any(
        o is not e and list(o.absolute_path)[:len(e.absolute_path)] == list(e.absolute_path) for o in errors)]
    if errors:
        raise ComposeError(f"{path.name}: " + "; ".join(
            f"{'.'.join(map(str, e.absolute_path)) or '(top level)'}: {e.message}" for e in errors))
    unresolved = ["include"] * ("include" in data) + [
        f"services.{name}.extends" for name, service in data.get("services", {}).items() if "extends" in service]
    if unresolved:
        raise ComposeError(f"{path.name}: {', '.join(unresolved)}: not resolved by batchline/testing/compose_config.py")
    for service in data.get("services", {}).values():
        _normalize(service)
    return data


def _interpolate(value, env: Mapping[str, str], file: str, where: tuple):
    if isinstance(value, dict):
        return {k: _interpolate(v, env, file, (*where, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env, file, (*where, i)) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value
    at = f"{file}: {'.'.join(map(str, where))}"

    def substitute(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        if m.group("named"):
            return env.get(m.group("named"), "")
        braced = _BRACED.fullmatch(m.group("braced") or "")
        if braced is None:
            raise ComposeError(f"{at}: invalid interpolation format in {value!r}")
        name, op, arg = braced.group("name", "op", "arg")
        unset = name not in env or ((op or "").startswith(":") and env[name] == "")
        if op and op[-1] == "?" and unset:
            raise ComposeError(f"{at}: required variable {name} is missing a value: {arg}")
        if op and op[-1] == "-":
            return arg if unset else env[name]
        if op and op[-1] == "+":
            return "" if unset else arg
        return env.get(name, "")

    return _DOLLAR.sub(substitute, value)


def _pairs(entries) -> dict:
    """A list of KEY=VALUE strings as Compose reads it: a mapping (KEY alone maps to None)."""
    if isinstance(entries, dict):
        return entries
    return {k: (v if sep else None) for k, sep, v in (e.partition("=") for e in entries)}


def _normalize(service: dict) -> None:
    """The long form of what a file may write short, so that files merge key by key."""
    if isinstance(service.get("build"), str):
        service["build"] = {"context": service["build"]}
    for key in ("environment", "labels"):
        if key in service:
            service[key] = _pairs(service[key])
    if isinstance(service.get("depends_on"), list):
        service["depends_on"] = {name: {"condition": "service_started", "required": True}
                                 for name in service["depends_on"]}


def _merge(base, override, key: str = ""):
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(override, list) and key not in _REPLACED:
        return base + [v for v in override if v not in base]
    return copy.deepcopy(override)


def _check(project: dict, declared_services: dict, directory: pathlib.Path, where: str) -> None:
    services = project["services"]
    for name, s in services.items():
        def fail(problem: str) -> None:
            raise ComposeError(f"{where}: service {name!r} {problem}")

        if "image" not in s and "build" not in s:
            fail("has neither an image nor a build context specified")
        context = s["build"].get("context", ".") if "build" in s else None
        if context and "://" not in context and not context.startswith("git@") and not (directory / context).is_dir():
            fail(f"builds from {context}, which is not a directory")
        for dep, how in s.get("depends_on", {}).items():
            if dep not in services and (dep in declared_services or how.get("required", True)):
                state = "a service of an inactive profile" if dep in declared_services else "an undefined service"
                fail(f"depends on {dep!r}, {state}")
        for kind in ("networks", "secrets", "configs"):
            for ref in s.get(kind, []):
                ref = ref if isinstance(ref, str) else ref.get("source", "")
                if ref not in project.get(kind, {}) and not (kind == "networks" and ref == "default"):
                    fail(f"refers to undefined {kind[:-1]} {ref!r}")
        for volume in s.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) and ":" in volume else (
                volume.get("source", "") if isinstance(volume, dict) and volume.get("type") == "volume" else "")
            if source and not source.startswith((".", "/", "~")) and source not in project.get("volumes", {}):
                fail(f"refers to undefined volume {source!r}")
        for key in _DURATIONS:
            if key in s.get("healthcheck", {}) and not _DURATION.fullmatch(str(s["healthcheck"][key])):
                fail(f"has an invalid healthcheck {key}: {s['healthcheck'][key]!r}")
        if "stop_grace_period" in s and not _DURATION.fullmatch(str(s["stop_grace_period"])):
            fail(f"has an invalid stop_grace_period: {s['stop_grace_period']!r}")
        for port in s.get("ports", []):
            if not isinstance(port, dict) and not _valid_port(str(port)):
                fail(f"has an invalid port mapping: {port!r}")
    _check_cycles(services, where)


def _valid_port(spec: str) -> bool:
    m = _PORT.fullmatch(spec)
    if m is None:
        return False
    for part in (m.group("host"), m.group("container")):
        if part:
            low, _, high = part.partition("-")
            if not (0 < int(low) <= int(high or low) <= 65_535):
                return False
    return True


def _check_cycles(services: dict, where: str) -> None:
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise ComposeError(f"{where}: dependency cycle: {' -> '.join((*path[path.index(name):], name))}")
        if name in done or name not in services:
            return
        for dep in services[name].get("depends_on", {}):
            visit(dep, (*path, name))
        done.add(name)

    for name in services:
        visit(name, ())
