"""OpenAI's published response schemas as JSON Schema validators.

``tests/data/openai_schemas.json`` is a trimmed copy of the components of OpenAI's OpenAPI document
(source, commit and licence: ``tests/data/README.md``). OpenAPI is not JSON Schema, so ``to_json_schema``
converts the two constructs that differ for these components:

- ``nullable: true`` (OpenAPI 3.0, still used by parts of the 3.1 document) means "or null": the
  node becomes ``anyOf: [node, {type: null}]``;
- ``$ref: #/components/schemas/X`` points into the OpenAPI document: it becomes ``#/$defs/X``.

Everything else (``anyOf``, ``type: null``, ``enum``, ``required``) is JSON Schema 2020-12 already;
OpenAPI's own keywords (``discriminator``, ``x-...``) are annotations a validator ignores.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

SCHEMAS_FILE = Path(__file__).resolve().parent / "data" / "openai_schemas.json"
REF_PREFIX = "#/components/schemas/"

# Not in the spec: a streamed completion chunk. The spec shares CreateCompletionResponse between
# whole and streamed completions, so it has no room for what OpenAI's own streams send: a
# `finish_reason` of null before the last chunk and `usage: null` without include_usage (issue 28).
COMPLETION_CHUNK = "CreateCompletionResponse (streamed)"


def to_json_schema(node: Any) -> Any:
    """One OpenAPI schema node as JSON Schema (see the module docstring)."""
    if isinstance(node, list):
        return [to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "nullable":
            continue
        if key == "properties":  # its keys are property names, never keywords ("nullable", "$ref")
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key == "$ref":
            if not value.startswith(REF_PREFIX):
                raise ValueError(f"$ref {value!r} does not point into components/schemas")
            out[key] = "#/$defs/" + value[len(REF_PREFIX) :]
        else:
            out[key] = to_json_schema(value)
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def or_null(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _completion_chunk(whole: dict[str, Any]) -> dict[str, Any]:
    chunk = copy.deepcopy(whole)
    props = chunk["properties"]
    choice = props["choices"]["items"]["properties"]
    choice["finish_reason"] = or_null(choice["finish_reason"])
    props["usage"] = or_null(props["usage"])
    return chunk


def source() -> dict[str, str]:
    """Where the trimmed copy comes from: repository, path, commit, licence."""
    info: dict[str, str] = json.loads(SCHEMAS_FILE.read_text())["x-source"]
    return info


@functools.cache
def _defs() -> dict[str, Any]:
    components = json.loads(SCHEMAS_FILE.read_text())["schemas"]
    defs = {name: to_json_schema(schema) for name, schema in components.items()}
    defs[COMPLETION_CHUNK] = _completion_chunk(defs["CreateCompletionResponse"])
    return defs


@functools.cache
def validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for the component ``name`` (or ``COMPLETION_CHUNK``), its references resolved."""
    defs = _defs()
    if name not in defs:
        raise KeyError(f"{name!r} is not in {SCHEMAS_FILE.name}; trim it in (tests/openai_spec_trim.py)")
    schema = {"$ref": f"#/$defs/{name}", "$defs": defs}
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def problems(name: str, body: Any) -> list[str]:
    """Every way ``body`` fails the schema ``name``, one line each (empty: it validates)."""
    errors = sorted(validator(name).iter_errors(body), key=lambda e: list(e.absolute_path))
    # best_match descends into an anyOf's branches: "'x' is a required property", not "not valid
    # under any of the given schemas"
    deepest = [best_match([e]) for e in errors]
    return [f"{_where(e.absolute_path)}: {e.message}" for e in deepest if e is not None]


def _where(path: Any) -> str:
    return "body" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
