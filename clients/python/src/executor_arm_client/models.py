"""Request and response objects of the executor-arm API, one dataclass per schema of the
OpenAPI document (``openapi/executor-arm.json``; ``SCHEMAS`` maps each class to its schema).

A field whose JSON name is not a valid Python name carries it in its metadata (``async`` is
``async_``, ``self`` is ``self_``). A field has no default exactly when the schema requires it.
Responses are decoded leniently: properties a newer daemon adds are ignored.
"""

from __future__ import annotations

import base64
import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

__all__ = [
    "ActionType",
    "BackendKind",
    "KilledReason",
    "Outcome",
    "ExecuteRequest",
    "CancelRequest",
    "SessionLimits",
    "SessionCreateRequest",
    "SessionExecRequest",
    "SignalRequest",
    "ProcessSignal",
    "ProcessState",
    "Provenance",
    "ConnRecord",
    "ExecutionResult",
    "ErrorBody",
    "RunLinks",
    "RunAccepted",
    "RunStatus",
    "CancelAccepted",
    "SessionInfo",
    "FileEntry",
    "FileList",
    "ArchiveUploaded",
    "ProcessStarted",
    "ProcessInfo",
    "ProcessList",
    "ReceiptSignature",
    "ReceiptEnvelope",
    "ReceiptKey",
    "ReceiptKeys",
    "Health",
    "StartEvent",
    "OutputEvent",
    "ResultEvent",
    "Event",
    "SCHEMAS",
    "NARROWED",
    "wire_name",
    "to_wire",
    "from_wire",
]

ActionType = Literal["shell", "http", "python", "external"]
BackendKind = Literal["local", "docker", "gvisor"]
KilledReason = Literal["timeout", "oom", "pids", "output_limit", "signal", "cancelled"]
Outcome = Literal["success", "failed", "timeout", "cancelled", "oom"]
#: The signals a session's background process may be sent.
ProcessSignal = Literal["TERM", "KILL", "INT", "HUP"]
#: Where a background process stands.
ProcessState = Literal["running", "exited"]


def _wire(name: str) -> dict[str, str]:
    return {"wire": name}


# --- requests -------------------------------------------------------------------------------


@dataclass
class ExecuteRequest:
    """The body of ``POST /execute``."""

    action_type: ActionType
    command: str
    args: list[str] | None = None
    timeout_seconds: int | None = None
    capability_token: str | None = None
    metadata: dict[str, Any] | None = None
    stdin: str | None = None
    env: dict[str, str] | None = None
    profile: str | None = None
    input: Any = None
    activity: Any = None
    skills: Any = None
    memory: Any = None
    job: Any = None
    task: Any = None
    model: str | None = None
    async_: bool | None = field(default=None, metadata=_wire("async"))
    cancel_on_disconnect: bool | None = None
    #: Put the run's signed receipt in its answer as ``receipt`` (and in a stream's ``result``
    #: event); every finished run has one at ``/v1/executions/{exec_id}/receipt`` either way.
    receipt: bool | None = None


@dataclass
class CancelRequest:
    """The body of a cancel: SIGKILL follows SIGTERM after ``grace_seconds`` (0-30, default 5)."""

    grace_seconds: int | None = None


@dataclass
class SessionLimits:
    """Limits of a session; at creation they may only tighten the profile's."""

    cpus: float | None = None
    memory_mb: int | None = None
    disk_mb: int | None = None
    pids: int | None = None
    output_bytes: int | None = None


@dataclass
class SessionCreateRequest:
    """The body of ``POST /v1/sandbox/sessions`` (schema ``CreateBody``)."""

    language: str
    profile: str | None = None
    ttl_seconds: int | None = None
    idle_timeout_seconds: int | None = None
    limits: SessionLimits | None = None
    capability_token: str | None = None


