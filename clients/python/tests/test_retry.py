"""The retry policy, against scripted answers (httpx.MockTransport): the daemon cannot be made
to answer 503 on demand. Retries happen for ``retryable`` errors only, keep the Idempotency-Key,
honour Retry-After and stop at max_attempts; a proxy's error page repeats only a call that is
safe to repeat; a server that does not stream, or streams garbage, gets a ProtocolError."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from executor_arm_client import (
    AsyncClient,
    CapabilityViolationError,
    Client,
    ExecutorArmError,
    InternalServerError,
    ProtocolError,
    RateLimitedError,
    RetryPolicy,
    TransportError,
    UnavailableError,
)

RESULT = {
    "success": True,
    "stdout": "ok\n",
    "stderr": "",
    "exit_code": 0,
    "duration_ms": 1,
    "exec_id": "exec-1",
    "outcome": "success",
    "backend": "local",
    "profile": "p",
    "stdout_truncated": False,
    "stderr_truncated": False,
    "oom": False,
    "provenance": {
        "arm_id": "executor",
        "timestamp": "t",
        "action_type": "shell",
        "command_hash": "h",
        "capabilities_used": [],
        "exec_id": "exec-1",
        "request_id": "r",
        "backend": "local",
        "profile": "p",
        "invocation_hash": "i",
        "stdout_sha256": "s",
        "stderr_sha256": "e",
    },
}


def error(
    status: int, error_type: str, retryable: bool, retry_after: str | None = None
) -> httpx.Response:
    headers = {"X-Request-ID": f"req-{status}"}
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    body = {
        "success": False,
        "error": f"{error_type} happened",
        "error_type": error_type,
        "retryable": retryable,
    }
    return httpx.Response(status, json=body, headers=headers)


class Script:
    """Answers requests from a list, and records them."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def sync_client(script: Script, policy: RetryPolicy, delays: list[float]) -> Client:
    c = Client(
        "http://arm.test",
        service_token="svc",
        capability_token="cap",
        retry=policy,
        transport=httpx.MockTransport(script),
    )
    c._sleep = delays.append  # type: ignore[method-assign,assignment]
    return c


POLICY = RetryPolicy(max_attempts=4, initial_backoff=0.1, max_backoff=1.0, rng=random.Random(7))


def test_retryable_503_is_retried_with_the_same_idempotency_key() -> None:
    script = Script(
        error(503, "SandboxUnavailable", True, "5"),
        error(429, "Overloaded", True, "1"),
        httpx.Response(200, json=RESULT),
    )
    delays: list[float] = []
    result = sync_client(script, POLICY, delays).execute("echo", ["ok"])
    assert result.stdout == "ok\n"
    assert len(script.requests) == 3
    keys = {r.headers["Idempotency-Key"] for r in script.requests}
    assert len(keys) == 1 and keys.pop().startswith("py-")
    bodies = {r.content for r in script.requests}
    assert len(bodies) == 1
    assert [r.headers["X-Capability-Token"] for r in script.requests] == ["cap"] * 3
    assert [r.headers["Authorization"] for r in script.requests] == ["Bearer svc"] * 3
    # Retry-After is a floor under the backoff.
    assert delays[0] >= 5 and delays[1] >= 1
    assert len(delays) == 2


def test_non_retryable_errors_are_raised_at_once() -> None:
    for answer, cls in [
        (error(403, "CapabilityViolation", False), CapabilityViolationError),
        # The body's verdict wins over the status: a 500 the daemon marks final is final.
        (error(500, "InternalError", False), InternalServerError),
    ]:
        script = Script(answer)
        delays: list[float] = []
        with pytest.raises(cls) as info:
            sync_client(script, POLICY, delays).execute("echo", ["x"])
        assert len(script.requests) == 1 and delays == []
        assert info.value.retryable is False
        assert info.value.request_id == f"req-{answer.status_code}"


def test_attempts_are_bounded() -> None:
    script = Script(*[error(503, "SandboxUnavailable", True, "0") for _ in range(10)])
    delays: list[float] = []
    with pytest.raises(UnavailableError) as info:
        sync_client(script, POLICY, delays).execute("echo", ["x"])
    assert len(script.requests) == POLICY.max_attempts
    assert len(delays) == POLICY.max_attempts - 1
    assert info.value.retry_after == 0.0 and info.value.status == 503
    assert info.value.error_type == "SandboxUnavailable" and info.value.retryable is True


def test_idempotency_in_progress_is_retried() -> None:
    script = Script(
        error(409, "IdempotencyInProgress", True, "1"), httpx.Response(200, json=RESULT)
    )
    delays: list[float] = []
    assert sync_client(script, POLICY, delays).execute("echo", ["x"]).exec_id == "exec-1"
    assert len(script.requests) == 2 and delays[0] >= 1


