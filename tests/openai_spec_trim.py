"""Writes ``tests/data/openai_schemas.json``: the components the schema tests need, from OpenAI's spec.

Run it on a copy of ``openapi.json`` from the repository ``openai/openai-openapi``, naming that
copy's commit, then update ``tests/data/README.md`` and ``docs/openai_api.md``::

    python -m tests.openai_spec_trim openapi.json <commit>

It keeps the ROOTS and every component they reference, transitively, and drops what only
documents (descriptions, examples, reference-page metadata): 19 kB instead of 3.4 MB.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tests.openai_spec import REF_PREFIX, SCHEMAS_FILE

ROOTS = (
    "CreateCompletionResponse",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "ListModelsResponse",
    "ErrorResponse",
)
DOC_ONLY = frozenset({"description", "example", "examples", "x-oaiMeta"})


def _refs(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*(_refs(item) for item in node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = {node["$ref"][len(REF_PREFIX) :]} if isinstance(node.get("$ref"), str) else set()
    return found.union(*(_refs(v) for k, v in node.items() if k != "$ref"))


def _strip_docs(node: Any, *, in_properties: bool = False) -> Any:
    if isinstance(node, list):
        return [_strip_docs(item) for item in node]
    if not isinstance(node, dict):
        return node
    if in_properties:  # property names, one of which may well be "description"
        return {name: _strip_docs(sub) for name, sub in node.items()}
    return {k: _strip_docs(v, in_properties=k == "properties") for k, v in node.items() if k not in DOC_ONLY}


def trim(spec: dict[str, Any], roots: tuple[str, ...] = ROOTS) -> dict[str, Any]:
    """The ``roots`` and the components they reference, transitively, without documentation."""
    schemas = spec["components"]["schemas"]
    keep: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo.extend(_refs(schemas[name]))
    return {name: _strip_docs(schemas[name]) for name in sorted(keep)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path, help="openapi.json from openai/openai-openapi")
    parser.add_argument("commit", help="the commit of openai/openai-openapi that spec comes from")
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    source = {
        "repository": "openai/openai-openapi",
        "path": "openapi.json",
        "commit": args.commit,
        "openapi": spec["openapi"],
        "license": "MIT (tests/data/LICENSE.openai-openapi)",
    }
    out = {"x-source": source, "schemas": trim(spec)}
    SCHEMAS_FILE.write_text(json.dumps(out, indent=1, sort_keys=False) + "\n")


if __name__ == "__main__":
    main()
