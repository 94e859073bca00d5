"""The synchronous client."""

from __future__ import annotations

import builtins
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, Literal, TypeVar, overload

import httpx

from . import _core
from ._core import Call, Credentials
from .errors import ExecutorArmError, TransportError, error_from_body, error_from_response
from .models import (
    ActionType,
    CancelAccepted,
    ErrorBody,
    Event,
    ExecuteRequest,
    ExecutionResult,
    FileList,
    ArchiveUploaded,
    Health,
    ProcessInfo,
    ProcessStarted,
    ReceiptKey,
    ResultEvent,
    RunAccepted,
    RunStatus,
    SessionCreateRequest,
    SessionExecRequest,
    SessionInfo,
    SessionLimits,
    StartEvent,
    to_wire,
)
from .retry import RetryPolicy
from .sse import iter_events
from .terminal import Terminal, open_terminal

__all__ = ["Client", "Sessions", "Processes", "DEFAULT_TIMEOUT", "answer_of"]

T = TypeVar("T")

#: Synchronous runs last up to 300 s; the read timeout leaves room for the answer.
DEFAULT_TIMEOUT = httpx.Timeout(330.0, connect=10.0)

# Builds the request that resumes a stream: (exec_id, Last-Event-ID) -> call.
_Resume = Callable[[str, "str | None"], "Call[None]"]


def answer_of(status: RunStatus) -> ExecutionResult:
    """The result of a finished run, or the error it ended with, raised as its typed exception."""
    if isinstance(status.result, ExecutionResult):
        return status.result
    if isinstance(status.result, ErrorBody):
        raise error_from_body(status.http_status, to_wire(status.result))
    raise ValueError(f"run {status.exec_id} is {status.status}: no result yet")


