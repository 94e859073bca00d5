"""Tokens: the service token goes in ``Authorization: Bearer``, the capability token in
``X-Capability-Token``. For development and tests, :func:`mint_hs256` makes HS256 tokens with
the claims ``executor-arm token mint`` writes, from the daemon's ``auth.jwt_secret_file``."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

__all__ = ["TokenKind", "read_secret_file", "mint_hs256", "unverified_claims"]

TokenKind = Literal["service", "capability"]


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """An HS256 secret as the daemon reads it: the file's bytes less trailing newlines."""
    with open(path, "rb") as f:
        secret = f.read().rstrip(b"\r\n")
    if len(secret) < 32:
        raise ValueError("an HS256 secret must be at least 32 bytes")
    return secret


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def mint_hs256(
    secret: bytes | str,
    *,
    kind: TokenKind,
    capabilities: Sequence[str] = (),
    ttl_seconds: int = 60,
    sub: str | None = None,
    aud: str = "executor-arm",
    iss: str | None = None,
    single_use: bool = False,
    commands: Sequence[str] | None = None,
    profiles: Sequence[str] | None = None,
    max_timeout_seconds: int | None = None,
    now: int | None = None,
) -> str:
    """An HS256 JWT as ``executor-arm token mint`` makes it: ``aud``, ``exp``, ``nbf``, ``iat``,
    a fresh ``jti``, ``token_use`` (``service`` or ``capability``), and the optional ``sub``,
    ``iss``, ``capabilities``, ``commands``, ``profiles``, ``max_timeout_seconds`` and
    ``single_use`` claims. The daemon caps the lifetime at ``auth.max_ttl_seconds`` (1 h)."""
    key = secret.encode() if isinstance(secret, str) else secret
    issued = int(time.time()) if now is None else now
    claims: dict[str, Any] = {}
    if iss is not None:
        claims["iss"] = iss
    if sub is not None:
        claims["sub"] = sub
    claims.update(
        aud=aud,
        exp=issued + ttl_seconds,
        nbf=issued,
        iat=issued,
        jti=str(uuid.uuid4()),
        token_use=kind,
    )
    if capabilities:
        claims["capabilities"] = list(capabilities)
    if commands is not None:
        claims["commands"] = list(commands)
    if profiles is not None:
        claims["profiles"] = list(profiles)
    if max_timeout_seconds is not None:
        claims["max_timeout_seconds"] = max_timeout_seconds
    if single_use:
        claims["single_use"] = True
    header = {"typ": "JWT", "alg": "HS256"}
    signing_input = ".".join(
        _b64url(json.dumps(part, separators=(",", ":")).encode()) for part in (header, claims)
    )
    signature = hmac.new(key, signing_input.encode("ascii"), hashlib.sha256).digest()
    return f"{signing_input}.{_b64url(signature)}"


def unverified_claims(token: str) -> dict[str, Any]:
    """A JWT's claims, not verified (for display: the daemon is what checks tokens)."""
    try:
        payload = token.split(".")[1]
        data = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        claims = json.loads(data)
    except (IndexError, ValueError) as e:
        raise ValueError("not a JWT") from e
    if not isinstance(claims, dict):
        raise ValueError("not a JWT")
    return claims
