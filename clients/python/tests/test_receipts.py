"""Receipts against the real daemon, with the sync and the async client: a run's receipt inline
(``receipt=True``) and from its route, the session exec twin, the keys that verify them, the
409 while a run goes on; and ``verify_receipt`` refusing receipts that were changed, keys that
are not the daemon's, and signed payloads that are not the daemon's statement.

A run whose receipt is asked for before it ends is held running until the test ends it (a
cancel, or the end of its stdin), so the 409 cannot race the run's end; the receipt after the
end is polled for with a deadline."""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from conftest import Daemon
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from securesystemslib.dsse import Envelope
from securesystemslib.signer import CryptoSigner, SSlibKey  # type: ignore[attr-defined]

from executor_arm_client import (
    AsyncClient,
    Client,
    ConflictError,
    ExecutionResult,
    NotFinishedError,
    NotFoundError,
    ReceiptKey,
    ReceiptVerificationError,
    ResultEvent,
    RetryPolicy,
    SessionInfo,
    subject_sha256,
    verify_receipt,
)
from executor_arm_client.receipts import IN_TOTO_PAYLOAD_TYPE, PREDICATE_TYPE, STATEMENT_TYPE

#: How long a test polls for a receipt once its run was ended.
WAIT_S = 30.0


@pytest.fixture
def tenant() -> str:
    return f"tenant-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def session(daemon: Daemon, tenant: str) -> Iterator[tuple[Client, SessionInfo]]:
    with daemon.client(tenant=tenant) as c:
        info = c.sessions.create("python", ttl_seconds=600)
        try:
            yield c, info
        finally:
            try:
                c.sessions.delete(info.id)
            except NotFoundError:
                pass


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hex(digest: str) -> str:
    return digest.removeprefix("sha256:")


def _check_statement(statement: dict[str, Any], result: ExecutionResult) -> None:
    """The statement is about ``result``: its subjects are the digests of what it ran and
    wrote, its predicate names the run and how it ended."""
    assert statement["_type"] == STATEMENT_TYPE
    assert statement["predicateType"] == PREDICATE_TYPE
    assert subject_sha256(statement, "stdout") == _sha256(result.stdout_bytes)
    assert subject_sha256(statement, "stderr") == _sha256(result.stderr_bytes)
    assert subject_sha256(statement, "command") == _hex(result.provenance.command_hash)
    predicate = statement["predicate"]
    assert predicate["what"]["exec_id"] == result.exec_id
    assert predicate["result"]["outcome"] == result.outcome
    assert predicate["result"]["exit_code"] == result.exit_code


