"""executor-arm's E2B-compatible API driven by the official E2B Python SDK (`e2b` on PyPI), unchanged:
tests/e2b.rs starts a daemon with `[e2b] envd_listen` set and runs this file with pytest in the venv of
scripts/e2b-sdk-venv.sh, once per pinned SDK version (a current 2.x and one about a year older).

Environment (set by tests/e2b.rs), read by the SDK itself:
  E2B_API_URL      the control plane, http://<daemon>/e2b
  E2B_SANDBOX_URL  the envd endpoint, http://<envd_listen>
  E2B_API_KEY      a service token (JWT) of one service subject
and by this file:
  E2B_OTHER_API_KEY  a service token of another service subject
  E2B_WORKDIR        the sandbox home, where relative paths resolve (default /workspace)

Every wait is bounded: the SDK's request and stream timeouts, polling loops with deadlines, and
pytest-timeout around each test.
"""

import os
import time
from datetime import datetime, timezone

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
)

OTHER_KEY = os.environ["E2B_OTHER_API_KEY"]
WORKDIR = os.environ.get("E2B_WORKDIR", "/workspace")
for var in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
    assert os.environ.get(var), f"{var} is not set"

# Bounds of the waits below, in seconds.
STREAM = 30  # a command's stream (the SDK's `timeout`)
POLL = 20  # a state the server reaches by itself (a killed process leaving the list, …)


def state(info) -> str:
    """`running` / `paused`: the SDK's SandboxState enum, as its wire value."""
    return getattr(info.state, "value", info.state)


def until(what: str, check, limit: float = POLL):
    """Polls `check()` until it returns a truthy value (returned), failing after `limit` seconds."""
    deadline = time.monotonic() + limit
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"not within {limit}s: {what}")
        time.sleep(0.1)


def listed(**opts) -> dict:
    """Every sandbox Sandbox.list() pages through (both states), by id."""
    paginator = Sandbox.list(**opts)
    found = {}
    for _ in range(100):
        if not paginator.has_next:
            return found
        for info in paginator.next_items():
            found[info.sandbox_id] = info
    pytest.fail("Sandbox.list() had more than 100 pages")


def pause(sbx: Sandbox):
    """`pause()` (current SDKs) or `beta_pause()` (2.7)."""
    return sbx.pause() if hasattr(sbx, "pause") else sbx.beta_pause()


def pause_id(sandbox_id: str):
    return Sandbox.pause(sandbox_id) if hasattr(Sandbox, "pause") else Sandbox.beta_pause(sandbox_id)


def pids(sbx: Sandbox) -> set:
    return {p.pid for p in sbx.commands.list()}


@pytest.fixture(scope="module")
def sbx():
    s = Sandbox.create()
    try:
        yield s
    finally:
        s.kill()


def test_create(sbx):
    assert sbx.sandbox_id
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.template_id
    assert state(info) == "running"
    assert sbx.is_running()


def test_run_echo(sbx):
    r = sbx.commands.run("echo hi", timeout=STREAM)
    assert r.exit_code == 0
    assert r.stdout == "hi\n"
    assert r.stderr == ""


def test_run_in_home(sbx):
    r = sbx.commands.run("pwd; echo $HOME", timeout=STREAM)
    assert r.stdout == f"{WORKDIR}\n{WORKDIR}\n"


def test_run_envs_and_cwd(sbx):
    # TZ is a name the template's profile lets a run set.
    r = sbx.commands.run('echo "$TZ"; pwd', envs={"TZ": "UTC0"}, cwd="/tmp", timeout=STREAM)
    assert r.stdout == "UTC0\n/tmp\n"


def test_an_env_the_profile_refuses_is_an_error(sbx):
    # envs pass through the profile's environment filter: LD_PRELOAD is never let through.
    with pytest.raises(Exception) as e:
        sbx.commands.run("true", envs={"LD_PRELOAD": "/x.so"}, timeout=STREAM)
    assert "LD_PRELOAD" in str(e.value)


def test_failing_command_raises_with_exit_code(sbx):
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo out; echo oops >&2; exit 3", timeout=STREAM)
    assert e.value.exit_code == 3
    assert e.value.stdout == "out\n"
    assert e.value.stderr == "oops\n"