def test_no_retry_policy() -> None:
    script = Script(error(429, "Overloaded", True, "1"))
    delays: list[float] = []
    with pytest.raises(RateLimitedError):
        sync_client(script, RetryPolicy.none(), delays).execute("echo", ["x"])
    assert len(script.requests) == 1 and delays == []


def test_connection_refused_is_retried_but_not_a_broken_post() -> None:
    def req() -> httpx.Request:
        return httpx.Request("POST", "http://arm.test/execute")

    script = Script(httpx.ConnectError("refused", request=req()), httpx.Response(200, json=RESULT))
    delays: list[float] = []
    assert sync_client(script, POLICY, delays).execute("echo", ["x"]).success
    assert len(script.requests) == 2

    # The request may have reached the daemon: a POST is not sent again.
    script = Script(httpx.ReadError("reset", request=req()))
    with pytest.raises(TransportError) as info:
        sync_client(script, POLICY, delays).cancel("exec-1")
    assert info.value.retryable is False and info.value.status is None
    assert len(script.requests) == 1

    # A GET only reads: it is.
    status = {"exec_id": "exec-1", "status": "running"}
    script = Script(httpx.ReadError("reset", request=req()), httpx.Response(200, json=status))
    assert sync_client(script, POLICY, delays).get("exec-1").status == "running"
    assert len(script.requests) == 2


def test_backoff_grows_and_is_capped() -> None:
    policy = RetryPolicy(initial_backoff=1.0, max_backoff=4.0, multiplier=2.0, rng=random.Random(1))
    for retry, (low, high) in enumerate([(0.5, 1.0), (1.0, 2.0), (2.0, 4.0), (2.0, 4.0)], 1):
        for _ in range(50):
            assert low <= policy.delay(retry) <= high
    assert policy.delay(1, retry_after=3.0) >= 3.0
    assert policy.delay(1, retry_after=1000.0) == policy.max_retry_after
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_async_client_retries_the_same_way() -> None:
    script = Script(
        error(503, "SandboxUnavailable", True, "2"), error(400, "InvalidRequest", False)
    )
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    async def main() -> None:
        c = AsyncClient(
            "http://arm.test",
            service_token="svc",
            retry=POLICY,
            transport=httpx.MockTransport(script),
        )
        c._sleep = sleep  # type: ignore[method-assign]
        with pytest.raises(Exception) as info:
            await c.get("exec-1")
        assert type(info.value).__name__ == "InvalidRequestError"
        await c.aclose()

    asyncio.run(main())
    assert len(script.requests) == 2 and delays[0] >= 2


def test_stream_opening_is_retried_and_a_replayed_stream_is_followed() -> None:
    sse = (
        'event: start\nid: 0.0\ndata: {"exec_id":"exec-1","backend":"local","profile":"p"}\n\n'
        ": heartbeat\n\n"
        'event: stdout\nid: 3.0\ndata: {"offset":0,"data":"ok\\n"}\n\n'
        f"event: result\nid: 3.0\ndata: {json.dumps({'http_status': 200, **RESULT})}\n\n"
    )
    accepted = {
        "exec_id": "exec-1",
        "status": "running",
        "links": {
            "self": "/v1/executions/exec-1",
            "stream": "/v1/executions/exec-1/stream",
            "cancel": "/v1/executions/exec-1/cancel",
        },
    }
    script = Script(
        error(503, "SandboxUnavailable", True, "0"),
        # The retried POST was stored: the daemon replays the run's 202.
        httpx.Response(202, json=accepted),
        httpx.Response(200, text=sse, headers={"Content-Type": "text/event-stream"}),
    )
    delays: list[float] = []
    events = list(sync_client(script, POLICY, delays).execute_stream("echo", ["ok"]))
    assert [type(e).__name__ for e in events] == ["StartEvent", "OutputEvent", "ResultEvent"]
    assert [r.url.path for r in script.requests] == [
        "/execute",
        "/execute",
        "/v1/executions/exec-1/stream",
    ]
    assert (
        script.requests[0].headers["Idempotency-Key"]
        == script.requests[1].headers["Idempotency-Key"]
    )
    assert script.requests[1].headers["Accept"] == "text/event-stream"


