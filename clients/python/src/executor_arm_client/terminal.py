"""A session's terminal: ``GET /v1/sandbox/sessions/{id}/terminal``, a WebSocket attached to the
session's shell on a pseudo-terminal inside its sandbox.

Needs the ``terminal`` extra (``pip install executor-arm-client[terminal]``: the ``websockets``
library). Binary frames are bytes both ways; :meth:`Terminal.resize` sends the one text frame the
daemon takes. The daemon closes the socket with 1009 for a frame over
``sessions.max_frame_bytes``, 1003 for any other text frame, 1000 when the terminal ended (the
shell exited, or the session ended). Closing it hangs the shell up and kills every process of
the terminal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import ExitStack

import httpx

from .errors import ExecutorArmError, TransportError, error_from_response

try:
    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import ClientConnection, connect
except ImportError as e:  # pragma: no cover - depends on the environment
    _MISSING: ImportError | None = e
else:
    _MISSING = None


class TerminalClosed(ExecutorArmError):
    """The terminal's socket is closed; ``code`` and ``reason`` are the daemon's close frame
    (``code`` None when the socket ended without one)."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"terminal closed ({code}): {reason}")
        self.code = code
        self.reason = reason


class Terminal:
    """An open terminal. Use it as a context manager, or call :meth:`close`."""

    def __init__(self, ws: ClientConnection, stack: ExitStack) -> None:
        self._ws = ws
        self._stack = stack

    def send(self, data: bytes | str) -> None:
        """Bytes typed into the terminal (a ``str`` is sent as UTF-8)."""
        if isinstance(data, str):
            data = data.encode()
        try:
            self._ws.send(data)
        except ConnectionClosed as e:
            raise self._closed(e) from e

    def recv(self, timeout: float | None = None) -> bytes:
        """The next bytes of the terminal's output; :class:`TimeoutError` after ``timeout``
        seconds without any, :class:`TerminalClosed` once the socket closed."""
        try:
            while True:
                msg = self._ws.recv(timeout=timeout)
                if isinstance(msg, bytes):
                    return msg
        except ConnectionClosed as e:
            raise self._closed(e) from e

    def resize(self, cols: int, rows: int) -> None:
        """The terminal's new size (1..=4096 each)."""
        try:
            self._ws.send(json.dumps({"resize": {"cols": cols, "rows": rows}}))
        except ConnectionClosed as e:
            raise self._closed(e) from e

    def close(self) -> None:
        """Hangs the terminal up."""
        self._stack.close()

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _closed(e: ConnectionClosed) -> TerminalClosed:
        frame = e.rcvd
        return TerminalClosed(frame.code if frame else None, frame.reason if frame else "")


def open_terminal(
    base_url: str,
    path: str,
    headers: Mapping[str, str],
    *,
    max_size: int | None = 1 << 20,
    open_timeout: float | None = 30.0,
) -> Terminal:
    """Opens the terminal at ``path`` of the daemon at ``base_url`` with ``headers``; a refusal
    before the upgrade is raised as the daemon's typed error (401, 404, 429, ...)."""
    if _MISSING is not None:
        raise ImportError(
            "the terminal needs the 'terminal' extra: pip install executor-arm-client[terminal]"
        ) from _MISSING
    url = httpx.URL(base_url).join(path)
    ws_url = str(url.copy_with(scheme="wss" if url.scheme == "https" else "ws"))
    stack = ExitStack()
    try:
        ws = stack.enter_context(
            connect(
                ws_url,
                additional_headers=dict(headers),
                max_size=max_size,
                open_timeout=open_timeout,
            )
        )
    except InvalidStatus as e:
        r = e.response
        response = httpx.Response(
            r.status_code,
            headers=dict(r.headers.raw_items()),
            content=bytes(r.body or b""),
            request=httpx.Request("GET", str(url)),
        )
        raise error_from_response(response) from e
    except OSError as e:
        raise TransportError(
            f"terminal connect: {e}", retryable=False, cause=httpx.ConnectError(str(e))
        ) from e
    return Terminal(ws, stack)
