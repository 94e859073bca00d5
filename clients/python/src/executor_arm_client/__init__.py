"""Python client of executor-arm, the sandboxed execution daemon.

>>> from executor_arm_client import Client
>>> with Client("http://127.0.0.1:8003", service_token=SVC, capability_token=CAP) as arm:
...     print(arm.execute("echo", ["hello"]).stdout)
"""

from .aio import AsyncClient, AsyncSessions
from .client import DEFAULT_TIMEOUT, Client, Sessions, answer_of
from .errors import (
    AlreadyFinishedError,
    AuthenticationError,
    CapabilityViolationError,
    ConflictError,
    ExecutionTimeoutError,
    ExecutorArmError,
    IdempotencyConflictError,
    IdempotencyInProgressError,
    InternalServerError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitedError,
    RequestTimeoutError,
    SessionBusyError,
    TimeoutExceededError,
    TransportError,
    UnavailableError,
    WorkspaceFullError,
)
from .models import (
    CancelAccepted,
    CancelRequest,
    ConnRecord,
    ErrorBody,
    Event,
    ExecuteRequest,
    ExecutionResult,
    FileEntry,
    FileList,
    Health,
    OutputEvent,
    Provenance,
    ResultEvent,
    RunAccepted,
    RunLinks,
    RunStatus,
    SessionCreateRequest,
    SessionExecRequest,
    SessionInfo,
    SessionLimits,
    StartEvent,
)
from .retry import RetryPolicy
from .tokens import mint_hs256, read_secret_file, unverified_claims

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncSessions",
    "Client",
    "Sessions",
    "DEFAULT_TIMEOUT",
    "answer_of",
    "RetryPolicy",
    "mint_hs256",
    "read_secret_file",
    "unverified_claims",
    # errors
    "ExecutorArmError",
    "TransportError",
    "InvalidRequestError",
    "MethodNotAllowedError",
    "AuthenticationError",
    "CapabilityViolationError",
    "NotFoundError",
    "ConflictError",
    "IdempotencyInProgressError",
    "AlreadyFinishedError",
    "SessionBusyError",
    "IdempotencyConflictError",
    "PayloadTooLargeError",
    "TimeoutExceededError",
    "ExecutionTimeoutError",
    "RequestTimeoutError",
    "RateLimitedError",
    "WorkspaceFullError",
    "UnavailableError",
    "InternalServerError",
    # models
    "CancelAccepted",
    "CancelRequest",
    "ConnRecord",
    "ErrorBody",
    "Event",
    "ExecuteRequest",
    "ExecutionResult",
    "FileEntry",
    "FileList",
    "Health",
    "OutputEvent",
    "Provenance",
    "ResultEvent",
    "RunAccepted",
    "RunLinks",
    "RunStatus",
    "SessionCreateRequest",
    "SessionExecRequest",
    "SessionInfo",
    "SessionLimits",
    "StartEvent",
]
