"""Checking a run's receipt: a DSSE envelope, signed with the daemon's Ed25519 key, whose
payload is an in-toto Statement v1 about the run (predicate ``urn:executor-arm:receipt:v1``).

The envelope and its signatures are checked by ``securesystemslib`` (DSSE's pre-authentication
encoding and the Ed25519 verification are its own), installed with the ``receipts`` extra:
``pip install "executor-arm-client[receipts]"``. It is imported when a receipt is verified, so
the rest of the client does not need it. This module only turns the daemon's keys into
verifying keys and checks that the signed payload is the statement the daemon makes.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

from .models import ReceiptKey

__all__ = [
    "IN_TOTO_PAYLOAD_TYPE",
    "STATEMENT_TYPE",
    "PREDICATE_TYPE",
    "KeyLike",
    "ReceiptVerificationError",
    "verify_receipt",
    "subject_sha256",
]

#: The envelope's ``payloadType``.
IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
#: The statement's ``_type``.
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
#: The statement's ``predicateType``.
PREDICATE_TYPE = "urn:executor-arm:receipt:v1"

#: A verifying key: one of :meth:`Client.receipt_keys`' keys, the JSON of one (a mapping with
#: ``public_key_pem`` and, when given, ``keyid``), or a PEM ``PUBLIC KEY``.
KeyLike: TypeAlias = ReceiptKey | Mapping[str, Any] | str


class ReceiptVerificationError(Exception):
    """The receipt does not verify: the message says why (not a DSSE envelope, another payload
    type, no signature by one of the keys that verifies, a payload that is not the daemon's
    in-toto statement)."""


def _keyid(raw_public_key: bytes) -> str:
    # The daemon's keyid: lowercase hex SHA-256 of the raw 32-byte Ed25519 public key.
    return hashlib.sha256(raw_public_key).hexdigest()


def verify_receipt(
    envelope: Mapping[str, Any] | str | bytes, keys: Iterable[KeyLike] | KeyLike
) -> dict[str, Any]:
    """The in-toto statement of ``envelope`` (a receipt as :meth:`Client.receipt` or an answer's
    ``receipt`` gives it, or its JSON text) once a signature by one of ``keys`` verifies over
    it, the payload type is ``application/vnd.in-toto+json`` and the payload is an in-toto
    Statement v1 with predicate ``urn:executor-arm:receipt:v1``.

    ``keys`` are what :meth:`Client.receipt_keys` returns (or their JSON, or PEM public keys);
    pass keys you trust, not only those the receipt's daemon lists. Raises
    :class:`ReceiptVerificationError` naming the reason when the receipt does not verify,
    ``ValueError`` for a key that is not an Ed25519 public key (or whose ``keyid`` is not its
    own), and ``ImportError`` without the ``receipts`` extra. ``envelope`` is not changed."""
    try:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        from cryptography.hazmat.primitives.serialization import (
            Encoding,
            PublicFormat,
            load_pem_public_key,
        )
        from securesystemslib.dsse import Envelope
        from securesystemslib.exceptions import FormatError, VerificationError
        # securesystemslib.signer names its keys without an __all__, which mypy --strict takes
        # for an import it does not re-export.
        from securesystemslib.signer import Key, SSlibKey  # type: ignore[attr-defined]
    except ImportError as e:
        raise ImportError(
            "verify_receipt needs the receipts extra: "
            'pip install "executor-arm-client[receipts]" (securesystemslib with cryptography)'
        ) from e

    def verifying_key(key: KeyLike) -> Key:
        pem: object
        algorithm: object
        listed_keyid: object = None
        if isinstance(key, ReceiptKey):
            pem, listed_keyid, algorithm = key.public_key_pem, key.keyid, key.algorithm
        elif isinstance(key, Mapping):
            pem, listed_keyid = key.get("public_key_pem"), key.get("keyid")
            algorithm = key.get("algorithm", "ed25519")
        else:
            pem, algorithm = key, "ed25519"
        if algorithm != "ed25519":
            raise ValueError(f"key {listed_keyid}: algorithm {algorithm!r}, not ed25519")
        if not isinstance(pem, str):
            raise ValueError(f"key {listed_keyid}: no public_key_pem")
        try:
            public_key = load_pem_public_key(pem.encode())
        except ValueError as e:
            raise ValueError(f"key {listed_keyid}: not a PEM public key ({e})") from e
        if not isinstance(public_key, Ed25519PublicKey):
            raise ValueError(f"key {listed_keyid}: not an Ed25519 public key")
        keyid = _keyid(public_key.public_bytes(Encoding.Raw, PublicFormat.Raw))
        if listed_keyid is not None and listed_keyid != keyid:
            raise ValueError(
                f"key {listed_keyid}: its keyid is not that of its public key ({keyid})"
            )
        return SSlibKey.from_crypto(public_key, keyid=keyid)

    if isinstance(keys, (ReceiptKey, Mapping, str)):
        keys = [keys]
    verifying = [verifying_key(k) for k in keys]
    if not verifying:
        raise ValueError("no keys to verify the receipt with")

    if isinstance(envelope, (str, bytes)):
        try:
            envelope = json.loads(envelope)
        except ValueError as e:
            raise ReceiptVerificationError(f"not a DSSE envelope: not JSON ({e})") from e
    if not isinstance(envelope, Mapping):
        raise ReceiptVerificationError(
            f"not a DSSE envelope: a {type(envelope).__name__}, not a JSON object"
        )
    payload_type = envelope.get("payloadType")
    if payload_type != IN_TOTO_PAYLOAD_TYPE:
        raise ReceiptVerificationError(
            f"payload type {payload_type!r}, not {IN_TOTO_PAYLOAD_TYPE!r}"
        )
    try:
        # Envelope.from_dict rewrites the signatures it reads: it gets a copy.
        parsed = Envelope.from_dict(copy.deepcopy(dict(envelope)))
    except (KeyError, TypeError, ValueError, AttributeError, FormatError) as e:
        raise ReceiptVerificationError(f"not a DSSE envelope: {type(e).__name__}: {e}") from e

    try:
        parsed.verify(verifying, 1)
    except VerificationError as e:
        signed_by = sorted(parsed.signatures)
        known = sorted({k.keyid for k in verifying} & set(signed_by))
        if not signed_by:
            reason = "the envelope has no signature"
        elif not known:
            reason = (
                f"no signature by a known key: signed by {', '.join(signed_by)}, none of the "
                f"{len(verifying)} key(s) given"
            )
        else:
            reason = (
                f"the signature by {', '.join(known)} does not verify: the payload, its type or "
                "the signature was changed"
            )
        raise ReceiptVerificationError(reason) from e

    try:
        statement = json.loads(parsed.payload)
    except ValueError as e:
        raise ReceiptVerificationError(f"the payload is not JSON ({e})") from e
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        found = statement.get("_type") if isinstance(statement, dict) else type(statement).__name__
        raise ReceiptVerificationError(
            f"the payload is not an in-toto statement: _type {found!r}, not {STATEMENT_TYPE!r}"
        )
    subjects = statement.get("subject")
    if not isinstance(subjects, list) or not all(
        isinstance(s, dict) and isinstance(s.get("digest"), dict) for s in subjects
    ):
        raise ReceiptVerificationError(
            "the payload is not an in-toto statement: its subject is not a list of resource "
            "descriptors with digests"
        )
    if statement.get("predicateType") != PREDICATE_TYPE:
        raise ReceiptVerificationError(
            f"predicateType {statement.get('predicateType')!r}, not {PREDICATE_TYPE!r}"
        )
    if not isinstance(statement.get("predicate"), dict):
        raise ReceiptVerificationError("the statement's predicate is not a JSON object")
    return statement


def subject_sha256(statement: Mapping[str, Any], name: str) -> str | None:
    """The SHA-256 (bare lowercase hex) of the statement's subject ``name`` (``command``,
    ``code``, ``stdout``, ``stderr``), or None when it has none."""
    for subject in statement.get("subject") or []:
        if isinstance(subject, Mapping) and subject.get("name") == name:
            digest = subject.get("digest")
            value = digest.get("sha256") if isinstance(digest, Mapping) else None
            return value if isinstance(value, str) else None
    return None
