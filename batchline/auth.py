"""Token authentication with per-model scopes, from an auth file (TOML) the gateway re-reads when
it changes.

    [[tokens]]
    sha256 = "9f86d081884c7d65..."   # hex SHA-256 of the token: the file never holds a token itself
    tenant = "search"
    models = ["minilm*"]             # names or globs (fnmatch) of the models it may call
    admin = false                    # statistics (and, with the repository extension, load/unload)
    weight = 1.0                     # the tenant's share under overload
    max_rate = 0                     # requests/s the tenant may send (0: no cap)

Clients send `authorization: Bearer <token>`: gRPC metadata, or an HTTP header on the REST port.
A token is hashed on arrival and looked up by its hash; neither the token nor its hash is written
to logs, metrics or messages.
"""
from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import re
import tomllib
from dataclasses import dataclass
from typing import Callable, Iterable

from batchline import metrics
from batchline.errors import PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

_HEX_SHA256 = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"sha256", "tenant", "models", "admin", "weight", "max_rate"}
HEADER = "authorization"


class AuthFileError(ValueError):
    """The auth file cannot be used: the message says where and what."""


@dataclass(frozen=True)
class Grant:
    """What one token may do."""
    tenant: str
    models: tuple[str, ...]
    admin: bool = False
    weight: float = 1.0
    max_rate: float = 0.0

    def allows(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    def check_model(self, model: str) -> None:
        if not self.allows(model):
            raise PermissionDenied(f"tenant '{self.tenant}' may not call model '{model}'")

    def check_admin(self, what: str) -> None:
        if not self.admin:
            raise PermissionDenied(f"{what} needs an admin token; tenant '{self.tenant}' has none")


def visible(grant: Grant | None) -> Callable[[str], bool] | None:
    """The model names a caller may learn of, as a refusal lists them (None: every one)."""
    return grant.allows if grant is not None else None


def parse(text: str, source: str = "the auth file") -> dict[str, Grant]:
    """The grants of an auth file's text, by token hash (lowercase hex)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AuthFileError(f"{source} is not valid TOML: {exc}") from None
    entries = data.get("tokens", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise AuthFileError(f"{source}: `tokens` must be an array of tables ([[tokens]])")
    grants: dict[str, Grant] = {}
    for n, entry in enumerate(entries, 1):
        where = f"{source}, token {n}"
        unknown = set(entry) - _FIELDS
        if unknown:
            raise AuthFileError(f"{where}: unknown field(s) {sorted(unknown)} (known: {sorted(_FIELDS)})")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not _HEX_SHA256.fullmatch(digest.lower()):
            raise AuthFileError(f"{where}: `sha256` must be the 64 hex digits of the token's SHA-256")
        tenant, models = entry.get("tenant"), entry.get("models", [])
        if not isinstance(tenant, str) or not tenant:
            raise AuthFileError(f"{where}: `tenant` must be a non-empty string")
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise AuthFileError(f"{where}: `models` must be a list of model names or globs")
        admin, weight, max_rate = entry.get("admin", False), entry.get("weight", 1.0), entry.get("max_rate", 0)
        if not isinstance(admin, bool):
            raise AuthFileError(f"{where}: `admin` must be true or false")
        for field, value in (("weight", weight), ("max_rate", max_rate)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != value:
                raise AuthFileError(f"{where}: `{field}` must be a number >= 0")
        if weight == 0:
            raise AuthFileError(f"{where}: `weight` must be > 0")
        if digest.lower() in grants:
            raise AuthFileError(f"{where}: the same token hash is listed twice")
        grants[digest.lower()] = Grant(tenant, tuple(models), admin, float(weight), float(max_rate))
    return grants


def load(path: str) -> dict[str, Grant]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthFileError(f"cannot read the auth file {path!r}: {exc}") from None
    return parse(text, f"auth file {path!r}")


def token_of(metadata: Iterable[tuple[str | bytes, str | bytes]] | None) -> str | None:
    """The bearer token in gRPC metadata or HTTP headers (ASGI's are bytes), if any; Unauthenticated
    when more than one is sent (which one counts would differ between a proxy, gRPC and HTTP)."""
    found = []
    for key, value in metadata or ():
        if isinstance(key, bytes):
            key = key.decode("latin-1")
        if key.lower() == HEADER:
            found.append(value.decode("latin-1") if isinstance(value, bytes) else value)
    if not found:
        return None
    if len(found) > 1:
        raise Unauthenticated(f"the call carries {len(found)} `{HEADER}` headers: send one")
    scheme, _, token = found[0].strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else ""


class Tokens:
    """The grants of an auth file, re-read when it changes (a file that no longer parses keeps the
    grants that were read before, with a warning)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = self._stat()  # before the read: a change in between is read at the next request
        self._grants = load(path)

    def _stat(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        # The change time and inode too: one token's hash swapped for another keeps the size, and
        # `cp -p` or `rsync -t` keep the modification time.
        return st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size

    def _reload_if_changed(self) -> None:
        # A stat per request: a revoked token is refused from the first request after the change.
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._grants = load(self.path)
        except AuthFileError as exc:
            log.warning("the auth file changed but cannot be used (%s): the tokens read before stay", exc)
            metrics.AUTH_FILE_UNUSABLE.set(1)  # (for an alert: a revocation in that change is not in force)
            return
        metrics.AUTH_FILE_UNUSABLE.set(0)
        log.info("auth file %s re-read: %d tokens", self.path, len(self._grants))

    def digest(self, metadata: Iterable[tuple[str | bytes, str | bytes]] | None) -> str:
        """The hash of the caller's token, which names its grant; Unauthenticated without a token."""
        token = token_of(metadata)
        if token is None:
            raise Unauthenticated(f"this gateway needs a token: send `{HEADER}: Bearer <token>` metadata "
                                  "or header (tritonclient: headers={'authorization': 'Bearer <token>'})")
        if not token:
            raise Unauthenticated(f"the `{HEADER}` metadata (or header) must read `Bearer <token>`")
        return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()

    def lookup(self, digest: str) -> Grant:
        """What the token hashed to `digest` may do by the auth file as it is now; Unauthenticated
        once the file no longer lists it. A stream calls this for every message: a token removed
        while its stream is open is refused from the next message on."""
        self._reload_if_changed()
        grant = self._grants.get(digest)
        if grant is None:
            raise Unauthenticated("the token is not known to this gateway (mistyped, or revoked)")
        return grant

    def grant(self, metadata: Iterable[tuple[str | bytes, str | bytes]] | None) -> Grant:
        """What the caller's token may do; Unauthenticated without a known token."""
        return self.lookup(self.digest(metadata))
