"""Typed errors. Every error answer of the daemon is ``{"success": false, "error", "error_type",
"retryable", …}``; it is raised as the subclass of :class:`ExecutorArmError` its ``error_type``
names (or, failing that, its status). An answer without that body (a proxy's 502 page, say)
is retryable only when the request is safe to send again: see :func:`error_from_response`."""

from __future__ import annotations

import json
from typing import Any

import httpx

from .models import ErrorBody, ExecutionResult, from_wire

__all__ = [
    "ExecutorArmError",
    "TransportError",
    "ProtocolError",
    "InvalidRequestError",
    "MethodNotAllowedError",
    "AuthenticationError",
    "CapabilityViolationError",
    "NotFoundError",
    "ConflictError",
    "IdempotencyInProgressError",
    "AlreadyFinishedError",
    "NotFinishedError",
    "StdinClosedError",
    "SessionBusyError",
    "IdempotencyConflictError",
    "PayloadTooLargeError",
    "TimeoutExceededError",
    "ExecutionTimeoutError",
    "RequestTimeoutError",
    "RateLimitedError",
    "WorkspaceFullError",
    "StoreFullError",
    "UnavailableError",
    "InternalServerError",
    "error_from_response",
    "error_from_body",
    "safe_to_repeat",
]


class ExecutorArmError(Exception):
    """An error answer of the daemon (or, for :class:`TransportError`, no answer at all).

    ``retryable`` says the same request may be sent again: the daemon's own verdict when the
    answer carries its error body (it says so only when nothing ran: 429, 503, an
    Idempotency-Key still running); for an answer without it (a proxy's 502/504, …), a 429 or
    5xx of a request that is safe to repeat (a GET, or one with an ``Idempotency-Key``).
    ``retry_after`` is the ``Retry-After`` header in seconds.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        error_type: str | None = None,
        retryable: bool = False,
        retry_after: float | None = None,
        request_id: str | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type
        self.retryable = retryable
        self.retry_after = retry_after
        self.request_id = request_id
        self.body = body

    def __str__(self) -> str:
        parts = [p for p in (str(self.status or ""), self.error_type or "") if p]
        prefix = " ".join(parts)
        return f"{prefix}: {self.message}" if prefix else self.message

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status!r}, error_type={self.error_type!r}, "
            f"message={self.message!r}, retryable={self.retryable!r}, "
            f"retry_after={self.retry_after!r}, request_id={self.request_id!r})"
        )


class TransportError(ExecutorArmError):
    """The daemon could not be reached or the connection broke. Retryable when the request
    cannot have reached the daemon (connection refused, connect timeout) or only reads (GET)."""

    def __init__(self, message: str, *, retryable: bool, cause: httpx.TransportError) -> None:
        super().__init__(message, retryable=retryable)
        self.cause = cause

    @classmethod
    def from_httpx(cls, exc: httpx.TransportError, method: str | None = None) -> TransportError:
        unsent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
        return cls(f"{type(exc).__name__}: {exc}", retryable=unsent or method == "GET", cause=exc)


class ProtocolError(ExecutorArmError):
    """The server's answer does not follow the daemon's API: a stream answered with something
    that is not a stream, or an event that cannot be decoded. Not retryable."""

    def __init__(self, message: str, *, status: int | None = None, body: Any = None) -> None:
        super().__init__(message, status=status, retryable=False, body=body)


class InvalidRequestError(ExecutorArmError):
    """400 ``InvalidRequest`` (and 404 of an unknown path): fix the request."""


class MethodNotAllowedError(ExecutorArmError):
    """405 ``MethodNotAllowed``."""


class AuthenticationError(ExecutorArmError):
    """401 ``Unauthorized``: a service or capability token is missing, malformed or expired."""


class CapabilityViolationError(ExecutorArmError):
    """403 ``CapabilityViolation``: the allowlist or a token refused the call.
    ``allowed_commands`` is set when the command is not in the allowlist."""

    @property
    def allowed_commands(self) -> list[str] | None:
        if isinstance(self.body, dict):
            value = self.body.get("allowed_commands")
            if isinstance(value, list):
                return [str(v) for v in value]
        return None


class NotFoundError(ExecutorArmError):
    """404 ``NotFound``: no such run, session or file for this caller (and tenant)."""


class ConflictError(ExecutorArmError):
    """409: the resource is in a state that refuses the call."""


class IdempotencyInProgressError(ConflictError):
    """409 ``IdempotencyInProgress``: the first request with this key still runs (retryable)."""


class StdinClosedError(ConflictError):
    """409 ``StdinClosed``: stdin to a session's exec that was not started with ``stdin_open``."""


class AlreadyFinishedError(ConflictError):
    """409 ``AlreadyFinished``: cancel of a run that has finished, or stdin or a signal to a
    session's background process that has ended."""


class NotFinishedError(ConflictError):
    """409 ``NotFinished``: the receipt of a run (or session exec) that has not ended yet; it is
    made as the run ends."""


class SessionBusyError(ConflictError):
    """409 ``SessionBusy``: the session runs another exec."""


class SessionPausedError(ConflictError):
    """409 ``SessionPaused``: a session's port was asked for while the session is paused (a pause
    ends its processes: resume it and start the server again)."""


class IdempotencyConflictError(ExecutorArmError):
    """422 ``IdempotencyConflict``: the key was used with another body or capability token."""


class PayloadTooLargeError(ExecutorArmError):
    """413 ``PayloadTooLarge``."""


class TimeoutExceededError(ExecutorArmError):
    """408: a deadline ran out."""


