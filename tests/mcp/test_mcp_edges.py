"""executor-arm's /mcp at its edges, beside each call's REST twin (tests/mcp.rs `mcp_edges` starts
the daemon, a stand-in replica and the state store records, and runs this with the venv of
scripts/mcp-client-venv.sh).

Environment: MCP_BASE (http://127.0.0.1:port; the daemon's sessions.max_file_bytes is 4096),
MCP_SERVICE_TOKEN (a service token whose `capabilities` claim is the grant), MCP_SINGLE_USE_TOKEN
(the same, single-use), MCP_OTHER_SERVICE_TOKEN (another service's), MCP_PEER_SESSION (a session the state store says a replica holds: it
answers a synchronous exec after 35 s), MCP_GONE_SESSION and MCP_GONE_ADDRESS (a session whose
replica cannot be reached, and that replica's address). Exits non-zero on the first failure.
"""

import asyncio
import json
import os
import sys

import httpx2
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

BASE = os.environ["MCP_BASE"]
URL = BASE + "/mcp"
SERVICE = os.environ["MCP_SERVICE_TOKEN"]
SINGLE_USE = os.environ["MCP_SINGLE_USE_TOKEN"]
OTHER = os.environ["MCP_OTHER_SERVICE_TOKEN"]
PEER_SESSION = os.environ["MCP_PEER_SESSION"]
GONE_SESSION = os.environ["MCP_GONE_SESSION"]
GONE_ADDRESS = os.environ["MCP_GONE_ADDRESS"]
TENANT = "tenant-edges"
MAX_FILE = 4096


def client(token: str = SERVICE) -> Client:
    headers = {
        "Authorization": f"Bearer {token}",
        "X-Tenant-ID": TENANT,
        # Not the caller's credentials: never handed to another replica.
        "Cookie": "session=not-for-the-peer",
        "X-Smuggled": "not-for-the-peer",
    }
    http = create_mcp_http_client(headers=headers)
    return Client(streamable_http_client(URL, http_client=http), mode="legacy")


def structured(result, *, error: bool = False) -> dict:
    assert result.is_error is error, f"is_error={result.is_error}: {result}"
    s = result.structured_content
    assert isinstance(s, dict), result
    assert json.loads(result.content[0].text) == s, result.content
    return s


def rest(method: str, path: str, **kw) -> httpx2.Response:
    return httpx2.request(
        method,
        BASE + path,
        headers={"Authorization": f"Bearer {SERVICE}", "X-Tenant-ID": TENANT},
        timeout=60,
        **kw,
    )


async def held_elsewhere(c: Client) -> None:
    """A session whose replica cannot be reached is an unknown session, as on REST, and its
    answer names no replica."""
    port = GONE_ADDRESS.rsplit(":", 1)[1]
    for tool, args in [
        ("files_read", {"session_id": GONE_SESSION, "path": "a.txt"}),
        ("files_list", {"session_id": GONE_SESSION}),
        ("session_exec", {"session_id": GONE_SESSION, "code": "print(1)"}),
        ("session_delete", {"session_id": GONE_SESSION}),
        ("run_status", {"session_id": GONE_SESSION, "exec_id": "exec-1"}),
        ("run_cancel", {"session_id": GONE_SESSION, "exec_id": "exec-1"}),
    ]:
        r = await c.call_tool(tool, args)
        s = structured(r, error=True)
        assert s["error_type"] == "NotFound", (tool, s)
        assert port not in r.content[0].text and "127.0.0.1" not in r.content[0].text, (tool, s)
    twin = rest("GET", f"/v1/sandbox/sessions/{GONE_SESSION}/files/a.txt")
    assert twin.status_code == 404 and twin.json()["error_type"] == "NotFound", twin.text


async def held_by_peer(c: Client) -> None:
    """A held session's calls are relayed: a file call's 404 as it is, and a synchronous exec's
    answer however long its run takes to answer (35 s here)."""
    r = await c.call_tool("files_read", {"session_id": PEER_SESSION, "path": "a/..?x#y"})
    assert structured(r, error=True)["error_type"] == "NotFound"
    r = await c.call_tool("session_exec", {"session_id": PEER_SESSION, "code": "slow()"})
    s = structured(r)
    assert s["stdout"] == "from the peer\n", s