class Client:
    """A client of one executor-arm daemon.

    ``service_token`` is sent as ``Authorization: Bearer`` on every authenticated route;
    ``capability_token`` as ``X-Capability-Token`` where the daemon takes one (``/execute``,
    session creation) unless a call gives its own; ``tenant`` as ``X-Tenant-ID`` on session
    routes. Errors are raised as :class:`~executor_arm_client.errors.ExecutorArmError`
    subclasses; retryable ones are retried by ``retry``.
    """

    def __init__(
        self,
        base_url: str = _core.DEFAULT_BASE_URL,
        *,
        service_token: str | None = None,
        capability_token: str | None = None,
        tenant: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: httpx.Timeout | float | None = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        self.service_token = service_token
        self.capability_token = capability_token
        self.tenant = tenant
        self.retry = retry if retry is not None else RetryPolicy()
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(
            base_url=base_url,
            timeout=timeout,
            headers={"User-Agent": _core.USER_AGENT, **(headers or {})},
            transport=transport,
        )
        self.sessions = Sessions(self)

    # -- plumbing --------------------------------------------------------------------------

    @property
    def _creds(self) -> Credentials:
        return Credentials(self.service_token, self.capability_token, self.tenant)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def _request(self, call: Call[Any], *, stream: bool = False) -> httpx.Response:
        """Sends ``call`` until it succeeds, fails for good, or runs out of attempts."""
        attempt = 0
        while True:
            attempt += 1
            err: ExecutorArmError
            try:
                request = self._http.build_request(
                    call.method,
                    call.path,
                    headers=dict(call.headers),
                    json=call.json,
                    content=call.content,
                    params=call.params,
                )
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as e:
                err = TransportError.from_httpx(e, call.method)
            else:
                if response.status_code < 400:
                    return response
                response.read()
                response.close()
                err = error_from_response(response)
            if not err.retryable or attempt >= self.retry.max_attempts:
                raise err
            self._sleep(self.retry.delay(attempt, err.retry_after))

    def _send(self, call: Call[T]) -> T:
        return call.decode(self._request(call))

    def _events(
        self, call: Call[Any], resume: _Resume, exec_id: str | None = None
    ) -> Iterator[Event]:
        """The events of a stream; a connection that breaks before the result is resumed from
        the last event id (bounded by the retry policy's attempts)."""
        last_id: str | None = call.headers.get("Last-Event-ID")
        failures = 0
        current = call
        # Only the POST that starts a run may be answered with its stored 202 (a replay), once.
        may_follow = call.method == "POST"
        while True:
            progressed = False
            try:
                response = self._request(current, stream=True)
                try:
                    if not _core.is_event_stream(response):
                        response.read()
                        exec_id = _core.replayed_run(response, may_follow=may_follow)
                        may_follow = False
                        current = resume(exec_id, last_id)
                        continue
                    for ev in iter_events(response.iter_lines()):
                        if isinstance(ev, StartEvent):
                            exec_id = ev.exec_id
                        if ev.id is not None:
                            last_id = ev.id
                        progressed = True
                        yield ev
                        if isinstance(ev, ResultEvent):
                            return
                finally:
                    response.close()
                err: ExecutorArmError = TransportError(
                    "the stream ended before the run's result",
                    retryable=True,
                    cause=httpx.RemoteProtocolError("stream ended"),
                )
            except httpx.TransportError as e:
                err = TransportError.from_httpx(e)
                err.retryable = True
            if exec_id is None:
                raise err
            failures = 0 if progressed else failures + 1
            if failures >= self.retry.max_attempts:
                raise err
            if failures:
                self._sleep(self.retry.delay(failures, None))
            current = resume(exec_id, last_id)

    def _stream_resume(
        self,
        session_id: str | None = None,
        tenant: str | None = None,
        framing: _core.Framing | None = None,
    ) -> _Resume:
        def resume(exec_id: str, last_id: str | None) -> Call[None]:
            return _core.stream_run_call(
                self._creds,
                exec_id,
                last_event_id=last_id,
                session_id=session_id,
                tenant=tenant,
                framing=framing,
            )

        return resume

    # -- runs ------------------------------------------------------------------------------

    @overload
    def execute(
        self,
        command: str,
        args: Sequence[str] = ...,
        *,
        action_type: ActionType = ...,
        timeout_seconds: int | None = ...,
        stdin: str | None = ...,
        env: Mapping[str, str] | None = ...,
        profile: str | None = ...,
        metadata: Mapping[str, Any] | None = ...,
        cancel_on_disconnect: bool | None = ...,
        receipt: bool = ...,
        async_: Literal[False] = ...,
        capability_token: str | None = ...,
        idempotency_key: str | None = ...,
        request_id: str | None = ...,
    ) -> ExecutionResult: ...

    @overload
    def execute(
        self,
        command: str,
        args: Sequence[str] = ...,
        *,
        action_type: ActionType = ...,
        timeout_seconds: int | None = ...,
        stdin: str | None = ...,
        env: Mapping[str, str] | None = ...,
        profile: str | None = ...,
        metadata: Mapping[str, Any] | None = ...,
        cancel_on_disconnect: bool | None = ...,
        receipt: bool = ...,
        async_: Literal[True],
        capability_token: str | None = ...,
        idempotency_key: str | None = ...,
        request_id: str | None = ...,
    ) -> RunAccepted: ...

    def execute(
        self,
        command: str,
        args: Sequence[str] = (),
        *,
        action_type: ActionType = "shell",
        timeout_seconds: int | None = None,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        profile: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        cancel_on_disconnect: bool | None = None,
        receipt: bool = False,
        async_: bool = False,
        capability_token: str | None = None,
        idempotency_key: str | None = None,
        request_id: str | None = None,
    ) -> ExecutionResult | RunAccepted:
        """``POST /execute``: runs ``command`` with ``args`` and waits for its result, or, with
        ``async_=True``, returns the 202 run handle at once. A run that hits its time limit
        raises :class:`~executor_arm_client.errors.ExecutionTimeoutError` (its ``result`` holds
        the partial output). ``receipt=True`` puts the run's signed receipt in its result as
        ``receipt`` (for an async run, in the result ``get`` and ``wait`` read)."""
        request = ExecuteRequest(
            action_type=action_type,
            command=command,
            args=list(args) if args else None,
            timeout_seconds=timeout_seconds,
            stdin=stdin,
            env=dict(env) if env is not None else None,
            profile=profile,
            metadata=dict(metadata) if metadata is not None else None,
            cancel_on_disconnect=cancel_on_disconnect,
            receipt=True if receipt else None,
            async_=True if async_ else None,
        )
        return self.execute_request(
            request,
            capability_token=capability_token,
            idempotency_key=idempotency_key,
            request_id=request_id,
        )

    def execute_request(
        self,
        request: ExecuteRequest,
        *,
        capability_token: str | None = None,
        idempotency_key: str | None = None,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> ExecutionResult | RunAccepted:
        """``POST /execute`` with a full request body (external executors' envelope fields
        included). A :class:`RunAccepted` when ``request.async_``, else the result."""
        result: ExecutionResult | RunAccepted = self._send(
            _core.execute_call(
                self._creds,
                request,
                capability_token=capability_token,
                idempotency_key=idempotency_key,
                request_id=request_id,
                headers=headers,
            )
        )
        return result

    def submit(
        self,
        command: str,
        args: Sequence[str] = (),
        *,
        action_type: ActionType = "shell",
        timeout_seconds: int | None = None,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        profile: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        cancel_on_disconnect: bool | None = None,
        receipt: bool = False,
        capability_token: str | None = None,
        idempotency_key: str | None = None,
        request_id: str | None = None,
    ) -> RunAccepted:
        """``execute(..., async_=True)``: the run's 202 handle (``exec_id``, ``links``); the run
        goes on, read it with ``get``, ``wait`` or ``stream``."""
        return self.execute(
            command,
            args,
            action_type=action_type,
            timeout_seconds=timeout_seconds,
            stdin=stdin,
            env=env,
            profile=profile,
            metadata=metadata,
            cancel_on_disconnect=cancel_on_disconnect,
            receipt=receipt,
            async_=True,
            capability_token=capability_token,
            idempotency_key=idempotency_key,
            request_id=request_id,
        )

    def execute_stream(
        self,
        command: str,
        args: Sequence[str] = (),
        *,
        action_type: ActionType = "shell",
        timeout_seconds: int | None = None,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        profile: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        cancel_on_disconnect: bool | None = None,
        receipt: bool = False,
        capability_token: str | None = None,
        idempotency_key: str | None = None,
        request_id: str | None = None,
        framing: _core.Framing | None = None,
    ) -> Iterator[Event]:
        """``POST /execute`` with ``Accept: text/event-stream``: the run's events as it goes
        (``start``, ``stdout``/``stderr`` chunks, then ``result``). ``framing="lines"``: one
        output event per complete line (the daemon's default, ``bytes``, cuts chunks anywhere).
        ``receipt=True``: the ``result`` event's result carries the run's receipt."""
        request = ExecuteRequest(
            action_type=action_type,
            command=command,
            args=list(args) if args else None,
            timeout_seconds=timeout_seconds,
            stdin=stdin,
            env=dict(env) if env is not None else None,
            profile=profile,
            metadata=dict(metadata) if metadata is not None else None,
            cancel_on_disconnect=cancel_on_disconnect,
            receipt=True if receipt else None,
        )
        call = _core.execute_call(
            self._creds,
            request,
            capability_token=capability_token,
            idempotency_key=idempotency_key,
            request_id=request_id,
            headers=None,
        ).stream_variant(framing)
        return self._events(call, self._stream_resume(framing=framing))

    def get(self, exec_id: str, *, request_id: str | None = None) -> RunStatus:
        """``GET /v1/executions/{exec_id}``: the run's status, and its answer once finished."""
        return self._send(_core.get_run_call(self._creds, exec_id, request_id=request_id))

    def wait(
        self, exec_id: str, *, poll_interval: float = 0.5, timeout: float | None = None
    ) -> ExecutionResult:
        """Polls the run until it finishes; its result (or its error, raised)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.get(exec_id)
            if status.finished:
                return answer_of(status)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {exec_id} still running after {timeout} s")
            self._sleep(poll_interval)

    def stream(
        self,
        exec_id: str,
        *,
        last_event_id: str | None = None,
        framing: _core.Framing | None = None,
    ) -> Iterator[Event]:
        """``GET /v1/executions/{exec_id}/stream``: a running or finished run's events, from
        ``last_event_id`` when given; ``framing="lines"``: one output event per line."""
        call = _core.stream_run_call(
            self._creds, exec_id, last_event_id=last_event_id, framing=framing
        )
        return self._events(call, self._stream_resume(framing=framing), exec_id)

    def cancel(
        self, exec_id: str, *, grace_seconds: int | None = None, request_id: str | None = None
    ) -> CancelAccepted:
        """``POST /v1/executions/{exec_id}/cancel``: SIGTERM, then SIGKILL after the grace."""
        return self._send(
            _core.cancel_run_call(
                self._creds, exec_id, grace_seconds=grace_seconds, request_id=request_id
            )
        )

    def receipt(self, exec_id: str, *, request_id: str | None = None) -> dict[str, Any]:
        """``GET /v1/executions/{exec_id}/receipt``: the run's signed receipt, a DSSE envelope
        as the daemon sent it (check it with :func:`~executor_arm_client.verify_receipt`).
        :class:`~executor_arm_client.errors.NotFinishedError` (409) while the run goes on,
        :class:`~executor_arm_client.errors.NotFoundError` for an unknown run or one that ended
        without an outcome (nothing ran to sign)."""
        return self._send(_core.receipt_call(self._creds, exec_id, request_id=request_id))

    def receipt_keys(self, *, request_id: str | None = None) -> list[ReceiptKey]:
        """``GET /v1/receipts/keys``: the public keys that verify the daemon's receipts, its
        signing key first."""
        return self._send(_core.receipt_keys_call(self._creds, request_id=request_id))

    # -- daemon ----------------------------------------------------------------------------

    def health(self) -> Health:
        return self._send(_core.health_call())

    def capabilities(self) -> dict[str, Any]:
        """``GET /capabilities``: action types, allowed commands, profiles, limits, …"""
        return self._send(_core.capabilities_call())


class Sessions:
    """``/v1/sandbox/sessions``: sandboxes kept across execs, with their workspace. ``tenant``
    defaults to the client's."""

    def __init__(self, client: Client) -> None:
        self._client = client
        #: The sessions' background processes.
        self.processes = Processes(client)

    def create(
        self,
        language: str = "python",
        *,
        profile: str | None = None,
        ttl_seconds: int | None = None,
        idle_timeout_seconds: int | None = None,
        limits: SessionLimits | None = None,
        capability_token: str | None = None,
        tenant: str | None = None,
        request_id: str | None = None,
    ) -> SessionInfo:
        request = SessionCreateRequest(
            language=language,
            profile=profile,
            ttl_seconds=ttl_seconds,
            idle_timeout_seconds=idle_timeout_seconds,
            limits=limits,
        )
        return self._client._send(
            _core.create_session_call(
                self._client._creds,
                request,
                capability_token=capability_token,
                tenant=tenant,
                request_id=request_id,
            )
        )

    def get(self, session_id: str, *, tenant: str | None = None) -> SessionInfo:
        return self._client._send(
            _core.get_session_call(self._client._creds, session_id, tenant=tenant, request_id=None)
        )

    def pause(self, session_id: str, *, tenant: str | None = None) -> SessionInfo:
        """Saves the workspace and frees the sandbox; ``state`` is then ``"paused"``.

        An exec or file call (or :meth:`resume`) gives it a fresh sandbox with that workspace.
        """
        return self._client._send(
            _core.pause_session_call(
                self._client._creds, session_id, tenant=tenant, request_id=None
            )
        )

    def resume(self, session_id: str, *, tenant: str | None = None) -> SessionInfo:
        """Gives a paused session a fresh sandbox with its saved workspace."""
        return self._client._send(
            _core.resume_session_call(
                self._client._creds, session_id, tenant=tenant, request_id=None
            )
        )

    def delete(self, session_id: str, *, tenant: str | None = None) -> None:
        """Ends the session: kills a running exec and removes the workspace."""
        self._client._send(
            _core.delete_session_call(
                self._client._creds, session_id, tenant=tenant, request_id=None
            )
        )

    @overload
    def exec(
        self,
        session_id: str,
        code: str,
        *,
        stdin: str | None = ...,
        env: Mapping[str, str] | None = ...,
        cwd: str | None = ...,
        timeout_ms: int | None = ...,
        async_: Literal[False] = ...,
        cancel_on_disconnect: bool | None = ...,
        receipt: bool = ...,
        tenant: str | None = ...,
        idempotency_key: str | None = ...,
        request_id: str | None = ...,
    ) -> ExecutionResult: ...

    @overload
    def exec(
        self,
        session_id: str,
        code: str,
        *,
        stdin: str | None = ...,
        env: Mapping[str, str] | None = ...,
        cwd: str | None = ...,
        timeout_ms: int | None = ...,
        async_: Literal[True],
        stdin_open: bool | None = ...,
        cancel_on_disconnect: bool | None = ...,
        receipt: bool = ...,
        tenant: str | None = ...,
        idempotency_key: str | None = ...,
        request_id: str | None = ...,
    ) -> RunAccepted: ...

    def exec(
        self,
        session_id: str,
        code: str,
        *,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_ms: int | None = None,
        async_: bool = False,
        stdin_open: bool | None = None,
        cancel_on_disconnect: bool | None = None,
        receipt: bool = False,
        tenant: str | None = None,
        idempotency_key: str | None = None,
        request_id: str | None = None,
    ) -> ExecutionResult | RunAccepted:
        """Runs ``code`` in the session's language and workspace. A deadline that ends the run
        is a result (``outcome == "timeout"``), not an error. ``receipt=True`` puts the exec's
        signed receipt in its result as ``receipt``."""
        request = SessionExecRequest(
            code=code,
            stdin=stdin,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            timeout_ms=timeout_ms,
            async_=True if async_ else None,
            cancel_on_disconnect=cancel_on_disconnect,
            receipt=True if receipt else None,
            stdin_open=stdin_open,
        )
        result: ExecutionResult | RunAccepted = self._client._send(
            _core.session_exec_call(
                self._client._creds,
                session_id,
                request,
                tenant=tenant,
                idempotency_key=idempotency_key,
                request_id=request_id,
            )
        )
        return result

    def exec_stream(
        self,
        session_id: str,
        code: str,
        *,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_ms: int | None = None,
        cancel_on_disconnect: bool | None = None,
        receipt: bool = False,
        tenant: str | None = None,
        idempotency_key: str | None = None,
        framing: _core.Framing | None = None,
    ) -> Iterator[Event]:
        """Runs ``code`` and streams its events (``framing="lines"``: one per output line;
        ``receipt=True``: the ``result`` event's result carries the exec's receipt)."""
        request = SessionExecRequest(
            code=code,
            stdin=stdin,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            timeout_ms=timeout_ms,
            cancel_on_disconnect=cancel_on_disconnect,
            receipt=True if receipt else None,
        )
        call = _core.session_exec_call(
            self._client._creds,
            session_id,
            request,
            tenant=tenant,
            idempotency_key=idempotency_key,
            request_id=None,
        ).stream_variant(framing)
        return self._client._events(
            call, self._client._stream_resume(session_id, tenant, framing)
        )

    def get_exec(self, session_id: str, exec_id: str, *, tenant: str | None = None) -> RunStatus:
        return self._client._send(
            _core.get_run_call(self._client._creds, exec_id, session_id=session_id, tenant=tenant)
        )

    def exec_receipt(
        self, session_id: str, exec_id: str, *, tenant: str | None = None
    ) -> dict[str, Any]:
        """The exec's signed receipt (a background process's once it ended), as
        :meth:`Client.receipt`: :class:`~executor_arm_client.errors.NotFinishedError` while it
        runs."""
        return self._client._send(
            _core.receipt_call(self._client._creds, exec_id, session_id=session_id, tenant=tenant)
        )

    def stream_exec(
        self,
        session_id: str,
        exec_id: str,
        *,
        last_event_id: str | None = None,
        tenant: str | None = None,
        framing: _core.Framing | None = None,
    ) -> Iterator[Event]:
        call = _core.stream_run_call(
            self._client._creds,
            exec_id,
            last_event_id=last_event_id,
            session_id=session_id,
            tenant=tenant,
            framing=framing,
        )
        return self._client._events(
            call, self._client._stream_resume(session_id, tenant, framing), exec_id
        )

    def exec_stdin(
        self,
        session_id: str,
        exec_id: str,
        data: bytes | str,
        *,
        eof: bool = False,
        tenant: str | None = None,
    ) -> None:
        """Writes ``data`` (a str is UTF-8) to the stdin of a running exec started with
        ``stdin_open=True``; ``eof=True`` closes it after them.
        :class:`~executor_arm_client.errors.AlreadyFinishedError` (409) once it ended,
        :class:`~executor_arm_client.errors.StdinClosedError` (409) for an exec without
        ``stdin_open``."""
        self._client._send(
            _core.exec_stdin_call(
                self._client._creds,
                session_id,
                exec_id,
                _core.stdin_bytes(data),
                eof=eof,
                tenant=tenant,
                request_id=None,
            )
        )

    def cancel_exec(
        self,
        session_id: str,
        exec_id: str,
        *,
        grace_seconds: int | None = None,
        tenant: str | None = None,
    ) -> CancelAccepted:
        return self._client._send(
            _core.cancel_run_call(
                self._client._creds,
                exec_id,
                grace_seconds=grace_seconds,
                session_id=session_id,
                tenant=tenant,
            )
        )

    def upload(
        self, session_id: str, path: str, data: bytes | str, *, tenant: str | None = None
    ) -> None:
        """Writes ``data`` to ``path`` (relative to the workspace; parents are made)."""
        content = data.encode() if isinstance(data, str) else data
        self._client._send(
            _core.upload_call(
                self._client._creds, session_id, path, content, tenant=tenant, request_id=None
            )
        )

    def download(self, session_id: str, path: str, *, tenant: str | None = None) -> bytes:
        """A workspace file's bytes."""
        return self._client._send(
            _core.download_call(
                self._client._creds, session_id, path, tenant=tenant, request_id=None
            )
        )

    def download_archive(
        self,
        session_id: str,
        path: str = "",
        dest: str | os.PathLike[str] | BinaryIO | None = None,
        *,
        tenant: str | None = None,
    ) -> bytes | int:
        """A tar of the workspace directory ``path`` (``""`` is the workspace): its files,
        directories and symlinks (never followed). Without ``dest`` its bytes; with one (a file
        name or a binary file), streamed into it, and the number of bytes written."""
        call = _core.download_archive_call(
            self._client._creds, session_id, path, tenant=tenant, request_id=None
        )
        if dest is None:
            return self._client._send(call)
        response = self._client._request(call, stream=True)
        written = 0
        out: BinaryIO = open(dest, "wb") if isinstance(dest, (str, os.PathLike)) else dest
        try:
            for chunk in response.iter_bytes():
                out.write(chunk)
                written += len(chunk)
        finally:
            response.close()
            if out is not dest:
                out.close()
        return written

    def upload_archive(
        self,
        session_id: str,
        tar: bytes | BinaryIO,
        path: str = "",
        *,
        tenant: str | None = None,
    ) -> ArchiveUploaded:
        """Extracts the tar ``tar`` (bytes or a binary file, read whole) into the workspace
        directory ``path`` (made if missing): regular files, directories and symlinks that stay
        inside the workspace. A refused archive (400), one past the quota (507) or one larger
        than the workspace (413) leaves the workspace as it was."""
        return self._client._send(
            _core.upload_archive_call(
                self._client._creds,
                session_id,
                _core.tar_bytes(tar),
                path,
                tenant=tenant,
                request_id=None,
            )
        )

    def terminal(
        self,
        session_id: str,
        *,
        tenant: str | None = None,
        request_id: str | None = None,
    ) -> Terminal:
        """Opens the session's terminal (a WebSocket to its shell on a pseudo-terminal; needs
        the ``terminal`` extra): ``send`` keystrokes, ``recv`` output, ``resize``, ``close``
        (which hangs the shell up). Refusals are the usual errors: 404 for another tenant's or
        no session, :class:`~executor_arm_client.errors.RateLimitedError` (429) when the session
        already runs ``sessions.max_processes`` processes (a terminal is one)."""
        creds = self._client._creds
        headers = {**creds.bearer(), **creds.tenant_header(tenant)}
        if request_id is not None:
            headers["X-Request-ID"] = request_id
        return open_terminal(
            str(self._client._http.base_url),
            f"/v1/sandbox/sessions/{session_id}/terminal",
            headers,
        )

    def port_url(self, session_id: str, port: int, path: str = "") -> str:
        """The URL of ``path`` (a query may follow) on ``127.0.0.1:port`` inside the session's
        sandbox, through the daemon's ports proxy: any method, bodies streamed, a WebSocket at the
        same URL with ``ws://`` (``wss://``). A server a background process runs answers it. The
        request needs the client's credentials (``Authorization: Bearer`` and, for a tenant,
        ``X-Tenant-ID``); they are not passed to the server. Makes no request itself."""
        return _core.port_url(str(self._client._http.base_url), session_id, port, path)

    def list_files(self, session_id: str, path: str = "", *, tenant: str | None = None) -> FileList:
        """A workspace directory's entries (``""`` is the workspace itself)."""
        return self._client._send(
            _core.list_files_call(
                self._client._creds, session_id, path, tenant=tenant, request_id=None
            )
        )


class Processes:
    """``/v1/sandbox/sessions/{id}/processes``: a session's background processes (local sessions
    only for now). One runs beside the session's execs until it ends, is signalled, or the
    session ends (delete, expiry, pause); its id is its exec id, so
    :meth:`Sessions.get_exec` and :meth:`Sessions.cancel_exec` also take it. ``tenant``
    defaults to the client's."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def start(
        self,
        session_id: str,
        code: str,
        *,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_ms: int | None = None,
        tenant: str | None = None,
        idempotency_key: str | None = None,
        request_id: str | None = None,
    ) -> ProcessStarted:
        """Starts ``code`` (in the session's language) as a background process: its 202 handle
        (``process_id``, ``links``) at once. Its stdin stays open for :meth:`stdin` (``stdin``
        here is written first); its deadline is ``timeout_ms``, else the profile's async
        maximum. :class:`~executor_arm_client.errors.RateLimitedError` (429) when the session
        already runs ``sessions.max_processes`` of them."""
        request = SessionExecRequest(
            code=code,
            stdin=stdin,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            timeout_ms=timeout_ms,
        )
        return self._client._send(
            _core.start_process_call(
                self._client._creds,
                session_id,
                request,
                tenant=tenant,
                idempotency_key=idempotency_key,
                request_id=request_id,
            )
        )

    def list(
        self, session_id: str, *, tenant: str | None = None
    ) -> builtins.list[ProcessInfo]:
        """The session's running processes and its last ended ones, oldest first (none while
        it is paused)."""
        return self._client._send(
            _core.list_processes_call(
                self._client._creds, session_id, tenant=tenant, request_id=None
            )
        )

    def stream(
        self,
        session_id: str,
        process_id: str,
        *,
        last_event_id: str | None = None,
        tenant: str | None = None,
        framing: _core.Framing | None = None,
    ) -> Iterator[Event]:
        """The process's events, live or finished, from ``last_event_id`` when given: the same
        as an exec's stream (``start``, ``stdout``/``stderr`` chunks, and ``result`` once it
        ended); ``framing="lines"``: one output event per line. A broken connection is resumed
        from the last event."""
        call = _core.stream_process_call(
            self._client._creds,
            session_id,
            process_id,
            last_event_id=last_event_id,
            tenant=tenant,
            framing=framing,
        )
        return self._client._events(call, self._resume(session_id, tenant, framing), process_id)

    def _resume(
        self, session_id: str, tenant: str | None, framing: _core.Framing | None
    ) -> _Resume:
        def resume(process_id: str, last_id: str | None) -> Call[None]:
            return _core.stream_process_call(
                self._client._creds,
                session_id,
                process_id,
                last_event_id=last_id,
                tenant=tenant,
                framing=framing,
            )

        return resume

    def stdin(
        self,
        session_id: str,
        process_id: str,
        data: bytes | str,
        *,
        eof: bool = False,
        tenant: str | None = None,
    ) -> None:
        """Writes ``data`` (a str is UTF-8) to the process's stdin, in order with earlier
        writes; ``eof=True`` closes its stdin after them (``data`` may be empty).
        :class:`~executor_arm_client.errors.AlreadyFinishedError` (409) once the process ended,
        :class:`~executor_arm_client.errors.NotFoundError` for an unknown process."""
        self._client._send(
            _core.process_stdin_call(
                self._client._creds,
                session_id,
                process_id,
                _core.stdin_bytes(data),
                eof=eof,
                tenant=tenant,
                request_id=None,
            )
        )

    def signal(
        self, session_id: str, process_id: str, signal: str, *, tenant: str | None = None
    ) -> None:
        """Sends ``signal`` (``"TERM"``, ``"KILL"``, ``"INT"`` or ``"HUP"``; any other is
        :class:`~executor_arm_client.errors.InvalidRequestError`) to the process; ``KILL`` ends
        every process it started. :class:`~executor_arm_client.errors.AlreadyFinishedError`
        (409) once it ended."""
        self._client._send(
            _core.signal_process_call(
                self._client._creds, session_id, process_id, signal, tenant=tenant, request_id=None
            )
        )