@dataclass
class SessionExecRequest:
    """The body of ``POST /v1/sandbox/sessions/{id}/exec`` (schema ``ExecBody``)."""

    code: str
    stdin: str | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    timeout_ms: int | None = None
    async_: bool | None = field(default=None, metadata=_wire("async"))
    cancel_on_disconnect: bool | None = None
    #: A background process: the daemon answers 202 with its ``process_id`` at once and keeps
    #: its stdin open (see ``sessions.processes``).
    background: bool | None = None
    #: Keep the exec's stdin open after ``stdin`` (an async or streamed exec): write to it with
    #: ``sessions.exec_stdin``.
    stdin_open: bool | None = None
    #: Put the exec's signed receipt in its answer as ``receipt`` (and in a stream's ``result``
    #: event); every finished exec has one at ``…/execs/{exec_id}/receipt`` either way.
    receipt: bool | None = None


@dataclass
class SignalRequest:
    """The body of ``POST /v1/sandbox/sessions/{id}/processes/{process_id}/signal`` (schema
    ``SignalBody``): ``TERM``, ``KILL``, ``INT`` or ``HUP``; the daemon refuses any other (400)."""

    signal: str


# --- responses ------------------------------------------------------------------------------


@dataclass
class Provenance:
    """What ran, for whom, and the digests of what it wrote."""

    arm_id: str
    timestamp: str
    action_type: ActionType
    command_hash: str
    capabilities_used: list[str]
    exec_id: str
    request_id: str
    backend: BackendKind
    profile: str
    invocation_hash: str
    stdout_sha256: str
    stderr_sha256: str
    token_id: str | None = None
    subject: str | None = None
    executor_def_sha256: str | None = None
    session_id: str | None = None
    code_sha256: str | None = None
    audit_seq: int | None = None
    metadata: dict[str, Any] | None = None


@dataclass
class ConnRecord:
    """One connection of the run to the egress proxy."""

    host: str
    port: int
    method: str
    bytes_up: int
    bytes_down: int
    allowed: bool
    addr: str | None = None
    reason: str | None = None
    status: int | None = None


@dataclass
class ExecutionResult:
    """A run's result: the body of a synchronous ``POST /execute`` or session exec."""

    success: bool
    stdout: str
    stderr: str
    exit_code: int
    duration_ms: int
    provenance: Provenance
    exec_id: str
    outcome: Outcome
    backend: BackendKind
    profile: str
    stdout_truncated: bool
    stderr_truncated: bool
    oom: bool
    stdout_b64: str | None = None
    stderr_b64: str | None = None
    peak_memory_kib: int | None = None
    killed_reason: KilledReason | None = None
    error_code: str | None = None
    network: list[ConnRecord] | None = None
    error: str | None = None
    error_type: str | None = None
    retryable: bool | None = None
    #: The run's receipt (a DSSE envelope, as the daemon signed it) when the request asked for
    #: it (``receipt=True``); check it with :func:`~executor_arm_client.verify_receipt`.
    receipt: dict[str, Any] | None = None

    @property
    def stdout_bytes(self) -> bytes:
        """The exact bytes the run wrote to stdout (``stdout_b64`` when they are not UTF-8)."""
        if self.stdout_b64 is not None:
            return base64.b64decode(self.stdout_b64)
        return self.stdout.encode()

    @property
    def stderr_bytes(self) -> bytes:
        """The exact bytes the run wrote to stderr."""
        if self.stderr_b64 is not None:
            return base64.b64decode(self.stderr_b64)
        return self.stderr.encode()


@dataclass
class ErrorBody:
    """The body of every error answer."""

    success: bool
    error: str
    error_type: str
    retryable: bool
    allowed_commands: list[str] | None = None


@dataclass
class RunLinks:
    """Where to follow an accepted run."""

    self_: str = field(metadata=_wire("self"))
    stream: str
    cancel: str
    #: A background process: where to write its stdin.
    stdin: str | None = None
    #: A background process: where to signal it.
    signal: str | None = None


@dataclass
class RunAccepted:
    """The 202 answer of an ``async`` run."""

    exec_id: str
    status: Literal["running"]
    links: RunLinks
    #: A session's background process: its id (the same as ``exec_id``).
    process_id: str | None = None


@dataclass
class ProcessStarted:
    """The 202 answer of a session's background exec (schema ``RunAccepted``, whose
    ``process_id`` such an answer always has): its ``links`` include ``stdin`` and ``signal``."""

    exec_id: str
    process_id: str
    status: Literal["running"]
    links: RunLinks


