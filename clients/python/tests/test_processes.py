"""A session's background processes against the real daemon (local backend), with the sync and
the async client: start, stream, stdin and its end, signals, the list, and the refusals (a
signal not in the set, stdin or a signal to an ended process, an unknown process, one process
past ``sessions.max_processes``).

Every process is started with a deadline (``timeout_ms``), so a stream read to its ``result``
event ends even when what a test waits for never comes."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from conftest import Daemon

from executor_arm_client import (
    AlreadyFinishedError,
    AsyncClient,
    Client,
    ConflictError,
    Event,
    ExecutionResult,
    InvalidRequestError,
    NotFoundError,
    OutputEvent,
    ProcessInfo,
    ProcessStarted,
    RateLimitedError,
    ResultEvent,
    RetryPolicy,
    SessionInfo,
    StartEvent,
    StdinClosedError,
)

ECHO = (
    "import sys\n"
    "print('ready', flush=True)\n"
    "for line in sys.stdin:\n"
    "    print('got:', line.strip(), flush=True)\n"
    "print('bye', flush=True)"
)
SLEEPER = "import time\nprint('sleeping', flush=True)\ntime.sleep(600)"
#: Each process's deadline: the bound of a stream read to its end.
DEADLINE_MS = 60_000
#: How long a test polls the list for a process's end.
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


def _async_client(daemon: Daemon, tenant: str) -> AsyncClient:
    return AsyncClient(
        daemon.url,
        service_token=daemon.service_token,
        capability_token=daemon.capability_token,
        tenant=tenant,
        retry=RetryPolicy(max_attempts=3, initial_backoff=0.2),
    )


def _check_started(started: ProcessStarted, session_id: str) -> None:
    assert started.status == "running"
    assert started.process_id == started.exec_id
    base = f"/v1/sandbox/sessions/{session_id}/processes/{started.process_id}"
    assert started.links.stdin == f"{base}/stdin"
    assert started.links.signal == f"{base}/signal"
    execs = f"/v1/sandbox/sessions/{session_id}/execs"
    assert started.links.stream == f"{execs}/{started.exec_id}/stream"


def _entry(processes: list[ProcessInfo], process_id: str) -> ProcessInfo:
    (entry,) = [p for p in processes if p.process_id == process_id]
    return entry


def _wait_ended(list_processes: Callable[[], list[ProcessInfo]], process_id: str) -> ProcessInfo:
    deadline = time.monotonic() + WAIT_S
    while True:
        entry = _entry(list_processes(), process_id)
        if entry.state == "exited":
            return entry
        assert time.monotonic() < deadline, f"process {process_id} still {entry.state}"
        time.sleep(0.2)


async def _await_ended(
    list_processes: Callable[[], Awaitable[list[ProcessInfo]]], process_id: str
) -> ProcessInfo:
    deadline = time.monotonic() + WAIT_S
    while True:
        entry = _entry(await list_processes(), process_id)
        if entry.state == "exited":
            return entry
        assert time.monotonic() < deadline, f"process {process_id} still {entry.state}"
        await asyncio.sleep(0.2)


class _Echo:
    """Drives the echo process from its stream: ``ready`` -> two lines -> their answers -> the
    end of its stdin. What it saw, and the id of its ``ready`` event."""

    def __init__(self) -> None:
        self.stdout = ""
        self.ready_id: str | None = None
        self.result: ResultEvent | None = None
        self.sent = False
        self.closed = False

    def see(self, event: Event) -> str | None:
        """The next step for ``event``: ``"send"``, ``"eof"`` or None."""
        if isinstance(event, ResultEvent):
            self.result = event
            return None
        if not isinstance(event, OutputEvent) or event.stream != "stdout":
            return None
        self.stdout += event.text
        if not self.sent and "ready\n" in self.stdout:
            self.ready_id = event.id
            self.sent = True
            return "send"
        if self.sent and not self.closed and "got: world\n" in self.stdout:
            self.closed = True
            return "eof"
        return None

    def check(self) -> None:
        assert self.result is not None, f"no result event; stdout {self.stdout!r}"
        assert self.stdout == "ready\ngot: hello\ngot: world\nbye\n"
        assert isinstance(self.result.result, ExecutionResult)
        assert self.result.http_status == 200
        assert self.result.result.exit_code == 0 and self.result.result.success


def test_echo_process_stdin_stream_list(session: tuple[Client, SessionInfo]) -> None:
    c, info = session
    procs = c.sessions.processes
    started = procs.start(info.id, ECHO, timeout_ms=DEADLINE_MS)
    _check_started(started, info.id)
    pid = started.process_id

    entry = _entry(procs.list(info.id), pid)
    assert entry.exec_id == pid and entry.code_sha256.startswith("sha256:")
    assert entry.started_at

    echo = _Echo()
    first: Event | None = None
    for event in procs.stream(info.id, pid):
        first = first or event
        step = echo.see(event)
        if step == "send":
            # A foreground exec runs beside the process meanwhile.
            fg = c.sessions.exec(info.id, "print('beside')", timeout_ms=20000)
            assert fg.stdout == "beside\n"
            procs.stdin(info.id, pid, b"hello\n")
            procs.stdin(info.id, pid, "world\n")
        elif step == "eof":
            procs.stdin(info.id, pid, b"", eof=True)
    assert isinstance(first, StartEvent) and first.exec_id == pid
    echo.check()

    ended = _wait_ended(lambda: procs.list(info.id), pid)
    assert ended.exit_code == 0

    # The ended process's stream replays, and resumes after a given event.
    replay = [e for e in procs.stream(info.id, pid) if isinstance(e, OutputEvent)]
    assert "".join(e.text for e in replay) == echo.stdout
    assert echo.ready_id is not None
    rest = procs.stream(info.id, pid, last_event_id=echo.ready_id)
    after = "".join(e.text for e in rest if isinstance(e, OutputEvent))
    assert after == "got: hello\ngot: world\nbye\n"
    # Its result is also at its exec's route.
    assert c.sessions.get_exec(info.id, pid).status == "finished"

    with pytest.raises(AlreadyFinishedError) as late:
        procs.stdin(info.id, pid, b"late\n")
    assert isinstance(late.value, ConflictError)
    assert late.value.status == 409 and late.value.error_type == "AlreadyFinished"
    with pytest.raises(AlreadyFinishedError):
        procs.signal(info.id, pid, "TERM")
    with pytest.raises(NotFoundError):
        procs.stdin(info.id, "exe_nosuchprocess", b"x")
    with pytest.raises(NotFoundError):
        procs.signal(info.id, "exe_nosuchprocess", "KILL")


def test_signals(session: tuple[Client, SessionInfo]) -> None:
    c, info = session
    procs = c.sessions.processes
    started = procs.start(info.id, SLEEPER, timeout_ms=DEADLINE_MS)
    pid = started.process_id
    stdout = ""
    result: ResultEvent | None = None
    for event in procs.stream(info.id, pid):
        if isinstance(event, OutputEvent) and event.stream == "stdout":
            stdout += event.text
            if stdout == "sleeping\n":
                with pytest.raises(InvalidRequestError) as bad:
                    procs.signal(info.id, pid, "STOP")
                assert bad.value.status == 400
                assert _entry(procs.list(info.id), pid).state == "running"
                procs.signal(info.id, pid, "KILL")
        elif isinstance(event, ResultEvent):
            result = event
    assert stdout == "sleeping\n"
    assert result is not None and isinstance(result.result, ExecutionResult)
    assert result.result.exit_code != 0

    ended = _wait_ended(lambda: procs.list(info.id), pid)
    assert ended.exit_code != 0
    with pytest.raises(AlreadyFinishedError):
        procs.signal(info.id, pid, "KILL")


def test_processes_past_the_limit_are_refused(daemon: Daemon, tenant: str) -> None:
    # The daemon's sessions.max_processes (8 in config/executor-arm.toml): processes are started
    # until one is refused, well before this bound.
    bound = 64
    with daemon.client(tenant=tenant, retry=RetryPolicy.none()) as c:
        info = c.sessions.create("python", ttl_seconds=600)
        try:
            pids: list[str] = []
            over: RateLimitedError | None = None
            while over is None and len(pids) < bound:
                try:
                    started = c.sessions.processes.start(info.id, SLEEPER, timeout_ms=DEADLINE_MS)
                except RateLimitedError as e:
                    over = e
                else:
                    pids.append(started.process_id)
            assert over is not None, f"{bound} processes started without a 429"
            assert pids, "the first process was refused"
            assert over.status == 429 and over.error_type == "Overloaded"
            assert "sessions.max_processes" in over.message
            running = [p for p in c.sessions.processes.list(info.id) if p.running]
            assert sorted(p.process_id for p in running) == sorted(pids)
        finally:
            c.sessions.delete(info.id)


def test_async_processes(daemon: Daemon, tenant: str) -> None:
    async def main() -> None:
        async with _async_client(daemon, tenant) as arm:
            info = await arm.sessions.create("python", ttl_seconds=600)
            procs = arm.sessions.processes
            try:
                started = await procs.start(info.id, ECHO, timeout_ms=DEADLINE_MS)
                _check_started(started, info.id)
                pid = started.process_id
                echo = _Echo()
                events: AsyncIterator[Event] = procs.stream(info.id, pid)
                async for event in events:
                    step = echo.see(event)
                    if step == "send":
                        await procs.stdin(info.id, pid, b"hello\nworld\n")
                    elif step == "eof":
                        await procs.stdin(info.id, pid, b"", eof=True)
                echo.check()
                ended = await _await_ended(lambda: procs.list(info.id), pid)
                assert ended.exit_code == 0
                with pytest.raises(AlreadyFinishedError):
                    await procs.stdin(info.id, pid, b"late\n")

                sleeper = await procs.start(info.id, SLEEPER, timeout_ms=DEADLINE_MS)
                seen = ""
                result: ResultEvent | None = None
                async for event in procs.stream(info.id, sleeper.process_id, framing="lines"):
                    if isinstance(event, OutputEvent) and event.stream == "stdout":
                        seen += event.text
                        if event.text == "sleeping\n":
                            with pytest.raises(InvalidRequestError):
                                await procs.signal(info.id, sleeper.process_id, "STOP")
                            await procs.signal(info.id, sleeper.process_id, "KILL")
                    elif isinstance(event, ResultEvent):
                        result = event
                assert seen == "sleeping\n" and result is not None
                killed = await _await_ended(lambda: procs.list(info.id), sleeper.process_id)
                assert killed.state == "exited" and killed.exit_code != 0
                with pytest.raises(AlreadyFinishedError):
                    await procs.signal(info.id, sleeper.process_id, "TERM")
            finally:
                await arm.sessions.delete(info.id)

    asyncio.run(main())


def test_an_async_exec_takes_stdin_while_it_runs(
    session: tuple[Client, SessionInfo],
) -> None:
    c, info = session
    accepted = c.sessions.exec(
        info.id, ECHO, stdin="first\n", async_=True, stdin_open=True, timeout_ms=DEADLINE_MS
    )
    c.sessions.exec_stdin(info.id, accepted.exec_id, "second\n")
    c.sessions.exec_stdin(info.id, accepted.exec_id, b"", eof=True)
    deadline = time.monotonic() + WAIT_S
    while True:
        status = c.sessions.get_exec(info.id, accepted.exec_id)
        if status.status == "finished" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status.status == "finished"
    assert isinstance(status.result, ExecutionResult)
    assert status.result.stdout == "ready\ngot: first\ngot: second\nbye\n"
    with pytest.raises(AlreadyFinishedError):
        c.sessions.exec_stdin(info.id, accepted.exec_id, "late\n")
    other = c.sessions.exec(info.id, SLEEPER, async_=True, timeout_ms=DEADLINE_MS)
    with pytest.raises(StdinClosedError):
        c.sessions.exec_stdin(info.id, other.exec_id, "x")
    c.sessions.cancel_exec(info.id, other.exec_id, grace_seconds=0)
