"""POST /execute against the real daemon: results, provenance, refusals, tokens, idempotency."""

from __future__ import annotations

import hashlib
import uuid

import pytest
from conftest import Daemon

from executor_arm_client import (
    AuthenticationError,
    CapabilityViolationError,
    Client,
    ExecutionResult,
    ExecutionTimeoutError,
    ExecutorArmError,
    IdempotencyConflictError,
    InvalidRequestError,
    RetryPolicy,
    mint_hs256,
    read_secret_file,
    unverified_claims,
)


def _sha(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def test_execute_success_with_provenance(client: Client) -> None:
    request_id = f"pytest-{uuid.uuid4().hex[:12]}"
    result = client.execute(
        "echo", ["hello", "world"], metadata={"task_id": "t-1", "step": 3}, request_id=request_id
    )
    assert isinstance(result, ExecutionResult)
    assert result.success is True
    assert result.stdout == "hello world\n"
    assert result.stderr == ""
    assert result.exit_code == 0
    assert result.outcome == "success"
    assert result.backend == "local"
    assert result.killed_reason is None
    assert result.stdout_truncated is False and result.oom is False
    p = result.provenance
    assert p.exec_id == result.exec_id and p.exec_id.startswith("exec-")
    assert p.command_hash == _sha("echo hello world")
    assert p.stdout_sha256 == _sha("hello world\n")
    assert p.stderr_sha256 == _sha("")
    assert p.request_id == request_id
    assert p.subject == "dev"
    assert p.action_type == "shell"
    assert p.backend == "local" and p.profile == result.profile
    assert p.invocation_hash.startswith("sha256:")
    assert p.capabilities_used
    assert p.audit_seq is not None and p.audit_seq > 0
    assert p.metadata == {"task_id": "t-1", "step": 3}


def test_failing_command_is_a_result(client: Client) -> None:
    result = client.execute("ls", ["/no/such/path"])
    assert result.success is False
    assert result.exit_code != 0
    assert result.outcome == "failed"
    assert "No such file" in result.stderr


def test_stdin_and_python(client: Client) -> None:
    result = client.execute(
        "python3",
        ["-c", "import sys; print(sys.stdin.read().upper())"],
        action_type="python",
        stdin="shout",
    )
    assert result.stdout == "SHOUT\n"


def test_command_outside_the_allowlist_is_refused(client: Client) -> None:
    with pytest.raises(CapabilityViolationError) as info:
        client.execute("rm", ["-rf", "/tmp/x"])
    err = info.value
    assert err.status == 403
    assert err.error_type == "CapabilityViolation"
    assert err.retryable is False
    assert err.retry_after is None
    assert "not in allowlist" in err.message
    assert err.request_id
    assert err.allowed_commands is not None
    assert "echo" in err.allowed_commands and "rm" not in err.allowed_commands


def test_path_as_command_is_refused(client: Client) -> None:
    with pytest.raises(CapabilityViolationError):
        client.execute("/bin/ls")


def test_bad_service_token_is_401(daemon: Daemon) -> None:
    with daemon.client(service_token="not-a-token") as c:
        with pytest.raises(AuthenticationError) as info:
            c.execute("echo", ["x"])
    assert info.value.status == 401
    assert info.value.error_type == "Unauthorized"
    assert info.value.retryable is False


def test_missing_capability_token_is_401(daemon: Daemon) -> None:
    with daemon.client(capability_token=None) as c:
        with pytest.raises(AuthenticationError):
            c.execute("echo", ["x"])


def test_invalid_request_is_400(client: Client) -> None:
    with pytest.raises(InvalidRequestError) as info:
        client.execute("echo", ["x"], timeout_seconds=100000)
    assert info.value.error_type == "InvalidRequest"
    assert isinstance(info.value, ExecutorArmError)


def test_execution_timeout_carries_the_partial_result(client: Client) -> None:
    with pytest.raises(ExecutionTimeoutError) as info:
        client.execute(
            "python3",
            ["-c", "import time; print('started', flush=True); time.sleep(30)"],
            action_type="python",
            timeout_seconds=3,
        )
    err = info.value
    assert err.status == 408 and err.error_type == "ExecutionTimeout"
    assert err.retryable is False
    result = err.result
    assert result is not None
    assert result.outcome == "timeout" and result.killed_reason == "timeout"
    assert result.stdout == "started\n"


def test_minted_tokens(daemon: Daemon) -> None:
    secret = read_secret_file(daemon.secret_file)
    service = mint_hs256(secret, kind="service", sub="minted-svc", ttl_seconds=300)
    capability = mint_hs256(
        secret, kind="capability", capabilities=["ShellExecute", "ShellRead"], ttl_seconds=60
    )
    assert unverified_claims(service)["token_use"] == "service"
    with daemon.client(service_token=service, capability_token=capability) as c:
        result = c.execute("echo", ["minted"])
        assert result.stdout == "minted\n"
        assert result.provenance.subject == "minted-svc"
        assert result.provenance.token_id == unverified_claims(capability)["jti"]
        # The token lacks PythonExecute.
        with pytest.raises(CapabilityViolationError) as info:
            c.execute("python3", ["-c", "print(1)"], action_type="python")
        assert "PythonExecute" in info.value.message
        # A capability token in the service token's place.
        with daemon.client(service_token=capability) as wrong:
            with pytest.raises(AuthenticationError):
                wrong.execute("echo", ["x"])
    other_secret = b"0" * 64
    forged = mint_hs256(other_secret, kind="service", sub="intruder")
    with daemon.client(service_token=forged) as c, pytest.raises(AuthenticationError):
        c.execute("echo", ["x"])


def test_idempotency_key_replays_the_stored_answer(client: Client) -> None:
    key = f"pytest-{uuid.uuid4().hex}"
    first = client.execute("echo", ["once"], idempotency_key=key)
    again = client.execute("echo", ["once"], idempotency_key=key)
    assert again.exec_id == first.exec_id
    with pytest.raises(IdempotencyConflictError) as info:
        client.execute("echo", ["other body"], idempotency_key=key)
    assert info.value.status == 422 and info.value.retryable is False


def test_each_call_gets_its_own_idempotency_key(daemon: Daemon) -> None:
    with daemon.client(retry=RetryPolicy.none()) as c:
        a = c.execute("echo", ["same"])
        b = c.execute("echo", ["same"])
    assert a.exec_id != b.exec_id


def test_health_and_capabilities(client: Client) -> None:
    assert client.health().status == "healthy"
    caps = client.capabilities()
    assert "sleep" in caps["allowed_commands"]