@dataclass
class RunStatus:
    """``GET /v1/executions/{exec_id}``: the run's state and, once finished, its answer."""

    exec_id: str
    status: Literal["running", "finished"]
    http_status: int | None = None
    result: ExecutionResult | ErrorBody | None = None

    @property
    def finished(self) -> bool:
        return self.status == "finished"


@dataclass
class CancelAccepted:
    """The 202 answer of a cancel."""

    exec_id: str
    status: Literal["cancelling"]
    grace_seconds: int


@dataclass
class SessionInfo:
    """A session as the daemon describes it."""

    id: str
    language: str
    backend: BackendKind
    profile: str
    tenant: str
    created_at: str
    expires_at: str
    idle_timeout_seconds: int
    limits: SessionLimits
    workspace: str
    execs: int
    state: Literal["running", "paused"]
    running_exec_id: str | None = None
    paused_until: str | None = None


@dataclass
class FileEntry:
    """One entry of a workspace directory."""

    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int


@dataclass
class FileList:
    """A workspace directory's entries."""

    path: str
    entries: list[FileEntry]


@dataclass
class ArchiveUploaded:
    """An archive extracted into a workspace directory (its ``session_archive`` audit line has
    the same size and digest)."""

    path: str
    members: int
    bytes: int
    sha256: str


@dataclass
class ProcessInfo:
    """One of a session's background processes, as its list shows it."""

    process_id: str
    exec_id: str
    #: ``sha256:<hex>`` of its code.
    code_sha256: str
    #: RFC 3339, UTC, milliseconds.
    started_at: str
    state: ProcessState
    #: Once it ended: its exit code (128 + the signal's number when a signal ended it; None when
    #: it ended without a result).
    exit_code: int | None = None

    @property
    def running(self) -> bool:
        return self.state == "running"


@dataclass
class ProcessList:
    """``GET /v1/sandbox/sessions/{id}/processes``: running ones and the last ended ones, oldest
    first (none while the session is paused: a pause ends them)."""

    processes: list[ProcessInfo]


@dataclass
class ReceiptSignature:
    """One signature of a receipt's envelope."""

    #: SHA-256 (hex) of the signing key's raw Ed25519 public key.
    keyid: str
    #: Base64 of the Ed25519 signature over DSSE's pre-authentication encoding.
    sig: str


@dataclass
class ReceiptEnvelope:
    """A run's receipt: a DSSE envelope (``payloadType`` ``application/vnd.in-toto+json``)
    whose payload is an in-toto Statement v1 about the run. The client hands receipts out as
    the JSON the daemon sent (a dict: what was signed, to keep or pass on as it is); this model
    is their shape, which the client checks on the way in."""

    #: Base64 of the statement's JSON.
    payload: str
    payload_type: str = field(metadata=_wire("payloadType"))
    signatures: list[ReceiptSignature]


@dataclass
class ReceiptKey:
    """A public key that verifies the daemon's receipts (and audit checkpoints)."""

    #: SHA-256 (hex) of the raw public key: the ``keyid`` of the signatures it verifies.
    keyid: str
    #: ``ed25519``.
    algorithm: str
    #: The key as a PEM ``PUBLIC KEY`` (SubjectPublicKeyInfo).
    public_key_pem: str
    #: Whether the answering replica signs with it now (the others are keys it kept from
    #: before a rotation, or other replicas' keys).
    signing: bool
    #: Where it is listed from: ``this replica``, ``receipts.public_key_files`` or ``another
    #: replica``.
    source: str


@dataclass
class ReceiptKeys:
    """``GET /v1/receipts/keys``: the replica's signing key first, then the other keys it
    lists."""

    keys: list[ReceiptKey]


@dataclass
class Health:
    """``GET /health``."""

    status: str
    version: str


# --- stream events (the SSE wire format of a run) -------------------------------------------


@dataclass
class StartEvent:
    """The first event of a stream."""

    id: str | None
    exec_id: str
    backend: BackendKind | None
    profile: str | None


