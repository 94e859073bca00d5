"""Every model against its schema in openapi/executor-arm.json: a property the document adds,
drops or makes (not) required fails here until the model follows."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from conftest import OPENAPI

from executor_arm_client import models
from executor_arm_client.errors import _BY_TYPE
from executor_arm_client.models import NARROWED, SCHEMAS, wire_name


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    with open(OPENAPI) as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def _schema(document: dict[str, Any], name: str) -> dict[str, Any]:
    schemas: dict[str, Any] = document["components"]["schemas"]
    assert name in schemas, f"the document has no schema {name}"
    schema: dict[str, Any] = schemas[name]
    return schema


@pytest.mark.parametrize("model", list(SCHEMAS), ids=lambda m: m.__name__)
def test_model_fields_match_the_schema(document: dict[str, Any], model: type) -> None:
    schema = _schema(document, SCHEMAS[model])
    properties = set(schema.get("properties", {}))
    required = set(schema.get("required", []))
    fields = {wire_name(f): f for f in dataclasses.fields(model)}
    assert set(fields) - properties == set(), f"{model.__name__}: fields not in the schema"
    assert properties - set(fields) == set(), f"{model.__name__}: schema properties not modelled"
    for name, f in fields.items():
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        assert has_default == (name not in required), (
            f"{model.__name__}.{f.name}: required in the schema = {name in required}, "
            f"default in the model = {has_default}"
        )


@pytest.mark.parametrize("model", list(NARROWED), ids=lambda m: m.__name__)
def test_narrowed_models_have_their_schemas_properties(
    document: dict[str, Any], model: type
) -> None:
    schema = _schema(document, NARROWED[model])
    properties = set(schema.get("properties", {}))
    fields = {wire_name(f): f for f in dataclasses.fields(model)}
    assert set(fields) == properties, f"{model.__name__}: fields differ from {NARROWED[model]}"
    for name in schema.get("required", []):
        f = fields[name]
        assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, (
            f"{model.__name__}.{f.name}: required in the schema, a default in the model"
        )


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = set()
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.add(ref.rsplit("/", 1)[-1])
        for value in node.values():
            found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node)) if node else set()
    return set()


CLIENT_OPERATIONS = {
    "execute",
    "get_execution",
    "stream_execution",
    "cancel_execution",
    "create_session",
    "get_session",
    "delete_session",
    "session_exec",
    "get_session_exec",
    "stream_session_exec",
    "cancel_session_exec",
    "list_session_files",
    "get_session_file",
    "put_session_file",
    "list_session_processes",
    "stream_session_process",
    "write_session_process_stdin",
    "signal_session_process",
    "get_execution_receipt",
    "get_session_exec_receipt",
    "list_receipt_keys",
    "health",
}


def test_every_object_schema_the_client_uses_is_modelled(document: dict[str, Any]) -> None:
    seen: set[str] = set()
    operations = set()
    for item in document["paths"].values():
        for op in item.values():
            if isinstance(op, dict) and op.get("operationId") in CLIENT_OPERATIONS:
                operations.add(op["operationId"])
                seen |= _refs({k: op.get(k) for k in ("requestBody", "responses")})
    assert operations == CLIENT_OPERATIONS
    # Follow nested references (ExecutionResult -> Provenance -> ...).
    schemas = document["components"]["schemas"]
    todo = list(seen)
    while todo:
        for ref in _refs(schemas[todo.pop()]):
            if ref not in seen:
                seen.add(ref)
                todo.append(ref)
    objects = {n for n in seen if schemas[n].get("type") == "object"}
    assert objects - set(SCHEMAS.values()) == set()


def test_enums_match(document: dict[str, Any]) -> None:
    import typing

    for alias, schema in [
        (models.ActionType, "ActionType"),
        (models.BackendKind, "BackendKind"),
        (models.KilledReason, "KilledReason"),
        (models.ProcessSignal, "ProcessSignal"),
        (models.ProcessState, "ProcessState"),
    ]:
        assert set(typing.get_args(alias)) == set(_schema(document, schema)["enum"])
    outcome = _schema(document, "ExecutionResult")["properties"]["outcome"]["pattern"]
    assert set(typing.get_args(models.Outcome)) == set(re.findall(r"\w+", outcome))


def test_every_documented_error_type_has_its_exception(document: dict[str, Any]) -> None:
    description = _schema(document, "ErrorBody")["properties"]["error_type"]["description"]
    documented = set(re.findall(r"`(\w+)`", description))
    assert documented, "no error_type listed in the ErrorBody schema"
    assert documented - set(_BY_TYPE) == set()