def test_background_connect_and_kill(sbx):
    h = sbx.commands.run(
        "for i in $(seq 1 600); do echo line$i; sleep 0.1; done",
        background=True,
        timeout=STREAM,
    )
    pid = h.pid
    assert pid > 0
    # The SDK stops listening; the command goes on.
    h.disconnect()
    assert pid in pids(sbx)

    c = sbx.commands.connect(pid, timeout=STREAM)
    assert c.pid == pid
    seen = ""
    for stdout, _stderr, _pty in c:
        seen += stdout or ""
        if "line" in seen and seen.endswith("\n"):
            break
    assert "line" in seen, seen

    assert sbx.commands.kill(pid) is True
    # The killed command's stream ends with its end event: a non-zero (signal) exit.
    with pytest.raises(CommandExitException) as e:
        c.wait()
    assert e.value.exit_code != 0
    until(f"pid {pid} leaves commands.list()", lambda: pid not in pids(sbx))
    # Gone: killing it again finds nothing.
    assert sbx.commands.kill(pid) is False


def test_send_stdin(sbx):
    h = sbx.commands.run("head -n1", background=True, stdin=True, timeout=STREAM)
    sbx.commands.send_stdin(h.pid, "hello stdin\n")
    r = h.wait()
    assert r.exit_code == 0
    assert r.stdout == "hello stdin\n"


def read_stdout_until(h, seen: str, suffix: str) -> str:
    """`seen` and the command's stdout read after it, until it ends with `suffix` (or the
    stream ends: the stream's own timeout bounds the wait)."""
    for stdout, _stderr, _pty in h:
        seen += stdout or ""
        if seen.endswith(suffix):
            break
    return seen


def test_send_stdin_to_cat(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True, timeout=STREAM)
    sbx.commands.send_stdin(h.pid, "first\n")
    seen = read_stdout_until(h, "", "first\n")
    assert seen == "first\n"
    sbx.commands.send_stdin(h.pid, "second\n")  # str: 2.7 takes no bytes
    seen = read_stdout_until(h, seen, "second\n")
    assert seen == "first\nsecond\n"
    assert h.kill() is True
    with pytest.raises(CommandExitException):
        h.wait()


def read_pty_until(h, seen: bytearray, marker: bytes):
    """Reads the PTY's output into `seen` until `marker` is in it (the stream's own timeout
    bounds the wait)."""
    if marker in seen:
        return
    for _stdout, _stderr, pty in h:
        seen += pty or b""
        if marker in seen:
            return
    try:
        how = h.wait()
    except CommandExitException as e:
        how = e
    pytest.fail(f"the PTY ended ({how!r}) before {marker!r}: {bytes(seen)!r}")


