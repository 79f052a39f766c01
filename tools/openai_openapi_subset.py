"""Cut the schemas Sluice's OpenAI front answers with out of OpenAI's published OpenAPI document.

    python3 tools/openai_openapi_subset.py <openapi.json of github.com/openai/openai-openapi> <commit>

writes tests/fixtures/upstream/openai_openapi_subset.json: the named schemas and every schema they
reference, unchanged, so tests validate what the HTTP front sends against upstream's own definitions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOTS = (
    "CreateChatCompletionRequest",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionRequest",
    "CreateCompletionResponse",
    "CreateEmbeddingRequest",
    "CreateEmbeddingResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    "OpenAIFile",
    "ListFilesResponse",
    "Batch",
    "ListBatchesResponse",
)
PREFIX = "#/components/schemas/"
OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "upstream" / "openai_openapi_subset.json"


def referenced(node: Any, schemas: dict[str, Any], seen: set[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith(PREFIX):
                name = value.removeprefix(PREFIX)
                if name not in seen:
                    seen.add(name)
                    referenced(schemas[name], schemas, seen)
            else:
                referenced(value, schemas, seen)
    elif isinstance(node, list):
        for value in node:
            referenced(value, schemas, seen)


def main() -> None:
    spec_path, commit = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    schemas = spec["components"]["schemas"]
    seen = set(ROOTS)
    for root in ROOTS:
        referenced(schemas[root], schemas, seen)
    subset = {
        "_source": f"github.com/openai/openai-openapi openapi.json at {commit}, cut by tools/openai_openapi_subset.py",
        "openapi": spec["openapi"],
        "components": {"schemas": {name: schemas[name] for name in sorted(seen)}},
    }
    OUT.write_text(json.dumps(subset, indent=1, sort_keys=True) + "\n")
    print(f"{OUT}: {len(seen)} schemas")


if __name__ == "__main__":
    main()
