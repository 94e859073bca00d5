"""Async runs, streams and cancels against the real daemon."""

from __future__ import annotations

import json
import time

import pytest

from executor_arm_client import (
    AlreadyFinishedError,
    Client,
    ExecutionResult,
    NotFoundError,
    OutputEvent,
    ResultEvent,
    RunAccepted,
    StartEvent,
    answer_of,
)


def _wait_finished(client: Client, exec_id: str, timeout: float = 30) -> ExecutionResult:
    return client.wait(exec_id, poll_interval=0.2, timeout=timeout)


def test_submit_get_stream_cancel_a_sleep(client: Client) -> None:
    accepted = client.submit("sleep", ["60"], timeout_seconds=120)
    assert isinstance(accepted, RunAccepted)
    assert accepted.status == "running"
    assert accepted.links.self_ == f"/v1/executions/{accepted.exec_id}"
    assert accepted.links.stream.endswith("/stream")
    assert accepted.links.cancel.endswith("/cancel")

    status = client.get(accepted.exec_id)
    assert status.exec_id == accepted.exec_id
    assert status.status == "running" and status.result is None

    events = client.stream(accepted.exec_id)
    first = next(events)
    assert isinstance(first, StartEvent)
    assert first.exec_id == accepted.exec_id and first.backend == "local"

    cancelled = client.cancel(accepted.exec_id, grace_seconds=1)
    assert cancelled.exec_id == accepted.exec_id
    assert cancelled.status == "cancelling" and cancelled.grace_seconds == 1

    rest = list(events)
    assert rest and isinstance(rest[-1], ResultEvent)
    final = rest[-1]
    assert final.http_status == 200
    assert isinstance(final.result, ExecutionResult)
    assert final.result.outcome == "cancelled"
    assert final.result.killed_reason == "cancelled"
    assert final.result.success is False

    status = client.get(accepted.exec_id)
    assert status.finished and status.http_status == 200
    assert answer_of(status).outcome == "cancelled"
    with pytest.raises(AlreadyFinishedError) as info:
        client.cancel(accepted.exec_id)
    assert info.value.status == 409 and info.value.error_type == "AlreadyFinished"


def test_execute_stream_events(client: Client) -> None:
    code = (
        "import time\nfor i in range(3):\n    print(f'line {i}', flush=True)\n    time.sleep(0.2)"
    )
    events = list(client.execute_stream("python3", ["-c", code], action_type="python"))
    assert isinstance(events[0], StartEvent)
    assert isinstance(events[-1], ResultEvent)
    output = [e for e in events if isinstance(e, OutputEvent)]
    assert all(e.stream == "stdout" for e in output)
    assert "".join(e.text for e in output) == "line 0\nline 1\nline 2\n"
    offsets = [e.offset for e in output]
    assert offsets == sorted(offsets) and offsets[0] == 0
    result = events[-1].result
    assert isinstance(result, ExecutionResult)
    assert result.exec_id == events[0].exec_id
    assert result.stdout == "line 0\nline 1\nline 2\n"


def test_stream_resumes_from_last_event_id(client: Client) -> None:
    result = client.execute("echo", ["resume me"])
    events = list(client.stream(result.exec_id))
    assert [type(e) for e in events] == [StartEvent, OutputEvent, ResultEvent]
    assert isinstance(events[1], OutputEvent) and events[1].text == "resume me\n"
    resumed = list(client.stream(result.exec_id, last_event_id=events[1].id))
    assert not any(isinstance(e, OutputEvent) for e in resumed)
    assert isinstance(resumed[-1], ResultEvent)
    assert resumed[-1].result == result


JSON_LINES = (
    "import os, time\n"
    "os.write(1, b'{\"a\":1}\\n{\"a\"')\n"
    "time.sleep(0.3)\n"
    "os.write(1, b':2}\\n{\"b\":')\n"
    "time.sleep(0.3)\n"
    "os.write(1, b'3}')"
)


def test_lines_framing_gives_one_event_per_line(client: Client) -> None:
    events = list(
        client.execute_stream("python3", ["-c", JSON_LINES], action_type="python", framing="lines")
    )
    output = [e for e in events if isinstance(e, OutputEvent)]
    assert [(e.text, e.partial) for e in output] == [
        ('{"a":1}\n', False),
        ('{"a":2}\n', False),
        ('{"b":3}', True),
    ]
    assert [json.loads(e.text) for e in output] == [{"a": 1}, {"a": 2}, {"b": 3}]
    result = events[-1]
    assert isinstance(result, ResultEvent) and isinstance(result.result, ExecutionResult)
    # Resumed after the first line, still in lines: the rest, line by line.
    resumed = list(client.stream(result.result.exec_id, last_event_id=output[0].id, framing="lines"))
    assert [e.text for e in resumed if isinstance(e, OutputEvent)] == ['{"a":2}\n', '{"b":3}']


def test_an_unknown_framing_is_refused_before_sending(client: Client) -> None:
    with pytest.raises(ValueError, match="framing"):
        list(client.stream("exec-00000000000000000000000000000000", framing="words"))  # type: ignore[arg-type]


def test_async_run_result_via_get(client: Client) -> None:
    accepted = client.submit("python3", ["-c", "print(6 * 7)"], action_type="python")
    result = _wait_finished(client, accepted.exec_id)
    assert result.stdout == "42\n" and result.exec_id == accepted.exec_id


def test_unknown_run_is_not_found(client: Client) -> None:
    with pytest.raises(NotFoundError) as info:
        client.get("exec-00000000000000000000000000000000")
    assert info.value.status == 404 and info.value.error_type == "NotFound"
    with pytest.raises(NotFoundError):
        client.cancel("exec-00000000000000000000000000000000")
    with pytest.raises(NotFoundError):
        list(client.stream("exec-00000000000000000000000000000000"))


def test_another_service_cannot_see_a_run(client: Client, daemon: object) -> None:
    from conftest import Daemon

    from executor_arm_client import mint_hs256, read_secret_file

    assert isinstance(daemon, Daemon)
    accepted = client.submit("sleep", ["30"], timeout_seconds=60)
    try:
        other = mint_hs256(read_secret_file(daemon.secret_file), kind="service", sub="other")
        with daemon.client(service_token=other) as c, pytest.raises(NotFoundError):
            c.get(accepted.exec_id)
    finally:
        client.cancel(accepted.exec_id, grace_seconds=0)
    deadline = time.monotonic() + 30
    while not client.get(accepted.exec_id).finished:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_output_that_is_not_utf8(client: Client) -> None:
    code = "import sys; sys.stdout.buffer.write(b'ok\\xff\\xfe'); sys.stdout.flush()"
    events = list(client.execute_stream("python3", ["-c", code], action_type="python"))
    output = b"".join(e.bytes for e in events if isinstance(e, OutputEvent))
    assert output == b"ok\xff\xfe"
    result = events[-1]
    assert isinstance(result, ResultEvent) and isinstance(result.result, ExecutionResult)
    assert result.result.stdout_b64 is not None
    assert result.result.stdout_bytes == b"ok\xff\xfe"