def test_pty_types_resizes_and_exits(sbx):
    sbx.files.write("ptydir/x", "")
    h = sbx.pty.create(PtySize(rows=30, cols=100), cwd="ptydir", envs={"TZ": "UTC0"}, timeout=STREAM)
    assert h.pid > 0
    assert h.pid in pids(sbx)
    seen = bytearray()
    # The terminal's first size, its directory, its environment, and that it is one.
    # (What is typed is echoed: each marker is one only the command's output holds.)
    sbx.pty.send_stdin(h.pid, b"stty size; pwd; echo tz=$TZ; test -t 0 && echo tty-$((1+1))\n")
    read_pty_until(h, seen, b"tty-2\r\n")
    assert b"30 100\r\n" in seen, bytes(seen)
    assert f"{WORKDIR}/ptydir\r\n".encode() in seen, bytes(seen)
    assert b"tz=UTC0\r\n" in seen, bytes(seen)

    sbx.pty.resize(h.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(h.pid, b"stty size\n")
    read_pty_until(h, seen, b"40 120\r\n")

    # Its shell's own exit ends it, with the exit code.
    sbx.pty.send_stdin(h.pid, b"exit 3\n")
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code == 3
    until(f"pty {h.pid} leaves commands.list()", lambda: h.pid not in pids(sbx))
    with pytest.raises(NotFoundException):
        sbx.pty.send_stdin(h.pid, b"echo gone\n")
    sbx.files.remove("ptydir")


def test_pty_connect_and_kill(sbx):
    h = sbx.pty.create(PtySize(rows=24, cols=80), timeout=STREAM)
    pid = h.pid
    h.disconnect()
    # Still there without its first caller: another connects and types into it.
    # (2.7's Pty has no connect: its commands.connect follows a PTY as well.)
    connect = getattr(sbx.pty, "connect", sbx.commands.connect)
    c = connect(pid, timeout=STREAM)
    sbx.pty.send_stdin(pid, b"echo re$((1+1))attached\n")
    read_pty_until(c, bytearray(), b"re2attached")
    assert sbx.pty.kill(pid) is True
    with pytest.raises(CommandExitException):
        c.wait()
    until(f"pty {pid} leaves commands.list()", lambda: pid not in pids(sbx))
    assert sbx.pty.kill(pid) is False


def test_stream_input(sbx):
    if not hasattr(sbx.commands, "stream_input"):
        pytest.skip("this SDK version has no stream_input (a client stream of input)")
    h = sbx.commands.run("cat", background=True, stdin=True, timeout=STREAM)
    sbx.commands.stream_input(h.pid, ["one\n", b"two\n"], timeout=STREAM)
    assert read_stdout_until(h, "", "two\n") == "one\ntwo\n"
    assert h.kill() is True

    p = sbx.pty.create(PtySize(rows=24, cols=80), timeout=STREAM)
    sbx.pty.stream_input(p.pid, [b"echo str", b"eamed-$((4+4))\n"], timeout=STREAM)
    read_pty_until(p, bytearray(), b"streamed-8\r\n")
    assert sbx.pty.kill(p.pid) is True
    # Input for a process that is gone is refused.
    until(f"pty {p.pid} leaves commands.list()", lambda: p.pid not in pids(sbx))
    with pytest.raises(NotFoundException):
        sbx.pty.stream_input(p.pid, [b"late\n"], timeout=STREAM)


def test_files(sbx):
    info = sbx.files.write("notes/a.txt", "hello")
    assert info.path == f"{WORKDIR}/notes/a.txt"
    assert info.name == "a.txt"
    assert sbx.files.read("notes/a.txt") == "hello"
    assert sbx.files.read(f"{WORKDIR}/notes/a.txt") == "hello"
    # The files API and the commands share the sandbox's home.
    assert sbx.commands.run("cat notes/a.txt", timeout=STREAM).stdout == "hello"
    assert sbx.files.exists("notes/a.txt")
    assert not sbx.files.exists("notes/missing.txt")

    # Overwrite, and bytes that are not UTF-8.
    blob = bytes(range(256)) * 4
    sbx.files.write("notes/a.txt", blob)
    assert bytes(sbx.files.read("notes/a.txt", format="bytes")) == blob
    sbx.files.write("notes/a.txt", "hello")

    assert sbx.files.make_dir("d1") is True
    assert sbx.files.make_dir("d1") is False  # already there
    assert sbx.files.make_dir("d1/x/y") is True  # with its parents

    top = {e.name: e for e in sbx.files.list(WORKDIR)}
    assert top["notes"].type == FileType.DIR
    assert top["d1"].type == FileType.DIR
    assert top["d1"].path == f"{WORKDIR}/d1"
    entries = sbx.files.list("notes")
    assert [(e.name, e.type, e.path, e.size) for e in entries] == [
        ("a.txt", FileType.FILE, f"{WORKDIR}/notes/a.txt", 5)
    ]
    assert isinstance(entries[0].modified_time, datetime)

    moved = sbx.files.rename("notes/a.txt", "d1/b.txt")
    assert moved.name == "b.txt"
    assert moved.path == f"{WORKDIR}/d1/b.txt"
    assert not sbx.files.exists("notes/a.txt")
    assert sbx.files.read("d1/b.txt") == "hello"
    got = sbx.files.get_info("d1/b.txt")
    assert (got.type, got.size) == (FileType.FILE, 5)

    sbx.files.remove("d1/b.txt")
    assert not sbx.files.exists("d1/b.txt")
    with pytest.raises(NotFoundException):
        sbx.files.read("d1/b.txt")
    sbx.files.remove("d1")  # a directory, with what is in it
    assert not sbx.files.exists("d1")
    assert not sbx.files.exists("d1/x/y")


def test_timeout_info_and_list(sbx):
    sbx.set_timeout(120)
    info = sbx.get_info()
    now = datetime.now(timezone.utc)
    assert info.started_at <= now
    left = (info.end_at - now).total_seconds()
    assert 60 < left <= 130, left
    assert info.envd_version
    assert sbx.sandbox_id in listed()
    assert state(listed()[sbx.sandbox_id]) == "running"


def test_another_service_cannot_reach_the_sandbox(sbx):
    sid = sbx.sandbox_id
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sid, api_key=OTHER_KEY)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sid, api_key=OTHER_KEY)
    assert Sandbox.kill(sid, api_key=OTHER_KEY) is False
    assert sid not in listed(api_key=OTHER_KEY)
    # Still there, untouched, for its own service.
    assert state(Sandbox.get_info(sid)) == "running"
    assert sbx.commands.run("echo still", timeout=STREAM).stdout == "still\n"