@dataclass
class OutputEvent:
    """A chunk of stdout or stderr; ``offset`` is its first byte's position in its stream."""

    id: str | None
    stream: Literal["stdout", "stderr"]
    offset: int
    data: str | None = None
    data_b64: str | None = None
    #: ``framing="lines"``: the event does not end a line (the unfinished last line of a run
    #: that is over, or a piece of a line over 1 MiB).
    partial: bool = False

    @property
    def bytes(self) -> bytes:
        if self.data_b64 is not None:
            return base64.b64decode(self.data_b64)
        return (self.data or "").encode()

    @property
    def text(self) -> str:
        return self.bytes.decode(errors="replace")


@dataclass
class ResultEvent:
    """The last event: the synchronous call's body and its status."""

    id: str | None
    http_status: int
    result: ExecutionResult | ErrorBody


Event = StartEvent | OutputEvent | ResultEvent

#: Each model and the schema of ``openapi/executor-arm.json`` it mirrors.
SCHEMAS: dict[type, str] = {
    ExecuteRequest: "ExecuteRequest",
    CancelRequest: "CancelRequest",
    SessionLimits: "SessionLimits",
    SessionCreateRequest: "CreateBody",
    SessionExecRequest: "ExecBody",
    SignalRequest: "SignalBody",
    Provenance: "Provenance",
    ConnRecord: "ConnRecord",
    ExecutionResult: "ExecutionResult",
    ErrorBody: "ErrorBody",
    RunLinks: "RunLinks",
    RunAccepted: "RunAccepted",
    RunStatus: "RunStatus",
    CancelAccepted: "CancelAccepted",
    SessionInfo: "SessionInfo",
    FileEntry: "FileEntry",
    FileList: "FileList",
    ArchiveUploaded: "ArchiveUploaded",
    ProcessInfo: "ProcessInfo",
    ProcessList: "ProcessList",
    ReceiptSignature: "ReceiptSignature",
    ReceiptEnvelope: "ReceiptEnvelope",
    ReceiptKey: "ReceiptKey",
    ReceiptKeys: "ReceiptKeys",
    Health: "Health",
}

#: Models that narrow a schema (a property it leaves optional is required of them), and that
#: schema: the same properties.
NARROWED: dict[type, str] = {
    ProcessStarted: "RunAccepted",
}



# --- encoding and decoding ------------------------------------------------------------------


def wire_name(f: dataclasses.Field[Any]) -> str:
    """The JSON property name of a model field."""
    return str(f.metadata.get("wire", f.name))


def to_wire(obj: Any) -> Any:
    """A model (or a value holding models) as JSON data; fields left at None are omitted."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is not None:
                out[wire_name(f)] = to_wire(value)
        return out
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_wire(v) for v in obj]
    return obj


_hints_cache: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _hints_cache.get(cls)
    if hints is None:
        module = sys.modules[cls.__module__]
        hints = typing.get_type_hints(cls, globalns=vars(module))
        _hints_cache[cls] = hints
    return hints


def _decode(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if ExecutionResult in members and ErrorBody in members and isinstance(value, dict):
            return from_wire(run_answer_type(value), value)
        for member in members:
            if (
                isinstance(member, type)
                and dataclasses.is_dataclass(member)
                and isinstance(value, dict)
            ):
                return from_wire(member, value)
        if len(members) == 1:
            return _decode(members[0], value)
        return value
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(tp) or (Any,)
        return [_decode(item, v) for v in value]
    if dataclasses.is_dataclass(tp) and isinstance(tp, type) and isinstance(value, dict):
        return from_wire(tp, value)
    return value


def run_answer_type(data: dict[str, Any]) -> type[ExecutionResult] | type[ErrorBody]:
    """Which of the two shapes a finished run's answer has."""
    return ExecutionResult if "exec_id" in data and "stdout" in data else ErrorBody


_T = typing.TypeVar("_T")


def from_wire(cls: type[_T], data: dict[str, Any]) -> _T:
    """A model from JSON data; unknown properties are ignored, missing optional ones are None."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = wire_name(f)
        if name in data:
            kwargs[f.name] = _decode(hints[f.name], data[name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}: the answer lacks the required field {name!r}")
    return cls(**kwargs)
