"""A session's ports proxy through ``sessions.port_url`` against the real daemon (local backend):
a server a background process runs answers at the URL, a closed port is 502, and the URL's
shape (encoding, the port's bounds) with the sync and the async client."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
from conftest import Daemon

from executor_arm_client import AsyncClient

SERVER = (
    "import http.server\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = self.path.encode()\n"
    "        self.send_response(200)\n"
    "        self.send_header('Content-Length', str(len(body)))\n"
    "        self.end_headers()\n"
    "        self.wfile.write(body)\n"
    "    def log_message(self, *a):\n"
    "        pass\n"
    "http.server.HTTPServer(('0.0.0.0', 8000), H).serve_forever()\n"
)
#: How long a test polls for the server to answer.
WAIT_S = 30.0


def test_a_background_server_answers_at_its_port_url(daemon: Daemon) -> None:
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    with daemon.client(tenant=tenant) as c:
        info = c.sessions.create("python", ttl_seconds=600)
        try:
            c.sessions.processes.start(info.id, SERVER, timeout_ms=120_000)
            url = c.sessions.port_url(info.id, 8000, "items/a b?x=1")
            assert url == (
                f"{daemon.url}/v1/sandbox/sessions/{info.id}/ports/8000/items/a%20b?x=1"
            )
            headers = {
                "Authorization": f"Bearer {daemon.service_token}",
                "X-Tenant-ID": tenant,
            }
            deadline = time.monotonic() + WAIT_S
            while True:
                r = httpx.get(url, headers=headers, timeout=10)
                if r.status_code == 200:
                    break
                assert r.status_code == 502, r.text
                assert time.monotonic() < deadline, f"no answer at {url}: {r.text}"
                time.sleep(0.2)
            assert r.text == "/items/a%20b?x=1"
            closed = httpx.get(c.sessions.port_url(info.id, 8001), headers=headers, timeout=10)
            assert closed.status_code == 502
            assert closed.json()["error_type"] == "PortClosed"
        finally:
            c.sessions.delete(info.id)


def test_the_async_client_gives_the_same_url(daemon: Daemon) -> None:
    async def urls() -> tuple[str, str]:
        async with AsyncClient(daemon.url + "/", service_token=daemon.service_token) as c:
            return c.sessions.port_url("ses_1", 8080), c.sessions.port_url("ses_1", 8080, "/a/b")

    root, deeper = asyncio.run(urls())
    assert root == f"{daemon.url}/v1/sandbox/sessions/ses_1/ports/8080/"
    assert deeper == f"{daemon.url}/v1/sandbox/sessions/ses_1/ports/8080/a/b"


@pytest.mark.parametrize("port", [0, 65536, -1, True, "8000"])
def test_a_port_outside_1_65535_is_refused(daemon: Daemon, port: object) -> None:
    with daemon.client() as c, pytest.raises(ValueError, match="port"):
        c.sessions.port_url("ses_1", port)  # type: ignore[arg-type]
