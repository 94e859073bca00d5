"""What the sync and async clients share: each operation as a request description and the
decoding of its answer. Transport, retries and waiting are the clients' own."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Generic, Literal, TypeVar
from urllib.parse import quote

import httpx

from .errors import ProtocolError
from .models import (
    ArchiveUploaded,
    CancelAccepted,
    CancelRequest,
    ExecuteRequest,
    ExecutionResult,
    FileList,
    Health,
    ProcessInfo,
    ProcessList,
    ProcessStarted,
    ReceiptEnvelope,
    ReceiptKey,
    ReceiptKeys,
    RunAccepted,
    RunStatus,
    SessionCreateRequest,
    SessionExecRequest,
    SessionInfo,
    SignalRequest,
    from_wire,
    to_wire,
)

T = TypeVar("T")

DEFAULT_BASE_URL = "http://127.0.0.1:8003"
USER_AGENT = "executor-arm-client-python/0.1.0"


def new_idempotency_key() -> str:
    """A fresh Idempotency-Key (1-255 visible ASCII characters)."""
    return f"py-{uuid.uuid4().hex}"


def _json(response: httpx.Response) -> Any:
    return json.loads(response.content)


def decode_as(cls: type[T]) -> Callable[[httpx.Response], T]:
    def decode(response: httpx.Response) -> T:
        return from_wire(cls, _json(response))

    return decode


def _no_content(response: httpx.Response) -> None:
    return None


def _raw_bytes(response: httpx.Response) -> bytes:
    return response.content


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request: sent as described, again on a retryable error (same headers, so the same
    Idempotency-Key), and its success answer decoded by ``decode``."""

    method: str
    path: str
    decode: Callable[[httpx.Response], T]
    headers: Mapping[str, str] = field(default_factory=dict)
    json: Any = None
    content: bytes | None = None
    params: Mapping[str, str] | None = None

    def stream_variant(self, framing: Framing | None = None) -> Call[T]:
        return Call(
            self.method,
            self.path,
            self.decode,
            {**self.headers, "Accept": "text/event-stream"},
            self.json,
            self.content,
            {**(self.params or {}), **framing_params(framing)} or None,
        )


#: How a stream cuts output into events: ``bytes`` (the daemon's default: chunks as they come)
#: or ``lines`` (one event per complete line).
Framing = Literal["bytes", "lines"]


def framing_params(framing: Framing | None) -> dict[str, str]:
    """The query of a stream in ``framing`` (none: the daemon's default)."""
    if framing is None:
        return {}
    if framing not in ("bytes", "lines"):
        raise ValueError(f"framing must be 'bytes' or 'lines', got {framing!r}")
    return {"framing": framing}


def _seg(value: str) -> str:
    return quote(value, safe="")


def _file_path(path: str) -> str:
    # Dot segments are escaped so that no URL normalisation removes them on the way: the daemon
    # refuses them itself (400).
    return "/".join(
        quote(part, safe="") if part not in (".", "..") else part.replace(".", "%2E")
        for part in path.lstrip("/").split("/")
    )