async def file_limits(c: Client) -> None:
    """files_write is bounded by sessions.max_file_bytes as the REST PUT is (413)."""
    sid = structured(await c.call_tool("session_create", {"language": "python"}))["id"]
    try:
        r = await c.call_tool(
            "files_write", {"session_id": sid, "path": "max.txt", "content": "x" * MAX_FILE}
        )
        assert structured(r)["size"] == MAX_FILE
        r = await c.call_tool(
            "files_write", {"session_id": sid, "path": "over.txt", "content": "x" * (MAX_FILE + 1)}
        )
        s = structured(r, error=True)
        twin = rest("PUT", f"/v1/sandbox/sessions/{sid}/files/over.txt", content=b"x" * (MAX_FILE + 1))
        assert twin.status_code == 413, twin.text
        assert s["error_type"] == twin.json()["error_type"] == "PayloadTooLarge", (s, twin.text)
        r = await c.call_tool("files_read", {"session_id": sid, "path": "over.txt"})
        assert structured(r, error=True)["error_type"] == "NotFound", "nothing was written"
    finally:
        await c.call_tool("session_delete", {"session_id": sid})


async def single_use() -> None:
    """A single-use service token authenticates one call, whose grant it is; the next is 401."""
    async with client(SINGLE_USE) as c:
        r = await c.call_tool("execute", {"action_type": "shell", "command": "echo", "args": ["once"]})
        assert structured(r)["stdout"] == "once\n", r
        r = await c.call_tool("execute", {"action_type": "shell", "command": "echo", "args": ["twice"]})
        assert structured(r, error=True)["error_type"] == "Unauthorized"


async def session_of_its_opener() -> None:
    """An MCP session (Mcp-Session-Id) is the calling service's that opened it: another service
    that learns its id can neither end it, nor read its streams, nor send into it (404, as an
    unknown session); its opener goes on using it."""
    accept = {"Accept": "application/json, text/event-stream"}
    init = {
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "t", "version": "1"}},
    }

    def as_(token: str, sid: str | None = None) -> dict:
        h = {**accept, "Authorization": f"Bearer {token}", "MCP-Protocol-Version": "2025-11-25"}
        if sid is not None:
            h["Mcp-Session-Id"] = sid
        return h

    r = httpx2.post(URL, json=init, headers=as_(SERVICE))
    assert r.status_code == 200, (r.status_code, r.text)
    sid = r.headers["mcp-session-id"]
    r = httpx2.post(URL, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                    headers=as_(SERVICE, sid))
    assert r.status_code == 202, (r.status_code, r.text)
    listed = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}

    r = httpx2.delete(URL, headers=as_(OTHER, sid))
    assert r.status_code == 404, ("another service ended the session", r.status_code, r.text)
    r = httpx2.get(URL, headers={**as_(OTHER, sid), "Last-Event-ID": "0/0"}, timeout=5)
    assert r.status_code == 404, ("another service read the session", r.status_code, r.text)
    r = httpx2.post(URL, json=listed, headers=as_(OTHER, sid))
    assert r.status_code == 404, ("another service sent into the session", r.status_code, r.text)
    r = httpx2.post(URL, json=listed, headers=as_(SERVICE, sid + "x"))
    assert r.status_code == 404, ("a forged session id", r.status_code, r.text)
    r = httpx2.post(URL, json=listed, headers=as_(SERVICE, sid))
    assert r.status_code == 200 and "execute" in r.text, ("the opener's session", r.status_code, r.text)
    r = httpx2.delete(URL, headers=as_(SERVICE, sid))
    assert r.status_code in (200, 202, 204), (r.status_code, r.text)


async def with_client(check) -> None:
    async with client() as c:
        await check(c)


async def main() -> bool:
    """Every check runs, each failure printed: the run fails when any did."""
    failed = False
    for name, check in [
        ("an MCP session is its opener's", session_of_its_opener),
        ("file limits", lambda: with_client(file_limits)),
        ("single-use service token", single_use),
        ("held by an unreachable replica", lambda: with_client(held_elsewhere)),
        ("held by a slow replica", lambda: with_client(held_by_peer)),
    ]:
        try:
            await check()
            print(f"{name}: ok", flush=True)
        except Exception:
            import traceback

            print(f"{name}: FAILED", flush=True)
            traceback.print_exc(file=sys.stdout)
            failed = True
    if not failed:
        print("mcp edges: OK")
    return not failed


if __name__ == "__main__":
    sys.exit(0 if asyncio.run(main()) else 1)