def test_broken_stream_resumes_from_last_event_id() -> None:
    head = (
        'event: start\nid: 0.0\ndata: {"exec_id":"exec-1","backend":"local","profile":"p"}\n\n'
        'event: stdout\nid: 3.0\ndata: {"offset":0,"data":"ok\\n"}\n\n'
    )
    tail = f"event: result\nid: 3.0\ndata: {json.dumps({'http_status': 200, **RESULT})}\n\n"
    script = Script(
        httpx.Response(200, text=head, headers={"Content-Type": "text/event-stream"}),
        httpx.Response(200, text=tail, headers={"Content-Type": "text/event-stream"}),
    )
    delays: list[float] = []
    events = list(sync_client(script, POLICY, delays).stream("exec-1"))
    assert [type(e).__name__ for e in events] == ["StartEvent", "OutputEvent", "ResultEvent"]
    assert script.requests[1].headers["Last-Event-ID"] == "3.0"
    assert "Last-Event-ID" not in script.requests[0].headers


def test_a_stream_broken_before_any_event_resumes_where_it_was_asked_to() -> None:
    tail = f"event: result\nid: 9.0\ndata: {json.dumps({'http_status': 200, **RESULT})}\n\n"
    script = Script(
        httpx.ReadError("reset", request=httpx.Request("GET", "http://arm.test/")),
        httpx.Response(200, text=tail, headers={"Content-Type": "text/event-stream"}),
    )
    delays: list[float] = []
    events = list(sync_client(script, POLICY, delays).stream("exec-1", last_event_id="4.0"))
    assert [type(e).__name__ for e in events] == ["ResultEvent"]
    assert [r.headers["Last-Event-ID"] for r in script.requests] == ["4.0", "4.0"]
    assert len(delays) == 1


SESSION = {
    "id": "sess-1",
    "language": "python",
    "backend": "local",
    "profile": "p",
    "tenant": "default",
    "created_at": "t",
    "expires_at": "t",
    "idle_timeout_seconds": 60,
    "limits": {},
    "workspace": "/workspace",
    "execs": 0,
    "state": "running",
}


def gateway_timeout() -> httpx.Response:
    """A proxy's 504: no daemon error body, no verdict on whether the request ran."""
    return httpx.Response(
        504,
        text="<html><body><h1>504 Gateway Time-out</h1></body></html>",
        headers={"Content-Type": "text/html"},
    )


def test_a_proxy_error_does_not_repeat_a_session_create() -> None:
    # The daemon may have created the session before the proxy gave up: sending the POST again
    # (it takes no Idempotency-Key) could create another.
    script = Script(gateway_timeout(), gateway_timeout(), httpx.Response(201, json=SESSION))
    delays: list[float] = []
    with pytest.raises(ExecutorArmError) as info:
        sync_client(script, POLICY, delays).sessions.create()
    assert len(script.requests) == 1 and delays == []
    assert "Idempotency-Key" not in script.requests[0].headers
    assert info.value.status == 504 and info.value.retryable is False
    assert info.value.error_type is None and "504 Gateway Time-out" in info.value.message


def test_a_proxy_error_repeats_a_call_with_an_idempotency_key() -> None:
    script = Script(gateway_timeout(), gateway_timeout(), httpx.Response(200, json=RESULT))
    delays: list[float] = []
    assert sync_client(script, POLICY, delays).execute("echo", ["ok"]).stdout == "ok\n"
    assert len(script.requests) == 3 and len(delays) == 2
    keys = {r.headers["Idempotency-Key"] for r in script.requests}
    assert len(keys) == 1

    # So is a GET's, and a session exec's.
    status = {"exec_id": "exec-1", "status": "running"}
    script = Script(gateway_timeout(), httpx.Response(200, json=status))
    assert sync_client(script, POLICY, delays).get("exec-1").status == "running"
    assert len(script.requests) == 2
    script = Script(httpx.Response(502, text="bad gateway"), httpx.Response(200, json=RESULT))
    assert sync_client(script, POLICY, delays).sessions.exec("sess-1", "print(1)").success
    assert len(script.requests) == 2
    assert script.requests[0].headers["Idempotency-Key"] == script.requests[1].headers[
        "Idempotency-Key"
    ]


def test_the_daemons_retryable_verdict_is_honoured_on_session_create() -> None:
    # The daemon says retryable only when nothing ran (here: no sandbox could be started).
    script = Script(
        error(503, "SandboxUnavailable", True, "0"), httpx.Response(201, json=SESSION)
    )
    delays: list[float] = []
    assert sync_client(script, POLICY, delays).sessions.create().id == "sess-1"
    assert len(script.requests) == 2 and len(delays) == 1

    # And its final verdict is final, whatever the status.
    script = Script(error(503, "SandboxUnavailable", False), httpx.Response(201, json=SESSION))
    with pytest.raises(UnavailableError) as info:
        sync_client(script, POLICY, delays).sessions.create()
    assert len(script.requests) == 1 and info.value.retryable is False