def test_pause_connect_kill():
    s = Sandbox.create()
    sid = s.sandbox_id
    try:
        s.files.write("keep.txt", "kept")
        s.commands.run("echo more >> keep.txt", timeout=STREAM)
        pause(s)
        assert state(Sandbox.get_info(sid)) == "paused"
        assert state(listed()[sid]) == "paused"

        # Sandbox.connect(id) resumes it: a new object, as another process would make.
        s2 = Sandbox.connect(sid)
        assert s2.sandbox_id == sid
        assert state(Sandbox.get_info(sid)) == "running"
        assert s2.files.read("keep.txt") == "kept" + "more\n"
        assert s2.commands.run("cat keep.txt", timeout=STREAM).stdout == "keptmore\n"

        # Paused by id, resumed by the first object's connect().
        pause_id(sid)
        assert state(Sandbox.get_info(sid)) == "paused"
        s.connect()
        assert state(Sandbox.get_info(sid)) == "running"
        assert s.commands.run("cat keep.txt", timeout=STREAM).stdout == "keptmore\n"

        assert s2.kill() in (True, None)
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sid)
        assert Sandbox.kill(sid) is False
        assert sid not in listed()
        # envd refuses a killed sandbox (the SDK's mapping of the answer varies by version).
        with pytest.raises((SandboxException, AuthenticationException)):
            s.commands.run("echo gone", timeout=STREAM, request_timeout=STREAM)
    finally:
        Sandbox.kill(sid)


def test_list_pages_through_every_sandbox():
    # One sandbox a page: Sandbox.list() follows X-Next-Token through all of them, none lost
    # (ids are random: the pages follow creation order, not id order).
    made = [Sandbox.create() for _ in range(4)]
    try:
        ids = {s.sandbox_id for s in made}
        try:
            found = listed(limit=1)
        except TypeError:  # an SDK whose list() takes no limit
            found = listed()
        assert ids <= set(found), (ids, sorted(found))
    finally:
        for s in made:
            s.kill()


def test_a_large_file_round_trips(sbx):
    # Past the 2 MiB a multipart body extractor would take by default; under
    # sessions.max_file_bytes.
    data = bytes(range(256)) * (3 * 4096)
    sbx.files.write("big.bin", data)
    assert sbx.files.read("big.bin", format="bytes") == data


def test_metrics_see_the_sandbox_working(sbx):
    # 32 MiB in the workspace and a busy loop: the sample shows the disk and CPU they take.
    sbx.commands.run("head -c 33554432 /dev/zero > fill.bin", timeout=STREAM)
    busy = sbx.commands.run("while :; do :; done", background=True, timeout=STREAM)
    try:
        def sample():
            got = sbx.get_metrics()
            m = got[-1] if got else None
            return m if m and m.cpu_used_pct > 0 else None

        m = until("a metrics sample with CPU in use", sample)
        assert m.cpu_count >= 1
        assert m.disk_used >= 32 << 20, m
        assert m.disk_total >= m.disk_used, m
        assert 0 < m.mem_used, m
        assert m.mem_total > 0, m
    finally:
        busy.kill()
        sbx.files.remove("fill.bin")
