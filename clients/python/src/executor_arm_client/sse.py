"""Server-Sent Events of a run: the wire format parsed into typed events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import ProtocolError
from .models import (
    Event,
    OutputEvent,
    ResultEvent,
    StartEvent,
    from_wire,
    run_answer_type,
)

__all__ = [
    "RawEvent",
    "SseParser",
    "parse_event",
    "iter_events",
    "aiter_events",
    "usable_event_id",
]


def usable_event_id(value: str) -> bool:
    """Whether an event id can be sent back as ``Last-Event-ID``: 1+ visible ASCII characters
    (the daemon's ids are; anything else could not be encoded in a header)."""
    return value != "" and all("!" <= c <= "~" for c in value)


@dataclass
class RawEvent:
    event: str = "message"
    id: str | None = None
    data: str = ""


@dataclass
class SseParser:
    """Feeds lines, yields complete events (comments and heartbeats are skipped). An ``id``
    that is not :func:`usable_event_id` is ignored."""

    _event: str | None = None
    _id: str | None = None
    _data: list[str] = field(default_factory=list)

    def feed(self, line: str) -> RawEvent | None:
        line = line.rstrip("\r\n")
        if line == "":
            if not self._data and self._event is None:
                return None
            ev = RawEvent(self._event or "message", self._id, "\n".join(self._data))
            self._event, self._id, self._data = None, None, []
            return ev
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and usable_event_id(value):
            self._id = value
        return None


def parse_event(raw: RawEvent) -> Event | None:
    """The typed event of a raw one; None for an event name this client does not know. Data
    that is not the event's JSON object raises :class:`~.errors.ProtocolError`."""
    if raw.event not in ("start", "stdout", "stderr", "result"):
        return None
    try:
        data = json.loads(raw.data) if raw.data else {}
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        return _typed_event(raw, data)
    except (ValueError, TypeError, KeyError) as e:  # json.JSONDecodeError is a ValueError
        raise ProtocolError(
            f"malformed {raw.event!r} event (id {raw.id!r}): {type(e).__name__}: {e}",
            body=raw.data[:500],
        ) from e


def _typed_event(raw: RawEvent, data: dict[str, Any]) -> Event | None:
    if raw.event == "start":
        exec_id = data["exec_id"]
        if not isinstance(exec_id, str) or not exec_id:
            raise TypeError(f"exec_id: expected a non-empty string, got {exec_id!r}")
        return StartEvent(
            id=raw.id,
            exec_id=exec_id,
            backend=data.get("backend"),
            profile=data.get("profile"),
        )
    if raw.event in ("stdout", "stderr"):
        return OutputEvent(
            id=raw.id,
            stream="stdout" if raw.event == "stdout" else "stderr",
            offset=int(data.get("offset", 0)),
            data=data.get("data"),
            data_b64=data.get("data_b64"),
            partial=data.get("partial") is True,
        )
    if raw.event == "result":
        http_status = int(data.pop("http_status", 200))
        return ResultEvent(
            id=raw.id,
            http_status=http_status,
            result=from_wire(run_answer_type(data), data),
        )
    return None


def iter_events(lines: Iterator[str]) -> Iterator[Event]:
    parser = SseParser()
    for line in lines:
        raw = parser.feed(line)
        if raw is not None:
            ev = parse_event(raw)
            if ev is not None:
                yield ev


async def aiter_events(lines: AsyncIterator[str]) -> AsyncIterator[Event]:
    parser = SseParser()
    async for line in lines:
        raw = parser.feed(line)
        if raw is not None:
            ev = parse_event(raw)
            if ev is not None:
                yield ev
