"""Schemathesis hooks for executor-arm: every generated request carries the live daemon's valid
service token (Authorization: Bearer) and capability token (X-Capability-Token), so the fuzzing
reaches the handlers behind authentication instead of stopping at 401.

The tokens come from the environment (scripts/api-fuzz.sh parses them from `serve --dev`):
EXECUTOR_ARM_FUZZ_SERVICE_TOKEN and EXECUTOR_ARM_FUZZ_CAPABILITY_TOKEN.
"""

import os

import schemathesis
from hypothesis import strategies as st

SERVICE = os.environ["EXECUTOR_ARM_FUZZ_SERVICE_TOKEN"]
CAPABILITY = os.environ["EXECUTOR_ARM_FUZZ_CAPABILITY_TOKEN"]

# An archive upload's body is a tar: raw bytes with no JSON Schema of their own, which
# schemathesis cannot make for this media type unless told how (arbitrary bytes: mostly not a
# tar, which the daemon must refuse with its documented 400).
schemathesis.openapi.media_type("application/x-tar", st.binary(max_size=4096))


@schemathesis.hook
def before_call(context, case, kwargs):
    headers = case.headers if case.headers is not None else {}
    headers["Authorization"] = f"Bearer {SERVICE}"
    # The capability token travels in the header; a generated body field would be a second,
    # random token (400 for "given twice"), so it is taken out.
    if isinstance(case.body, dict):
        case.body.pop("capability_token", None)
    if case.operation.method.upper() in ("POST",) and case.operation.path in (
        "/execute",
        "/v1/sandbox/sessions",
    ):
        headers["X-Capability-Token"] = CAPABILITY
    case.headers = headers