def test_async_client_does_not_repeat_a_session_create_after_a_proxy_error() -> None:
    script = Script(gateway_timeout(), httpx.Response(201, json=SESSION))
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    async def main() -> None:
        c = AsyncClient("http://arm.test", retry=POLICY, transport=httpx.MockTransport(script))
        c._sleep = sleep  # type: ignore[method-assign]
        with pytest.raises(ExecutorArmError) as info:
            await c.sessions.create()
        assert info.value.status == 504 and info.value.retryable is False
        await c.aclose()

    asyncio.run(main())
    assert len(script.requests) == 1 and delays == []


ACCEPTED = {
    "exec_id": "exec-1",
    "status": "running",
    "links": {
        "self": "/v1/executions/exec-1",
        "stream": "/v1/executions/exec-1/stream",
        "cancel": "/v1/executions/exec-1/cancel",
    },
}


class Endless:
    """A server that answers every request with a run's 202 as JSON, never with a stream."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if len(self.requests) > 50:
            raise AssertionError("the client keeps sending")
        return httpx.Response(200, json=ACCEPTED)


def endless_client(server: Endless, delays: list[float]) -> Client:
    c = Client("http://arm.test", retry=POLICY, transport=httpx.MockTransport(server))
    c._sleep = delays.append  # type: ignore[method-assign,assignment]
    return c


def test_a_stream_that_is_never_a_stream_is_followed_at_most_once() -> None:
    # A GET of a stream answered with JSON: not followed at all.
    server = Endless()
    delays: list[float] = []
    with pytest.raises(ProtocolError) as info:
        list(endless_client(server, delays).stream("exec-1"))
    assert 1 <= len(server.requests) <= 2
    assert info.value.status == 200 and info.value.retryable is False
    assert "did not answer with a stream" in info.value.message

    # A streamed POST answered with a run's 202 (a replay): followed once, then not again.
    server = Endless()
    with pytest.raises(ProtocolError):
        list(endless_client(server, delays).execute_stream("echo", ["x"]))
    assert [r.url.path for r in server.requests] == ["/execute", "/v1/executions/exec-1/stream"]
    assert delays == []


def test_async_stream_that_is_never_a_stream_is_followed_at_most_once() -> None:
    server = Endless()

    async def main() -> None:
        c = AsyncClient("http://arm.test", retry=POLICY, transport=httpx.MockTransport(server))
        with pytest.raises(ProtocolError):
            async for _ in c.execute_stream("echo", ["x"]):
                pass
        await c.aclose()

    asyncio.run(main())
    assert len(server.requests) == 2


def test_an_event_id_that_is_not_visible_ascii_is_not_sent_back() -> None:
    head = (
        'event: start\nid: 0.0\ndata: {"exec_id":"exec-1","backend":"local","profile":"p"}\n\n'
        'event: stdout\nid: 3.\u00e9\ndata: {"offset":0,"data":"ok\\n"}\n\n'
        'event: stdout\nid: 4 0\ndata: {"offset":3,"data":"ok\\n"}\n\n'
    )
    tail = f"event: result\nid: 5.0\ndata: {json.dumps({'http_status': 200, **RESULT})}\n\n"
    script = Script(
        httpx.Response(200, text=head, headers={"Content-Type": "text/event-stream"}),
        httpx.Response(200, text=tail, headers={"Content-Type": "text/event-stream"}),
    )
    delays: list[float] = []
    events = list(sync_client(script, POLICY, delays).stream("exec-1"))
    assert [e.id for e in events] == ["0.0", None, None, "5.0"]
    # The resume carries the last usable id.
    assert script.requests[1].headers["Last-Event-ID"] == "0.0"


@pytest.mark.parametrize(
    "event",
    [
        "event: start\ndata: {not json\n\n",
        "event: start\ndata: {}\n\n",
        'event: start\ndata: {"exec_id": 5}\n\n',
        "event: stdout\ndata: [1, 2]\n\n",
        'event: stdout\ndata: {"offset": "x"}\n\n',
        'event: result\ndata: {"http_status": 200, "stdout": "x"}\n\n',
    ],
)
def test_malformed_event_data_raises_a_protocol_error(event: str) -> None:
    script = Script(httpx.Response(200, text=event, headers={"Content-Type": "text/event-stream"}))
    delays: list[float] = []
    with pytest.raises(ProtocolError) as info:
        list(sync_client(script, POLICY, delays).stream("exec-1"))
    assert info.value.retryable is False and "malformed" in info.value.message
    assert len(script.requests) == 1