class ExecutionTimeoutError(TimeoutExceededError):
    """408 ``ExecutionTimeout``: the run hit its wall-clock limit. ``result`` holds the partial
    output and the rest of the result."""

    @property
    def result(self) -> ExecutionResult | None:
        if isinstance(self.body, dict) and "stdout" in self.body and "exec_id" in self.body:
            return from_wire(ExecutionResult, self.body)
        return None


class RequestTimeoutError(TimeoutExceededError):
    """408 ``RequestTimeout``: the request body did not arrive in time; nothing ran."""


class RateLimitedError(ExecutorArmError):
    """429 ``Overloaded``: run slots, sessions or file transfers are all taken (retryable)."""


class WorkspaceFullError(ExecutorArmError):
    """507 ``WorkspaceFull``: the session's disk quota is reached."""


class StoreFullError(ExecutorArmError):
    """507 ``StoreFull``: the daemon's paused-session store has no room; the session runs on."""


class UnavailableError(ExecutorArmError):
    """503 ``SandboxUnavailable``: a backend, the state store or the audit log is down, or the
    daemon is draining (retryable)."""


class PortClosedError(ExecutorArmError):
    """502 ``PortClosed``: nothing listens on a session's port (see ``sessions.port_url``), or its
    server closed the connection without an answer (retryable)."""


class InternalServerError(ExecutorArmError):
    """500 ``InternalError``."""


_BY_TYPE: dict[str, type[ExecutorArmError]] = {
    "InvalidRequest": InvalidRequestError,
    "MethodNotAllowed": MethodNotAllowedError,
    "Unauthorized": AuthenticationError,
    "CapabilityViolation": CapabilityViolationError,
    "NotFound": NotFoundError,
    "IdempotencyInProgress": IdempotencyInProgressError,
    "AlreadyFinished": AlreadyFinishedError,
    "NotFinished": NotFinishedError,
    "StdinClosed": StdinClosedError,
    "SessionBusy": SessionBusyError,
    "SessionPaused": SessionPausedError,
    "IdempotencyConflict": IdempotencyConflictError,
    "PayloadTooLarge": PayloadTooLargeError,
    "ExecutionTimeout": ExecutionTimeoutError,
    "RequestTimeout": RequestTimeoutError,
    "Overloaded": RateLimitedError,
    "WorkspaceFull": WorkspaceFullError,
    "StoreFull": StoreFullError,
    "SandboxUnavailable": UnavailableError,
    "PortClosed": PortClosedError,
    "InternalError": InternalServerError,
}

_BY_STATUS: dict[int, type[ExecutorArmError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    403: CapabilityViolationError,
    404: NotFoundError,
    405: MethodNotAllowedError,
    408: TimeoutExceededError,
    409: ConflictError,
    413: PayloadTooLargeError,
    422: IdempotencyConflictError,
    429: RateLimitedError,
    500: InternalServerError,
    503: UnavailableError,
    507: WorkspaceFullError,
}


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None  # an HTTP date: the daemon never sends one
    return seconds if seconds >= 0 else None


def error_from_body(
    status: int | None,
    body: Any,
    *,
    reason: str | None = None,
    retry_after: float | None = None,
    request_id: str | None = None,
    safe_to_repeat: bool = False,
) -> ExecutorArmError:
    """The typed error of an error body (a dict as the daemon sends it, or anything else).

    ``retryable`` is the body's own ``retryable`` when it has one; else a 429 or 5xx is
    retryable only when ``safe_to_repeat`` (the request may have run: a gateway timeout does
    not say whether the daemon did the work)."""
    error_type: str | None = None
    message = reason or (f"HTTP {status}" if status else "error")
    retryable = safe_to_repeat and status is not None and (status == 429 or status >= 500)
    if isinstance(body, dict):
        if isinstance(body.get("error_type"), str):
            error_type = body["error_type"]
        if isinstance(body.get("error"), str):
            message = body["error"]
        if isinstance(body.get("retryable"), bool):
            retryable = body["retryable"]
    cls = _BY_TYPE.get(error_type or "") or _BY_STATUS.get(status or 0)
    if cls is None:
        cls = InternalServerError if status is not None and status >= 500 else ExecutorArmError
    return cls(
        message,
        status=status,
        error_type=error_type,
        retryable=retryable,
        retry_after=retry_after,
        request_id=request_id,
        body=body,
    )


def safe_to_repeat(request: httpx.Request) -> bool:
    """Whether sending ``request`` again cannot do the work twice: it only reads (GET, HEAD) or
    carries an ``Idempotency-Key`` (the daemon answers a repeat with the stored result)."""
    return request.method in ("GET", "HEAD") or "Idempotency-Key" in request.headers


def error_from_response(response: httpx.Response) -> ExecutorArmError:
    """The typed error of a non-success answer (its body must have been read). Without the
    daemon's error body, a 429 or 5xx is retryable only when the request that got it is
    :func:`safe_to_repeat`."""
    body: Any = None
    reason = response.reason_phrase or None
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        if response.content:
            reason = response.text[:500]
    return error_from_body(
        response.status_code,
        body,
        reason=reason,
        retry_after=_retry_after(response.headers.get("retry-after")),
        request_id=response.headers.get("x-request-id"),
        safe_to_repeat=_sent_request_is_safe_to_repeat(response),
    )


def _sent_request_is_safe_to_repeat(response: httpx.Response) -> bool:
    try:
        request = response.request
    except RuntimeError:  # a Response built by hand: nothing says the request was safe
        return False
    return safe_to_repeat(request)


def error_body(err: ExecutorArmError) -> ErrorBody | None:
    """The error's body as the documented model, when it has that shape."""
    if isinstance(err.body, dict) and "error_type" in err.body and "stdout" not in err.body:
        try:
            return from_wire(ErrorBody, err.body)
        except (TypeError, ValueError):
            return None
    return None
