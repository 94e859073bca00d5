"""The AsyncClient against the real daemon: the same flows, awaited."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from conftest import Daemon

from executor_arm_client import (
    AsyncClient,
    AuthenticationError,
    CapabilityViolationError,
    ExecutionResult,
    NotFoundError,
    OutputEvent,
    ResultEvent,
    RetryPolicy,
    StartEvent,
)


def _client(daemon: Daemon, **kwargs: object) -> AsyncClient:
    options: dict[str, object] = {
        "service_token": daemon.service_token,
        "capability_token": daemon.capability_token,
        "retry": RetryPolicy(max_attempts=3, initial_backoff=0.2),
    }
    options.update(kwargs)
    return AsyncClient(daemon.url, **options)  # type: ignore[arg-type]


def test_async_execute_and_errors(daemon: Daemon) -> None:
    async def main() -> None:
        async with _client(daemon) as arm:
            result = await arm.execute("echo", ["async", "hello"])
            assert isinstance(result, ExecutionResult)
            assert result.stdout == "async hello\n" and result.exit_code == 0
            assert result.provenance.exec_id == result.exec_id
            with pytest.raises(CapabilityViolationError) as info:
                await arm.execute("rm", ["x"])
            assert info.value.error_type == "CapabilityViolation"
        async with _client(daemon, service_token="bad") as bad:
            with pytest.raises(AuthenticationError):
                await bad.execute("echo", ["x"])

    asyncio.run(main())


def test_async_submit_stream_cancel(daemon: Daemon) -> None:
    async def main() -> None:
        async with _client(daemon) as arm:
            accepted = await arm.submit("sleep", ["60"], timeout_seconds=120)
            assert (await arm.get(accepted.exec_id)).status == "running"
            events = arm.stream(accepted.exec_id)
            first = await events.__anext__()
            assert isinstance(first, StartEvent) and first.exec_id == accepted.exec_id
            cancel = await arm.cancel(accepted.exec_id, grace_seconds=0)
            assert cancel.status == "cancelling"
            rest = [ev async for ev in events]
            last = rest[-1]
            assert isinstance(last, ResultEvent)
            assert isinstance(last.result, ExecutionResult)
            assert last.result.outcome == "cancelled"
            final = await arm.wait(accepted.exec_id, timeout=30)
            assert final.killed_reason == "cancelled"

            streamed = [ev async for ev in arm.execute_stream("echo", ["live"])]
            assert isinstance(streamed[0], StartEvent) and isinstance(streamed[-1], ResultEvent)
            text = "".join(e.text for e in streamed if isinstance(e, OutputEvent))
            assert text == "live\n"

    asyncio.run(main())


def test_async_sessions(daemon: Daemon) -> None:
    async def main() -> None:
        tenant = f"tenant-{uuid.uuid4().hex[:8]}"
        async with _client(daemon, tenant=tenant) as arm:
            info = await arm.sessions.create("python")
            assert info.tenant == tenant
            await arm.sessions.upload(info.id, "in.txt", "from async")
            result = await arm.sessions.exec(info.id, "print(open('in.txt').read().upper())")
            assert result.stdout == "FROM ASYNC\n"
            assert await arm.sessions.download(info.id, "in.txt") == b"from async"
            names = [e.name for e in (await arm.sessions.list_files(info.id)).entries]
            assert "in.txt" in names
            assert (await arm.sessions.pause(info.id)).state == "paused"
            assert (await arm.sessions.resume(info.id)).state == "running"
            assert await arm.sessions.download(info.id, "in.txt") == b"from async"
            await arm.sessions.delete(info.id)
            with pytest.raises(NotFoundError):
                await arm.sessions.get(info.id)

    asyncio.run(main())
