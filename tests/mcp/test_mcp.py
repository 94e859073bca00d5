"""executor-arm's /mcp driven by the official MCP Python SDK (tests/mcp.rs starts the daemon and
runs this with the venv of scripts/mcp-client-venv.sh).

Environment: MCP_BASE (http://127.0.0.1:port), MCP_SERVICE_TOKEN (a service token whose
`capabilities` claim is the grant), MCP_CAPABILITY_TOKEN (a capability token with every
capability), MCP_AUDIT_LOG (the daemon's audit log). Exits non-zero on the first failure.
"""

import asyncio
import base64
import json
import os
import sys
import time

import httpx2
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

BASE = os.environ["MCP_BASE"]
URL = BASE + "/mcp"
SERVICE = os.environ["MCP_SERVICE_TOKEN"]
CAP = os.environ["MCP_CAPABILITY_TOKEN"]
AUDIT = os.environ["MCP_AUDIT_LOG"]
TENANT = "tenant-mcp"

TOOLS = {
    "execute",
    "session_create",
    "session_exec",
    "session_delete",
    "files_read",
    "files_write",
    "files_list",
    "run_start",
    "run_status",
    "run_cancel",
    "session_pause",
    "session_resume",
    "process_list",
    "process_output",
    "process_stdin",
    "process_signal",
}


def client(mode: str, request_id: str | None = None) -> Client:
    headers = {"Authorization": f"Bearer {SERVICE}", "X-Tenant-ID": TENANT}
    if request_id:
        headers["X-Request-ID"] = request_id
    http = create_mcp_http_client(headers=headers)
    return Client(streamable_http_client(URL, http_client=http), mode=mode)


def structured(result, *, error: bool = False) -> dict:
    """The call's structuredContent; its text content is the same JSON."""
    assert result.is_error is error, f"is_error={result.is_error}: {result}"
    s = result.structured_content
    assert isinstance(s, dict), result
    assert json.loads(result.content[0].text) == s, result.content
    return s


def rest(method: str, path: str, body=None) -> httpx2.Response:
    return httpx2.request(
        method,
        BASE + path,
        headers={"Authorization": f"Bearer {SERVICE}", "X-Tenant-ID": TENANT},
        json=body,
        timeout=60,
    )


def audit_events(exec_id: str) -> list:
    with open(AUDIT) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [line["event"] for line in lines if line.get("exec_id") == exec_id]


def audit_lines(exec_id: str) -> list:
    with open(AUDIT) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [line for line in lines if line.get("exec_id") == exec_id]


