"""A session's terminal against the real daemon (local backend): what is typed runs in the
session's shell, a resize reaches ``stty size``, closing hangs it up (the session lists its
process as exited), and the refusals (another tenant: 404; a text frame that is not a resize:
close 1003). The daemon's own tests cover the rest (tests/session_terminal.rs)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from conftest import Daemon

from executor_arm_client import (
    Client,
    NotFoundError,
    SessionInfo,
    Terminal,
    TerminalClosed,
)

#: How long a test waits for a line of the terminal, or for its process to end.
WAIT_S = 30.0


@pytest.fixture
def session(daemon: Daemon) -> Iterator[tuple[Client, SessionInfo]]:
    with daemon.client(tenant=f"tenant-{uuid.uuid4().hex[:8]}") as c:
        info = c.sessions.create("python", ttl_seconds=600)
        try:
            yield c, info
        finally:
            try:
                c.sessions.delete(info.id)
            except NotFoundError:
                pass


def read_line(t: Terminal, line: str, seen: bytearray) -> None:
    """Reads the terminal until one of its lines is ``line`` (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        lines = seen.decode(errors="replace").replace("\r", "\n").split("\n")
        if any(x.strip() == line for x in lines):
            return
        left = deadline - time.monotonic()
        assert left > 0, f"no line {line!r} in the terminal; it showed {seen!r}"
        seen += t.recv(timeout=left)


def test_a_terminal_runs_resizes_and_hangs_up(session: tuple[Client, SessionInfo]) -> None:
    c, info = session
    seen = bytearray()
    with c.sessions.terminal(info.id) as t:
        t.send("echo $((6*7))\n")
        read_line(t, "42", seen)
        t.resize(100, 30)
        t.send(b"stty size\n")
        read_line(t, "30 100", seen)
        procs = c.sessions.processes.list(info.id)
        assert [p.state for p in procs] == ["running"]
    deadline = time.monotonic() + WAIT_S
    while c.sessions.processes.list(info.id)[0].state != "exited":
        assert time.monotonic() < deadline, "the terminal's process never ended"
        time.sleep(0.1)


def test_a_terminal_is_refused_as_a_session_route_refuses(
    daemon: Daemon, session: tuple[Client, SessionInfo]
) -> None:
    c, info = session
    with daemon.client(tenant="someone-else") as other, pytest.raises(NotFoundError):
        other.sessions.terminal(info.id)
    with c.sessions.terminal(info.id) as t:
        t._ws.send('{"resize": {"cols": 0, "rows": 1}}')
        with pytest.raises(TerminalClosed) as closed:
            while True:
                t.recv(timeout=WAIT_S)
        assert closed.value.code == 1003
