"""Times `Sandbox.create()` + `commands.run("echo hi")` through the official E2B Python SDK against
the same two steps over executor-arm's REST API (create a bash session, exec `echo hi`), from this
one interpreter, interleaved in blocks so load changes weigh on both. Neither figure includes the
sandbox's end (kill / DELETE), which follows each sample untimed.

Reads E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY (the SDK's own variables), BENCH_REST_URL,
BENCH_CAPABILITY_TOKEN, BENCH_N, BENCH_BLOCK, BENCH_WARMUP; prints one JSON object
{"sdk": [ms…], "rest": [ms…]} on its last line.
"""

import json
import os
import time

import httpx
from e2b import Sandbox

REST = os.environ["BENCH_REST_URL"]
KEY = os.environ["E2B_API_KEY"]
CAP = os.environ["BENCH_CAPABILITY_TOKEN"]
N = int(os.environ.get("BENCH_N", "50"))
BLOCK = int(os.environ.get("BENCH_BLOCK", "10"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "3"))

rest = httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"})


def via_sdk():
    t = time.perf_counter()
    sbx = Sandbox.create()
    r = sbx.commands.run("echo hi")
    ms = (time.perf_counter() - t) * 1e3
    assert r.stdout == "hi\n", r
    sbx.kill()
    return ms


def via_rest():
    t = time.perf_counter()
    c = rest.post(f"{REST}/v1/sandbox/sessions", json={"language": "bash", "capability_token": CAP})
    assert c.status_code == 201, c.text
    sid = c.json()["id"]
    r = rest.post(f"{REST}/v1/sandbox/sessions/{sid}/exec", json={"code": "echo hi"})
    ms = (time.perf_counter() - t) * 1e3
    assert r.status_code == 200 and r.json()["stdout"] == "hi\n", r.text
    d = rest.delete(f"{REST}/v1/sandbox/sessions/{sid}")
    assert d.status_code == 204, d.text
    return ms


for _ in range(WARMUP):
    via_sdk()
    via_rest()
sdk, base = [], []
while len(sdk) < N:
    for _ in range(BLOCK):
        sdk.append(via_sdk())
    for _ in range(BLOCK):
        base.append(via_rest())
print(json.dumps({"sdk": sdk, "rest": base}))