def port_url(base_url: str, session_id: str, port: int, path: str = "") -> str:
    """The URL of ``path`` on ``127.0.0.1:port`` inside session ``session_id``'s sandbox, through
    the daemon's ports proxy at ``base_url``. ``path`` may carry a query (``"api/items?x=1"``);
    characters a URL cannot hold are percent-encoded, reserved ones are kept."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an int in 1..65535, got {port!r}")
    rest = quote(path.lstrip("/"), safe="/?#&=+,;:@!$'()*~%-._")
    return f"{base_url.rstrip('/')}/v1/sandbox/sessions/{_seg(session_id)}/ports/{port}/{rest}"


@dataclass(frozen=True)
class Credentials:
    service_token: str | None
    capability_token: str | None
    tenant: str | None

    def bearer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.service_token}"} if self.service_token else {}

    def capability(self, override: str | None) -> dict[str, str]:
        token = override if override is not None else self.capability_token
        return {"X-Capability-Token": token} if token else {}

    def tenant_header(self, override: str | None) -> dict[str, str]:
        tenant = override if override is not None else self.tenant
        return {"X-Tenant-ID": tenant} if tenant is not None else {}


def _common(request_id: str | None, extra: Mapping[str, str] | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if request_id is not None:
        headers["X-Request-ID"] = request_id
    if extra:
        headers.update(extra)
    return headers


# --- runs -----------------------------------------------------------------------------------


def execute_call(
    creds: Credentials,
    request: ExecuteRequest,
    *,
    capability_token: str | None,
    idempotency_key: str | None,
    request_id: str | None,
    headers: Mapping[str, str] | None,
) -> Call[Any]:
    body = to_wire(request)
    h = {**creds.bearer(), **_common(request_id, headers)}
    if "capability_token" not in body:
        h.update(creds.capability(capability_token))
    h["Idempotency-Key"] = idempotency_key or new_idempotency_key()
    decode: Callable[[httpx.Response], Any] = (
        decode_as(RunAccepted) if request.async_ else decode_as(ExecutionResult)
    )
    return Call("POST", "/execute", decode, h, json=body)


def run_path(exec_id: str, session_id: str | None = None) -> str:
    if session_id is None:
        return f"/v1/executions/{_seg(exec_id)}"
    return f"/v1/sandbox/sessions/{_seg(session_id)}/execs/{_seg(exec_id)}"


def get_run_call(
    creds: Credentials,
    exec_id: str,
    *,
    session_id: str | None = None,
    tenant: str | None = None,
    request_id: str | None = None,
) -> Call[RunStatus]:
    h = {**creds.bearer(), **_common(request_id, None)}
    if session_id is not None:
        h.update(creds.tenant_header(tenant))
    return Call("GET", run_path(exec_id, session_id), decode_as(RunStatus), h)


def stream_run_call(
    creds: Credentials,
    exec_id: str,
    *,
    last_event_id: str | None = None,
    session_id: str | None = None,
    tenant: str | None = None,
    request_id: str | None = None,
    framing: Framing | None = None,
) -> Call[None]:
    h = {**creds.bearer(), **_common(request_id, None), "Accept": "text/event-stream"}
    if session_id is not None:
        h.update(creds.tenant_header(tenant))
    if last_event_id is not None:
        h["Last-Event-ID"] = last_event_id
    return Call(
        "GET",
        run_path(exec_id, session_id) + "/stream",
        _no_content,
        h,
        params=framing_params(framing) or None,
    )


def cancel_run_call(
    creds: Credentials,
    exec_id: str,
    *,
    grace_seconds: int | None = None,
    session_id: str | None = None,
    tenant: str | None = None,
    request_id: str | None = None,
) -> Call[CancelAccepted]:
    h = {**creds.bearer(), **_common(request_id, None)}
    if session_id is not None:
        h.update(creds.tenant_header(tenant))
    body = to_wire(CancelRequest(grace_seconds=grace_seconds))
    return Call(
        "POST", run_path(exec_id, session_id) + "/cancel", decode_as(CancelAccepted), h, json=body
    )


def _envelope_of(response: httpx.Response) -> dict[str, Any]:
    # The envelope is handed out as the daemon sent it (what was signed); decoding it as the
    # model only checks its shape.
    data = _json(response)
    from_wire(ReceiptEnvelope, data)
    envelope: dict[str, Any] = data
    return envelope


def receipt_call(
    creds: Credentials,
    exec_id: str,
    *,
    session_id: str | None = None,
    tenant: str | None = None,
    request_id: str | None = None,
) -> Call[dict[str, Any]]:
    """The receipt of run ``exec_id`` (of session ``session_id``'s exec when given)."""
    h = {**creds.bearer(), **_common(request_id, None)}
    if session_id is not None:
        h.update(creds.tenant_header(tenant))
    return Call("GET", run_path(exec_id, session_id) + "/receipt", _envelope_of, h)


def _keys_of(response: httpx.Response) -> list[ReceiptKey]:
    return from_wire(ReceiptKeys, _json(response)).keys


def receipt_keys_call(
    creds: Credentials, *, request_id: str | None = None
) -> Call[list[ReceiptKey]]:
    return Call(
        "GET", "/v1/receipts/keys", _keys_of, {**creds.bearer(), **_common(request_id, None)}
    )


def is_event_stream(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.startswith("text/event-stream")


def replayed_run(response: httpx.Response, *, may_follow: bool) -> str:
    """The ``exec_id`` of a stream's 2xx answer that is not a stream (its body read): a replayed
    streamed POST answers with the run's stored 202, which the caller follows once by streaming
    the run. Anything else (a second such answer, one to a GET, a body that is not a
    :class:`RunAccepted`) raises :class:`ProtocolError` rather than sending again."""
    kind = response.headers.get("content-type") or "no content type"
    if may_follow:
        try:
            return from_wire(RunAccepted, _json(response)).exec_id
        except (ValueError, TypeError, KeyError):  # json.JSONDecodeError is a ValueError
            pass
    raise ProtocolError(
        f"the server did not answer with a stream (HTTP {response.status_code}, {kind})",
        status=response.status_code,
        body=response.text[:500],
    )


# --- sessions -------------------------------------------------------------------------------


def create_session_call(
    creds: Credentials,
    request: SessionCreateRequest,
    *,
    capability_token: str | None,
    tenant: str | None,
    request_id: str | None,
) -> Call[SessionInfo]:
    body = to_wire(request)
    h = {**creds.bearer(), **creds.tenant_header(tenant), **_common(request_id, None)}
    if "capability_token" not in body:
        h.update(creds.capability(capability_token))
    return Call("POST", "/v1/sandbox/sessions", decode_as(SessionInfo), h, json=body)


def _session_headers(
    creds: Credentials, tenant: str | None, request_id: str | None
) -> dict[str, str]:
    return {**creds.bearer(), **creds.tenant_header(tenant), **_common(request_id, None)}


def get_session_call(
    creds: Credentials, session_id: str, *, tenant: str | None, request_id: str | None
) -> Call[SessionInfo]:
    return Call(
        "GET",
        f"/v1/sandbox/sessions/{_seg(session_id)}",
        decode_as(SessionInfo),
        _session_headers(creds, tenant, request_id),
    )


def delete_session_call(
    creds: Credentials, session_id: str, *, tenant: str | None, request_id: str | None
) -> Call[None]:
    return Call(
        "DELETE",
        f"/v1/sandbox/sessions/{_seg(session_id)}",
        _no_content,
        _session_headers(creds, tenant, request_id),
    )


def pause_session_call(
    creds: Credentials, session_id: str, *, tenant: str | None, request_id: str | None
) -> Call[SessionInfo]:
    return Call(
        "POST",
        f"/v1/sandbox/sessions/{_seg(session_id)}/pause",
        decode_as(SessionInfo),
        _session_headers(creds, tenant, request_id),
    )


def resume_session_call(
    creds: Credentials, session_id: str, *, tenant: str | None, request_id: str | None
) -> Call[SessionInfo]:
    return Call(
        "POST",
        f"/v1/sandbox/sessions/{_seg(session_id)}/resume",
        decode_as(SessionInfo),
        _session_headers(creds, tenant, request_id),
    )


def session_exec_call(
    creds: Credentials,
    session_id: str,
    request: SessionExecRequest,
    *,
    tenant: str | None,
    idempotency_key: str | None,
    request_id: str | None,
) -> Call[Any]:
    h = _session_headers(creds, tenant, request_id)
    h["Idempotency-Key"] = idempotency_key or new_idempotency_key()
    decode: Callable[[httpx.Response], Any] = (
        decode_as(RunAccepted) if request.async_ else decode_as(ExecutionResult)
    )
    return Call(
        "POST", f"/v1/sandbox/sessions/{_seg(session_id)}/exec", decode, h, json=to_wire(request)
    )


def upload_call(
    creds: Credentials,
    session_id: str,
    path: str,
    data: bytes,
    *,
    tenant: str | None,
    request_id: str | None,
) -> Call[None]:
    h = _session_headers(creds, tenant, request_id)
    h["Content-Type"] = "application/octet-stream"
    return Call(
        "PUT",
        f"/v1/sandbox/sessions/{_seg(session_id)}/files/{_file_path(path)}",
        _no_content,
        h,
        content=data,
    )


def download_call(
    creds: Credentials, session_id: str, path: str, *, tenant: str | None, request_id: str | None
) -> Call[bytes]:
    return Call(
        "GET",
        f"/v1/sandbox/sessions/{_seg(session_id)}/files/{_file_path(path)}",
        _raw_bytes,
        _session_headers(creds, tenant, request_id),
    )


def list_files_call(
    creds: Credentials, session_id: str, path: str, *, tenant: str | None, request_id: str | None
) -> Call[FileList]:
    return Call(
        "GET",
        f"/v1/sandbox/sessions/{_seg(session_id)}/files",
        decode_as(FileList),
        _session_headers(creds, tenant, request_id),
        params={"path": path.lstrip("/")},
    )


def download_archive_call(
    creds: Credentials, session_id: str, path: str, *, tenant: str | None, request_id: str | None
) -> Call[bytes]:
    return Call(
        "GET",
        f"/v1/sandbox/sessions/{_seg(session_id)}/archive",
        _raw_bytes,
        _session_headers(creds, tenant, request_id),
        params={"path": path.strip("/")},
    )


def upload_archive_call(
    creds: Credentials,
    session_id: str,
    tar: bytes,
    path: str,
    *,
    tenant: str | None,
    request_id: str | None,
) -> Call[ArchiveUploaded]:
    h = _session_headers(creds, tenant, request_id)
    h["Content-Type"] = "application/x-tar"
    return Call(
        "PUT",
        f"/v1/sandbox/sessions/{_seg(session_id)}/archive",
        decode_as(ArchiveUploaded),
        h,
        content=tar,
        params={"path": path.strip("/")},
    )


# --- a session's background processes ------------------------------------------------------


def process_path(session_id: str, process_id: str | None = None) -> str:
    base = f"/v1/sandbox/sessions/{_seg(session_id)}/processes"
    return base if process_id is None else f"{base}/{_seg(process_id)}"


def start_process_call(
    creds: Credentials,
    session_id: str,
    request: SessionExecRequest,
    *,
    tenant: str | None,
    idempotency_key: str | None,
    request_id: str | None,
) -> Call[ProcessStarted]:
    """The session exec of ``request`` as a background process (``background`` is set here)."""
    h = _session_headers(creds, tenant, request_id)
    h["Idempotency-Key"] = idempotency_key or new_idempotency_key()
    body = to_wire(request)
    body["background"] = True
    body.pop("async", None)
    return Call(
        "POST",
        f"/v1/sandbox/sessions/{_seg(session_id)}/exec",
        decode_as(ProcessStarted),
        h,
        json=body,
    )


def _processes_of(response: httpx.Response) -> list[ProcessInfo]:
    return from_wire(ProcessList, _json(response)).processes


def list_processes_call(
    creds: Credentials, session_id: str, *, tenant: str | None, request_id: str | None
) -> Call[list[ProcessInfo]]:
    return Call(
        "GET",
        process_path(session_id),
        _processes_of,
        _session_headers(creds, tenant, request_id),
    )


def stream_process_call(
    creds: Credentials,
    session_id: str,
    process_id: str,
    *,
    last_event_id: str | None = None,
    tenant: str | None = None,
    request_id: str | None = None,
    framing: Framing | None = None,
) -> Call[None]:
    h = {**_session_headers(creds, tenant, request_id), "Accept": "text/event-stream"}
    if last_event_id is not None:
        h["Last-Event-ID"] = last_event_id
    return Call(
        "GET",
        process_path(session_id, process_id) + "/stream",
        _no_content,
        h,
        params=framing_params(framing) or None,
    )


def process_stdin_call(
    creds: Credentials,
    session_id: str,
    process_id: str,
    data: bytes,
    *,
    eof: bool,
    tenant: str | None,
    request_id: str | None,
) -> Call[None]:
    h = _session_headers(creds, tenant, request_id)
    h["Content-Type"] = "application/octet-stream"
    return Call(
        "POST",
        process_path(session_id, process_id) + "/stdin",
        _no_content,
        h,
        content=data,
        params={"eof": "true"} if eof else None,
    )


def exec_stdin_call(
    creds: Credentials,
    session_id: str,
    exec_id: str,
    data: bytes,
    *,
    eof: bool,
    tenant: str | None,
    request_id: str | None,
) -> Call[None]:
    h = _session_headers(creds, tenant, request_id)
    h["Content-Type"] = "application/octet-stream"
    return Call(
        "POST",
        f"/v1/sandbox/sessions/{quote(session_id, safe='')}/execs/{quote(exec_id, safe='')}/stdin",
        _no_content,
        h,
        content=data,
        params={"eof": "true"} if eof else None,
    )


def signal_process_call(
    creds: Credentials,
    session_id: str,
    process_id: str,
    signal: str,
    *,
    tenant: str | None,
    request_id: str | None,
) -> Call[None]:
    return Call(
        "POST",
        process_path(session_id, process_id) + "/signal",
        _no_content,
        _session_headers(creds, tenant, request_id),
        json=to_wire(SignalRequest(signal=signal)),
    )


def stdin_bytes(data: bytes | str) -> bytes:
    """Bytes for a process's stdin (a str is UTF-8)."""
    return data.encode() if isinstance(data, str) else data


def tar_bytes(tar: bytes | BinaryIO) -> bytes:
    """An archive to upload, whole (a retried upload sends the same bytes again)."""
    return tar if isinstance(tar, bytes) else tar.read()


# --- unauthenticated ------------------------------------------------------------------------


def health_call() -> Call[Health]:
    return Call("GET", "/health", decode_as(Health))


def capabilities_call() -> Call[dict[str, Any]]:
    return Call("GET", "/capabilities", _json)
