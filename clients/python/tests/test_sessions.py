"""Sessions against the real daemon: create, exec, files, tenancy, async execs, delete."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from conftest import Daemon

from executor_arm_client import (
    AuthenticationError,
    Client,
    ExecutionResult,
    InvalidRequestError,
    NotFoundError,
    OutputEvent,
    ResultEvent,
    SessionInfo,
    StartEvent,
)


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


def test_create_exec_upload_download_delete(daemon: Daemon, tenant: str) -> None:
    with daemon.client(tenant=tenant) as c:
        info = c.sessions.create("python", ttl_seconds=600)
        assert info.id.startswith("ses_")
        assert info.language == "python" and info.backend == "local"
        assert info.tenant == tenant and info.execs == 0
        assert c.sessions.get(info.id) == info

        c.sessions.upload(info.id, "data/input.csv", b"a,b\n1,2\n")
        listing = c.sessions.list_files(info.id, "data")
        assert listing.path == "data"
        assert [(e.name, e.type, e.size) for e in listing.entries] == [("input.csv", "file", 8)]
        top = c.sessions.list_files(info.id)
        assert ("data", "dir") in [(e.name, e.type) for e in top.entries]

        code = (
            "rows = open('data/input.csv').read().splitlines()\n"
            "open('out.txt', 'w').write(str(len(rows)))\n"
            "print('rows', len(rows))"
        )
        result = c.sessions.exec(info.id, code, timeout_ms=20000)
        assert isinstance(result, ExecutionResult)
        assert result.success and result.exit_code == 0
        assert result.stdout == "rows 2\n"
        assert result.provenance.session_id == info.id
        assert result.provenance.code_sha256
        assert c.sessions.download(info.id, "out.txt") == b"2"
        assert c.sessions.get(info.id).execs == 1

        # The workspace persists from one exec to the next.
        again = c.sessions.exec(info.id, "print(open('out.txt').read())")
        assert again.stdout == "2\n"

        c.sessions.delete(info.id)
        with pytest.raises(NotFoundError):
            c.sessions.get(info.id)
        with pytest.raises(NotFoundError):
            c.sessions.delete(info.id)


def test_other_tenant_sees_nothing(session: tuple[Client, SessionInfo], daemon: Daemon) -> None:
    _, info = session
    with daemon.client(tenant="someone-else") as other:
        with pytest.raises(NotFoundError):
            other.sessions.get(info.id)
        with pytest.raises(NotFoundError):
            other.sessions.download(info.id, "anything")


def test_session_timeout_is_a_result(session: tuple[Client, SessionInfo]) -> None:
    c, info = session
    result = c.sessions.exec(info.id, "import time\ntime.sleep(30)", timeout_ms=500)
    assert result.outcome == "timeout" and result.killed_reason == "timeout"


def test_async_exec_stream_and_cancel(session: tuple[Client, SessionInfo]) -> None:
    c, info = session
    accepted = c.sessions.exec(
        info.id, "import time\nprint('up', flush=True)\ntime.sleep(60)", async_=True
    )
    assert accepted.status == "running" and accepted.exec_id.startswith("exec-")
    events = c.sessions.stream_exec(info.id, accepted.exec_id)
    assert isinstance(next(events), StartEvent)
    out = next(events)
    assert isinstance(out, OutputEvent) and out.text == "up\n"
    assert c.sessions.get_exec(info.id, accepted.exec_id).status == "running"
    assert c.sessions.cancel_exec(info.id, accepted.exec_id, grace_seconds=0).status == (
        "cancelling"
    )
    last = list(events)[-1]
    assert isinstance(last, ResultEvent)
    assert isinstance(last.result, ExecutionResult) and last.result.outcome == "cancelled"


def test_exec_stream(session: tuple[Client, SessionInfo]) -> None:
    c, info = session
    events = list(c.sessions.exec_stream(info.id, "print('streamed')"))
    assert isinstance(events[0], StartEvent) and isinstance(events[-1], ResultEvent)
    assert "".join(e.text for e in events if isinstance(e, OutputEvent)) == "streamed\n"


def test_bad_paths_and_languages(session: tuple[Client, SessionInfo], daemon: Daemon) -> None:
    c, info = session
    with pytest.raises(InvalidRequestError):
        c.sessions.upload(info.id, "../escape", b"x")
    with pytest.raises(NotFoundError):
        c.sessions.download(info.id, "missing.txt")
    with pytest.raises(InvalidRequestError) as err:
        c.sessions.create("cobol")
    assert err.value.error_type == "InvalidRequest"
    with daemon.client(capability_token=None) as no_cap, pytest.raises(AuthenticationError):
        no_cap.sessions.create("python")


def test_pause_and_resume(session: tuple[Client, SessionInfo]) -> None:
    c, info = session
    c.sessions.upload(info.id, "notes/today.txt", b"kept while paused")
    paused = c.sessions.pause(info.id)
    assert paused.state == "paused" and paused.paused_until
    assert c.sessions.get(info.id).state == "paused"
    # Pausing a paused session answers it as it is.
    assert c.sessions.pause(info.id).state == "paused"
    resumed = c.sessions.resume(info.id)
    assert resumed.state == "running" and resumed.paused_until is None
    assert c.sessions.download(info.id, "notes/today.txt") == b"kept while paused"
    # An exec resumes a paused session by itself.
    c.sessions.pause(info.id)
    result = c.sessions.exec(info.id, "print(open('notes/today.txt').read())")
    assert result.stdout == "kept while paused\n"
    assert c.sessions.get(info.id).state == "running"