def _receipt_once_ended(fetch: Callable[[], dict[str, Any]], what: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return fetch()
        except NotFinishedError:
            assert time.monotonic() < deadline, f"{what}: still no receipt after {WAIT_S} s"
        time.sleep(0.1)


async def _areceipt_once_ended(
    fetch: Callable[[], Awaitable[dict[str, Any]]], what: str
) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return await fetch()
        except NotFinishedError:
            assert time.monotonic() < deadline, f"{what}: still no receipt after {WAIT_S} s"
        await asyncio.sleep(0.1)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _flip_byte(b64: str, index: int) -> str:
    data = bytearray(base64.b64decode(b64))
    data[index] ^= 0x01
    return _b64(bytes(data))


def _stranger_key() -> tuple[Ed25519PrivateKey, str, str]:
    """A fresh Ed25519 key, its keyid as the daemon computes keyids, and its public PEM."""
    private = Ed25519PrivateKey.generate()
    public = private.public_key()
    keyid = _sha256(public.public_bytes(Encoding.Raw, PublicFormat.Raw))
    pem = public.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode()
    return private, keyid, pem


def _signed_by_stranger(payload: bytes) -> tuple[dict[str, Any], str]:
    """``payload`` in an in-toto DSSE envelope signed (by the library) with a fresh key; and
    that key's PEM."""
    private, keyid, pem = _stranger_key()
    signer = CryptoSigner(private, SSlibKey.from_crypto(private.public_key(), keyid=keyid))
    envelope = Envelope(payload, IN_TOTO_PAYLOAD_TYPE, {})
    envelope.sign(signer)
    signed: dict[str, Any] = envelope.to_dict()
    return signed, pem


# --- runs -----------------------------------------------------------------------------------


def test_inline_receipt_is_the_stored_one_and_verifies(client: Client) -> None:
    result = client.execute("echo", ["receipt", "me"], receipt=True)
    assert result.stdout == "receipt me\n"
    assert result.receipt is not None, "receipt=True: the answer carries the receipt"
    assert result.receipt == client.receipt(result.exec_id)
    assert result.receipt["payloadType"] == IN_TOTO_PAYLOAD_TYPE

    keys = client.receipt_keys()
    assert keys and all(isinstance(k, ReceiptKey) for k in keys)
    assert keys[0].signing and keys[0].algorithm == "ed25519"
    assert "BEGIN PUBLIC KEY" in keys[0].public_key_pem
    assert [s["keyid"] for s in result.receipt["signatures"]] == [keys[0].keyid]

    before = copy.deepcopy(result.receipt)
    statement = verify_receipt(result.receipt, keys)
    assert result.receipt == before, "verify_receipt changed the envelope it was given"
    _check_statement(statement, result)
    # The same with the keys as JSON, as PEM text, and with the envelope as JSON text.
    as_json = [{"keyid": k.keyid, "public_key_pem": k.public_key_pem} for k in keys]
    assert verify_receipt(result.receipt, as_json) == statement
    assert verify_receipt(json.dumps(result.receipt), keys[0].public_key_pem) == statement

    plain = client.execute("echo", ["no", "receipt", "asked"])
    assert plain.receipt is None
    _check_statement(verify_receipt(client.receipt(plain.exec_id), keys), plain)


def test_changed_receipts_and_other_keys_are_refused(client: Client) -> None:
    result = client.execute("echo", ["tamper"], receipt=True)
    assert result.receipt is not None
    envelope = result.receipt
    keys = client.receipt_keys()
    verify_receipt(envelope, keys)

    payload = copy.deepcopy(envelope)
    payload["payload"] = _flip_byte(envelope["payload"], 10)
    with pytest.raises(ReceiptVerificationError, match="does not verify"):
        verify_receipt(payload, keys)

    signature = copy.deepcopy(envelope)
    signature["signatures"][0]["sig"] = _flip_byte(envelope["signatures"][0]["sig"], 0)
    with pytest.raises(ReceiptVerificationError, match="does not verify"):
        verify_receipt(signature, keys)

    _, stranger_keyid, stranger_pem = _stranger_key()
    with pytest.raises(ReceiptVerificationError, match="no signature by a known key"):
        verify_receipt(envelope, [stranger_pem])
    # A stranger's key listed under the daemon's keyid is refused before any verification.
    with pytest.raises(ValueError, match="keyid"):
        verify_receipt(envelope, [{"keyid": keys[0].keyid, "public_key_pem": stranger_pem}])
    assert stranger_keyid != keys[0].keyid

    other_type = copy.deepcopy(envelope)
    other_type["payloadType"] = "application/json"
    with pytest.raises(ReceiptVerificationError, match="payload type"):
        verify_receipt(other_type, keys)

    unsigned = copy.deepcopy(envelope)
    unsigned["signatures"] = []
    with pytest.raises(ReceiptVerificationError, match="no signature"):
        verify_receipt(unsigned, keys)

    with pytest.raises(ReceiptVerificationError, match="not a DSSE envelope"):
        verify_receipt({"payloadType": IN_TOTO_PAYLOAD_TYPE, "payload": "%%%"}, keys)


def test_signed_payloads_that_are_not_the_daemons_statement_are_refused(client: Client) -> None:
    run = client.execute("echo", ["x"])
    statement = verify_receipt(client.receipt(run.exec_id), client.receipt_keys())

    not_a_statement, pem = _signed_by_stranger(b'{"hello": "world"}')
    with pytest.raises(ReceiptVerificationError, match="not an in-toto statement"):
        verify_receipt(not_a_statement, pem)

    not_json, pem = _signed_by_stranger(b"\xff not json")
    with pytest.raises(ReceiptVerificationError, match="not JSON"):
        verify_receipt(not_json, pem)

    other_predicate = dict(statement, predicateType="https://slsa.dev/provenance/v1")
    envelope, pem = _signed_by_stranger(json.dumps(other_predicate).encode())
    with pytest.raises(ReceiptVerificationError, match="predicateType"):
        verify_receipt(envelope, pem)

    # The daemon's statement signed by another key verifies with that key only.
    resigned, pem = _signed_by_stranger(json.dumps(statement).encode())
    assert verify_receipt(resigned, pem) == statement
    with pytest.raises(ReceiptVerificationError, match="no signature by a known key"):
        verify_receipt(resigned, client.receipt_keys())


def test_async_run_receipt_is_not_finished_then_verifies(client: Client) -> None:
    accepted = client.submit("sleep", ["60"], timeout_seconds=120, receipt=True)
    try:
        with pytest.raises(NotFinishedError) as info:
            client.receipt(accepted.exec_id)
        assert isinstance(info.value, ConflictError)
        assert info.value.status == 409 and info.value.error_type == "NotFinished"
        # Retryable: the same call succeeds once the run has ended.
        assert info.value.retryable
    finally:
        client.cancel(accepted.exec_id, grace_seconds=0)

    envelope = _receipt_once_ended(lambda: client.receipt(accepted.exec_id), accepted.exec_id)
    result = client.wait(accepted.exec_id, timeout=WAIT_S)
    assert result.outcome == "cancelled"
    assert result.receipt == envelope, "receipt=True: the stored answer carries the receipt"
    _check_statement(verify_receipt(envelope, client.receipt_keys()), result)


def test_unknown_run_has_no_receipt(client: Client) -> None:
    with pytest.raises(NotFoundError):
        client.receipt(f"exec_{uuid.uuid4().hex}")


def test_streamed_result_carries_the_receipt(client: Client) -> None:
    events = list(client.execute_stream("echo", ["streamed"], receipt=True))
    last = events[-1]
    assert isinstance(last, ResultEvent) and isinstance(last.result, ExecutionResult)
    assert last.result.receipt is not None
    assert last.result.receipt == client.receipt(last.result.exec_id)
    _check_statement(verify_receipt(last.result.receipt, client.receipt_keys()), last.result)


# --- sessions -------------------------------------------------------------------------------


def test_session_exec_receipt_has_the_code_subject(
    session: tuple[Client, SessionInfo], tenant: str, daemon: Daemon
) -> None:
    c, info = session
    code = "print('from the session')"
    result = c.sessions.exec(info.id, code, receipt=True)
    assert result.stdout == "from the session\n"
    envelope = c.sessions.exec_receipt(info.id, result.exec_id)
    assert result.receipt is not None and result.receipt == envelope

    statement = verify_receipt(envelope, c.receipt_keys())
    _check_statement(statement, result)
    assert result.provenance.code_sha256 is not None
    assert subject_sha256(statement, "code") == _hex(result.provenance.code_sha256)
    assert subject_sha256(statement, "code") == _sha256(code.encode())
    assert statement["predicate"]["what"]["session_id"] == info.id
    assert statement["predicate"]["who"]["tenant"] == tenant

    plain = c.sessions.exec(info.id, "print(1)")
    assert plain.receipt is None
    plain_envelope = c.sessions.exec_receipt(info.id, plain.exec_id)
    _check_statement(verify_receipt(plain_envelope, c.receipt_keys()), plain)

    with daemon.client(tenant=f"other-{tenant}") as other:
        with pytest.raises(NotFoundError):
            other.sessions.exec_receipt(info.id, result.exec_id)
    with pytest.raises(NotFoundError):
        c.sessions.exec_receipt(info.id, f"exec_{uuid.uuid4().hex}")


def test_session_exec_receipt_is_not_finished_until_its_stdin_ends(
    session: tuple[Client, SessionInfo],
) -> None:
    c, info = session
    code = "import sys\nprint(sys.stdin.read().upper(), end='')"
    accepted = c.sessions.exec(
        info.id, code, async_=True, stdin_open=True, timeout_ms=120_000, receipt=True
    )
    with pytest.raises(NotFinishedError):
        c.sessions.exec_receipt(info.id, accepted.exec_id)
    c.sessions.exec_stdin(info.id, accepted.exec_id, "shout", eof=True)

    envelope = _receipt_once_ended(
        lambda: c.sessions.exec_receipt(info.id, accepted.exec_id), accepted.exec_id
    )
    statement = verify_receipt(envelope, c.receipt_keys())
    assert subject_sha256(statement, "stdout") == _sha256(b"SHOUT")
    assert subject_sha256(statement, "code") == _sha256(code.encode())
    assert statement["predicate"]["result"]["outcome"] == "success"


def test_background_process_receipt_once_it_ended(session: tuple[Client, SessionInfo]) -> None:
    c, info = session
    started = c.sessions.processes.start(
        info.id, "import sys\nprint(len(sys.stdin.read()))", timeout_ms=120_000
    )
    with pytest.raises(NotFinishedError):
        c.sessions.exec_receipt(info.id, started.process_id)
    c.sessions.processes.stdin(info.id, started.process_id, b"four", eof=True)
    envelope = _receipt_once_ended(
        lambda: c.sessions.exec_receipt(info.id, started.process_id), started.process_id
    )
    statement = verify_receipt(envelope, c.receipt_keys())
    assert subject_sha256(statement, "stdout") == _sha256(b"4\n")
    assert statement["predicate"]["what"]["exec_id"] == started.exec_id


# --- the async client -----------------------------------------------------------------------


def test_async_client_receipts(daemon: Daemon, tenant: str) -> None:
    async def main() -> None:
        async with AsyncClient(
            daemon.url,
            service_token=daemon.service_token,
            capability_token=daemon.capability_token,
            tenant=tenant,
            retry=RetryPolicy(max_attempts=3, initial_backoff=0.2),
        ) as arm:
            keys = await arm.receipt_keys()
            result = await arm.execute("echo", ["async", "receipt"], receipt=True)
            assert result.receipt is not None
            assert result.receipt == await arm.receipt(result.exec_id)
            _check_statement(verify_receipt(result.receipt, keys), result)

            accepted = await arm.submit("sleep", ["60"], timeout_seconds=120, receipt=True)
            try:
                with pytest.raises(NotFinishedError):
                    await arm.receipt(accepted.exec_id)
            finally:
                await arm.cancel(accepted.exec_id, grace_seconds=0)
            envelope = await _areceipt_once_ended(
                lambda: arm.receipt(accepted.exec_id), accepted.exec_id
            )
            assert verify_receipt(envelope, keys)["predicate"]["result"]["outcome"] == "cancelled"

            info = await arm.sessions.create("python", ttl_seconds=600)
            try:
                ran = await arm.sessions.exec(info.id, "print('async session')", receipt=True)
                assert ran.receipt is not None
                assert ran.receipt == await arm.sessions.exec_receipt(info.id, ran.exec_id)
                statement = verify_receipt(ran.receipt, keys)
                assert subject_sha256(statement, "code") == _sha256(b"print('async session')")
            finally:
                await arm.sessions.delete(info.id)

    asyncio.run(main())


# --- without the receipts extra -------------------------------------------------------------


def test_the_client_imports_without_the_receipts_extra() -> None:
    # securesystemslib made unimportable: the package imports, and verify_receipt says what to
    # install.
    code = (
        "import sys\n"
        "sys.modules['securesystemslib'] = None\n"
        "import executor_arm_client as c\n"
        "try:\n"
        "    c.verify_receipt({}, [])\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    sys.exit('no ImportError')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert done.returncode == 0, done.stderr
    assert "executor-arm-client[receipts]" in done.stdout
