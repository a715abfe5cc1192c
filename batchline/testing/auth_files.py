"""Auth files for the tests of the gateway's tokens (batchline/auth.py), over gRPC and REST alike:
three tokens, and the TOML entries that grant them tenants, models and admin rights."""
from __future__ import annotations

import hashlib
import os
import pathlib

SEARCH, OTHER, ADMIN = "search-secret-1", "other-secret-2", "admin-secret-3"


def token_entry(token: str, tenant: str, models: list[str], admin: bool = False) -> str:
    """One [[tokens]] entry: the token's sha256, its tenant and the model patterns it may call."""
    digest = hashlib.sha256(token.encode()).hexdigest()
    return (f'[[tokens]]\nsha256 = "{digest}"\ntenant = "{tenant}"\nmodels = {models!r}\n'
            f"admin = {'true' if admin else 'false'}\nweight = 1.0\nmax_rate = 0\n").replace("'", '"')


def write_auth_file(path: pathlib.Path, *entries: str) -> None:
    """Replace the file at once (a rename), as an operator's deploy would: a gateway reloading it
    never reads half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(entries))
    os.replace(tmp, path)
