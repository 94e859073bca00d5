"""When and how long to wait before sending a request again."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["RetryPolicy"]


@dataclass(frozen=True)
class RetryPolicy:
    """Retries with exponential backoff and jitter, only for errors whose ``retryable`` is true:

    * an error answer of the daemon that says ``"retryable": true`` (it says so only when
      nothing ran: 429 ``Overloaded``, 503, a 409 ``IdempotencyInProgress``);
    * a 429 or 5xx without the daemon's error body (a proxy's 502 or 504 page), only for a
      request that is safe to repeat: a GET, or one with an ``Idempotency-Key`` (``execute``
      and session ``exec``). Session creation, cancel, delete and upload are not retried then:
      the daemon may have done the work before the proxy gave up;
    * a connection that could not be opened (the request was never sent), or, for a GET, one
      that broke.

    Every attempt of one call sends the same ``Idempotency-Key``.

    ``max_attempts`` counts the first try (1 disables retries). The n-th retry waits a random
    time in ``[backoff/2, backoff]`` with ``backoff = min(max_backoff, initial_backoff *
    multiplier**(n-1))``, and never less than the answer's ``Retry-After`` (capped at
    ``max_retry_after``).
    """

    max_attempts: int = 4
    initial_backoff: float = 0.5
    max_backoff: float = 8.0
    multiplier: float = 2.0
    max_retry_after: float = 60.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be >= 0 and multiplier >= 1")

    @classmethod
    def none(cls) -> RetryPolicy:
        """A policy that never retries."""
        return cls(max_attempts=1)

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        backoff = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        wait = self.rng.uniform(backoff / 2, backoff)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_retry_after))
        return wait