async def until(what: str, check, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def tools_and_execute(c: Client, label: str) -> dict:
    listed = await c.list_tools()
    names = {t.name for t in listed.tools}
    assert names == TOOLS, f"{label}: {names}"
    for t in listed.tools:
        assert t.input_schema["type"] == "object", (label, t.name, t.input_schema)
    execute = next(t for t in listed.tools if t.name == "execute")
    assert {"action_type", "command"} <= set(execute.input_schema["required"])

    r = await c.call_tool(
        "execute",
        {"action_type": "shell", "command": "echo", "args": ["hello", label]},
    )
    s = structured(r)
    assert s["success"] is True and s["stdout"] == f"hello {label}\n", s
    assert s["provenance"]["command_hash"].startswith("sha256:"), s
    return s


async def legacy_session() -> None:
    """The 2025-11-25 era: initialize, Mcp-Session-Id, every tool."""
    async with client("legacy") as c:
        assert c.protocol_version == "2025-11-25", c.protocol_version
        await tools_and_execute(c, "legacy")

        # The grant from a capability token argument works as on REST.
        r = await c.call_tool(
            "execute",
            {"action_type": "python", "command": "python3", "args": ["-c", "print(6*7)"],
             "capability_token": CAP},
        )
        assert structured(r)["stdout"] == "42\n"

        # Output as progress notifications while the run goes on.
        progress: list = []

        async def on_progress(p: float, total, message) -> None:
            progress.append((p, message))

        r = await c.call_tool(
            "execute",
            {"action_type": "python", "command": "python3",
             "args": ["-u", "-c", "print('line one'); import sys; print('to stderr', file=sys.stderr); print('line two')"]},
            progress_callback=on_progress,
        )
        s = structured(r)
        assert s["stdout"] == "line one\nline two\n", s
        said = "".join(m or "" for _, m in progress)
        assert "line one" in said and "line two" in said and "[stderr] to stderr" in said, progress
        assert [p for p, _ in progress] == sorted(p for p, _ in progress), progress

        # Refused as REST refuses it: the same status body, as an error result.
        asked = {"action_type": "shell", "command": "rm", "args": ["-rf", "/"]}
        r = await c.call_tool("execute", asked)
        s = structured(r, error=True)
        twin = rest("POST", "/execute", {**asked, "capability_token": CAP})
        assert twin.status_code == 403, twin.text
        t = twin.json()
        assert s["error_type"] == t["error_type"] == "CapabilityViolation", (s, t)
        assert s["allowed_commands"] == t["allowed_commands"] and s["error"] == t["error"], (s, t)
        assert s["success"] is False and s["retryable"] is False, s

        # A malformed call is the REST 400 body; a timeout out of range too.
        r = await c.call_tool("execute", {"action_type": "shell", "command": "echo", "timeout_seconds": 0})
        assert structured(r, error=True)["error_type"] == "InvalidRequest"
        r = await c.call_tool("files_write", {"session_id": "ses_x", "path": "a"})
        assert structured(r, error=True)["error_type"] == "InvalidRequest"

        # Sessions and files.
        r = await c.call_tool("session_create", {"language": "python"})
        ses = structured(r)
        sid = ses["id"]
        assert sid.startswith("ses_"), ses
        assert rest("GET", f"/v1/sandbox/sessions/{sid}").status_code == 200, "the twin sees it"
        r = await c.call_tool(
            "files_write", {"session_id": sid, "path": "data/in.txt", "content": "from mcp\n"}
        )
        assert structured(r) == {"session_id": sid, "path": "data/in.txt", "size": 9}
        r = await c.call_tool(
            "files_write", {"session_id": sid, "path": "bin.dat", "content_b64": "AP8A"}
        )
        structured(r)
        r = await c.call_tool(
            "session_exec",
            {"session_id": sid,
             "code": "t = open('data/in.txt').read()\nopen('data/out.txt', 'w').write(t.upper())\nprint(t.strip())"},
        )
        s = structured(r)
        assert s["exit_code"] == 0 and s["stdout"] == "from mcp\n", s
        ends = [line for line in audit_lines(s["exec_id"]) if line["event"] == "execution"]
        assert ends and ends[0].get("via") == "mcp", ends
        r = await c.call_tool("files_read", {"session_id": sid, "path": "data/out.txt"})
        assert structured(r)["content"] == "FROM MCP\n"
        r = await c.call_tool("files_read", {"session_id": sid, "path": "bin.dat"})
        s = structured(r)
        assert s["content_b64"] == "AP8A" and "content" not in s, s
        r = await c.call_tool("files_list", {"session_id": sid, "path": "data"})
        names = sorted(e["name"] for e in structured(r)["entries"])
        assert names == ["in.txt", "out.txt"], names
        # A session exec's run: its status and its cancel name the session.
        r = await c.call_tool(
            "session_exec", {"session_id": sid, "code": "import time; time.sleep(60)", "async": True}
        )
        eid = structured(r)["exec_id"]
        r = await c.call_tool("run_status", {"exec_id": eid, "session_id": sid})
        assert structured(r)["status"] == "running", structured(r)
        r = await c.call_tool("run_status", {"exec_id": eid, "session_id": "ses_nope"})
        assert structured(r, error=True)["error_type"] == "NotFound"
        r = await c.call_tool("run_cancel", {"exec_id": eid, "session_id": sid, "grace_seconds": 0})
        assert structured(r)["status"] == "cancelling", structured(r)

        async def exec_finished():
            st = structured(await c.call_tool("run_status", {"exec_id": eid, "session_id": sid}))
            return st if st["status"] == "finished" else None

        done = await until("the cancelled session exec to finish", exec_finished)
        assert done["result"]["outcome"] == "cancelled", done
        r = await c.call_tool("run_cancel", {"exec_id": eid, "session_id": sid, "grace_seconds": 31})
        assert structured(r, error=True)["error_type"] == "InvalidRequest"
        r = await c.call_tool("files_read", {"session_id": sid, "path": "../etc/passwd"})
        assert structured(r, error=True)["error_type"] == "InvalidRequest"
        r = await c.call_tool("session_delete", {"session_id": sid})
        assert structured(r) == {"session_id": sid, "deleted": True}
        r = await c.call_tool("session_exec", {"session_id": sid, "code": "print(1)"})
        assert structured(r, error=True)["error_type"] == "NotFound"
        assert rest("GET", f"/v1/sandbox/sessions/{sid}").status_code == 404

        # Async runs: start, status, cancel.
        r = await c.call_tool(
            "run_start",
            {"action_type": "python", "command": "python3",
             "args": ["-c", "import time; time.sleep(120)"], "timeout_seconds": 600},
        )
        s = structured(r)
        exec_id = s["exec_id"]
        assert s["status"] == "running", s
        r = await c.call_tool("run_status", {"exec_id": exec_id})
        assert structured(r)["status"] == "running"
        r = await c.call_tool("run_cancel", {"exec_id": exec_id, "grace_seconds": 1})
        structured(r)

        async def finished():
            st = structured(await c.call_tool("run_status", {"exec_id": exec_id}))
            return st if st["status"] == "finished" else None

        done = await until("the cancelled run to finish", finished)
        assert done["result"]["outcome"] == "cancelled", done
        r = await c.call_tool("run_cancel", {"exec_id": exec_id})
        assert structured(r, error=True)["error_type"] == "AlreadyFinished"
        r = await c.call_tool("run_status", {"exec_id": "no-such-run"})
        assert structured(r, error=True)["error_type"] == "NotFound"

        # An MCP execute is audited as its REST twin is.
        mcp = structured(await c.call_tool("execute", {"action_type": "shell", "command": "echo", "args": ["audited"]}))
        twin = rest("POST", "/execute", {"action_type": "shell", "command": "echo", "args": ["audited"],
                                          "capability_token": CAP}).json()

        async def audited():
            a, b = audit_events(mcp["exec_id"]), audit_events(twin["exec_id"])
            return (a, b) if a and b and len(a) == len(b) else None

        a, b = await until("both runs' audit lines", audited)
        assert a == b, (a, b)
        # The MCP run's start and end lines name the front end; the REST twin's name none.
        for line in audit_lines(mcp["exec_id"]):
            if line["event"] in ("execution_start", "execution"):
                assert line.get("via") == "mcp", line
        assert all("via" not in line for line in audit_lines(twin["exec_id"]))
        assert mcp["provenance"]["subject"] == twin["provenance"]["subject"], (mcp, twin)

        # A receipt asked for comes in the result, as on REST, and is the run's receipt.
        signed = structured(await c.call_tool(
            "execute", {"action_type": "shell", "command": "echo", "args": ["signed"], "receipt": True}
        ))
        assert signed["receipt"]["payloadType"] == "application/vnd.in-toto+json", signed
        served = rest("GET", f"/v1/executions/{signed['exec_id']}/receipt")
        assert served.status_code == 200 and served.json() == signed["receipt"], served.text


async def processes_and_pause() -> None:
    """A background process through the tools: started by session_exec, listed, fed stdin, its
    output read by offsets (as its REST twin reads it), signalled. A pause ends the session's
    processes; a resume brings its workspace back."""
    async with client("legacy") as c:
        sid = structured(await c.call_tool("session_create", {"language": "python"}))["id"]
        code = (
            "import sys, time\n"
            "print('ready', flush=True)\n"
            "for line in sys.stdin:\n"
            "    print('got ' + line.strip(), flush=True)\n"
            "print('stdin closed', flush=True)\n"
            "time.sleep(300)\n"
        )
        r = await c.call_tool("session_exec", {"session_id": sid, "code": code, "background": True})
        pid = structured(r)["process_id"]
        listed = structured(await c.call_tool("process_list", {"session_id": sid}))["processes"]
        assert [(p["process_id"], p["state"]) for p in listed] == [(pid, "running")], listed

        async def output(at: int = 0) -> dict:
            r = await c.call_tool(
                "process_output", {"session_id": sid, "process_id": pid, "stdout_from": at}
            )
            return structured(r)

        async def says(text: str, at: int = 0):
            o = await output(at)
            return o if text in o["stdout"]["text"] else None

        o = await until("the process to say it is ready", lambda: says("ready"))
        assert o["stdout"]["from"] == 0 and o["state"] == "running", o
        at = o["stdout"]["next"]
        twin = rest("GET", f"/v1/sandbox/sessions/{sid}/processes/{pid}/output?stdout_from={at}")
        assert twin.status_code == 200, twin.text
        assert twin.json() == await output(at), twin.json()

        r = await c.call_tool("process_stdin", {"session_id": sid, "process_id": pid, "data": "one\n"})
        assert structured(r) == {"session_id": sid, "process_id": pid, "sent": True}
        b64 = base64.b64encode(b"two\n").decode()
        r = await c.call_tool(
            "process_stdin", {"session_id": sid, "process_id": pid, "data_b64": b64, "eof": True}
        )
        structured(r)
        o = await until("the process to read its stdin to the end", lambda: says("stdin closed", at))
        assert o["stdout"]["text"] == "got one\ngot two\nstdin closed\n", o
        assert o["stdout"]["from"] == at and o["stdout"]["more"] is False, o
        r = await c.call_tool("process_stdin", {"session_id": sid, "process_id": pid, "data": "late"})
        assert structured(r, error=True)["error_type"] == "AlreadyFinished"
        r = await c.call_tool("process_output", {"session_id": sid, "process_id": "nope"})
        assert structured(r, error=True)["error_type"] == "NotFound"

        r = await c.call_tool("process_signal", {"session_id": sid, "process_id": pid, "signal": "TERM"})
        assert structured(r) == {"session_id": sid, "process_id": pid, "sent": True}

        async def exited():
            o = await output()
            return o if o["state"] == "exited" else None

        o = await until("the signalled process to end", exited)
        assert o["exit_code"] != 0, o
        r = await c.call_tool("process_signal", {"session_id": sid, "process_id": pid, "signal": "KILL"})
        assert structured(r, error=True)["error_type"] == "AlreadyFinished"

        # A pause ends the processes; a resume brings the workspace back.
        structured(await c.call_tool("files_write", {"session_id": sid, "path": "kept.txt", "content": "kept\n"}))
        r = await c.call_tool(
            "session_exec",
            {"session_id": sid, "code": "import time; time.sleep(300)", "background": True},
        )
        sleeper = structured(r)["process_id"]
        paused = structured(await c.call_tool("session_pause", {"session_id": sid}))
        assert paused["state"] == "paused", paused
        listed = structured(await c.call_tool("process_list", {"session_id": sid}))["processes"]
        assert listed == [], listed
        r = await c.call_tool("process_signal", {"session_id": sid, "process_id": sleeper, "signal": "TERM"})
        assert structured(r, error=True)["error_type"] == "NotFound"
        resumed = structured(await c.call_tool("session_resume", {"session_id": sid}))
        assert resumed["state"] == "running", resumed
        r = await c.call_tool("files_read", {"session_id": sid, "path": "kept.txt"})
        assert structured(r)["content"] == "kept\n"
        r = await c.call_tool("session_pause", {"session_id": "ses_nope"})
        assert structured(r, error=True)["error_type"] == "NotFound"
        structured(await c.call_tool("session_delete", {"session_id": sid}))


async def cancelled_call() -> None:
    """A call the client gives up cancels its run (the call says nothing of cancel_on_disconnect):
    the run ends cancelled, and none of its processes is left on the host."""
    async with client("legacy", request_id="mcp-cancel-1") as c:
        try:
            await c.call_tool(
                "execute",
                {"action_type": "python", "command": "python3",
                 "args": ["-c", "import time; time.sleep(120)  # mcp-cancel-marker"]},
                read_timeout_seconds=2,
            )
            raise AssertionError("the call was expected to time out")
        except AssertionError:
            raise
        except Exception:
            pass

        async def ended():
            with open(AUDIT) as f:
                lines = [json.loads(line) for line in f if line.strip()]
            mine = [line for line in lines if line.get("request_id") == "mcp-cancel-1"]
            done = [line for line in mine if line["event"] == "execution"]
            return done[0] if done else None

        end = await until("the abandoned run's end line", ended)
        assert end["outcome"] == "cancelled", end

        def leftovers():
            found = []
            for pid in os.listdir("/proc"):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"mcp-cancel-marker" in f.read():
                            found.append(pid)
                except OSError:
                    pass
            return found

        async def none_left():
            return not leftovers()

        await until("no process of the cancelled run on the host", none_left)


async def stateless() -> None:
    """The 2026-07-28 revision: no session, every request stands alone."""
    async with client("2026-07-28", request_id="mcp-stateless-1") as c:
        s = await tools_and_execute(c, "stateless")
        # The run's request id is the /mcp request's.
        assert s["provenance"]["request_id"] == "mcp-stateless-1", s["provenance"]


def admission() -> None:
    init = {
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "t", "version": "1"}},
    }
    accept = {"Accept": "application/json, text/event-stream"}
    r = httpx2.post(URL, json=init, headers=accept)
    assert r.status_code == 401, (r.status_code, r.text)
    assert r.headers["www-authenticate"].startswith("Bearer"), r.headers
    assert r.json()["error_type"] == "Unauthorized", r.text
    r = httpx2.post(URL, json=init, headers={**accept, "Authorization": "Bearer not-a-token"})
    assert r.status_code == 401, (r.status_code, r.text)
    auth = {**accept, "Authorization": f"Bearer {SERVICE}"}
    r = httpx2.post(URL, json=init, headers={**auth, "Origin": "http://rebound.invalid"})
    assert r.status_code == 403, (r.status_code, r.text)
    r = httpx2.post(URL, json=init, headers={**auth, "Host": "rebound.invalid"})
    assert r.status_code == 403, (r.status_code, r.text)
    r = httpx2.post(URL, json=init, headers=auth)
    assert r.status_code == 200, (r.status_code, r.text)
    # A page of this machine (the default mcp.allowed_origins) is served.
    r = httpx2.post(URL, json=init, headers={**auth, "Origin": "http://127.0.0.1:6274"})
    assert r.status_code == 200, (r.status_code, r.text)


async def main() -> None:
    admission()
    print("admission: ok", flush=True)
    await legacy_session()
    print("legacy session: ok", flush=True)
    await processes_and_pause()
    print("processes and pause: ok", flush=True)
    await cancelled_call()
    print("cancelled call: ok", flush=True)
    await stateless()
    print("stateless: ok", flush=True)
    print("mcp: OK")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except Exception:
        import traceback

        traceback.print_exc()
        sys.exit(1)
