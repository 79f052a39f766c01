"""deploy/compose.yaml read the way an engine reads it: YAML (anchors and merge keys), variables
interpolated from an environment (`${VAR:-default}` and the other forms of the Compose
Specification), then validated against the specification's JSON schema and parsed by a typed
parser of the specification. No engine needed."""

from __future__ import annotations

import importlib.resources
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from compose_spec import PyCompose

import config_vars

COMPOSE_FILE = config_vars.ROOT / "deploy" / "compose.yaml"
# The Compose Specification's schema as check-jsonschema vendors it (kept current with upstream).
SCHEMA_FILE = "builtin_schemas/vendor/compose-spec.json"

# $$ (a literal $), $VAR, ${VAR} and ${VAR<op><word>} with op one of :- - :? ? :+ + (no nesting).
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|(?P<bare>[A-Za-z_][A-Za-z0-9_]*)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<word>[^{}]*))?\})"
)


class ComposeError(ValueError):
    """The file is not what an engine would accept."""


def _substitute(text: str, environ: Mapping[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["bare"] or match["name"]
        op, word = match["op"], match["word"] or ""
        value = environ.get(name)
        unset_or_empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return word if unset_or_empty else value
        if op in (":?", "?"):
            if unset_or_empty:
                raise ComposeError(f"required variable {name} is missing: {word}")
            return value
        if op in (":+", "+"):
            return "" if unset_or_empty else word
        return value or ""

    if "$" in _VARIABLE.sub("", text):  # a form this reader (and maybe the engine) does not know
        raise ComposeError(f"cannot interpolate {text!r}")
    return _VARIABLE.sub(one, text)


def interpolate(value: Any, environ: Mapping[str, str]) -> Any:
    """Every string value (not the keys) with its variables replaced, as Compose does."""
    if isinstance(value, str):
        return _substitute(value, environ)
    if isinstance(value, dict):
        return {key: interpolate(item, environ) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, environ) for item in value]
    return value


def schema() -> dict:
    return json.loads((importlib.resources.files("check_jsonschema") / SCHEMA_FILE).read_text())


def validate(model: dict) -> None:
    """Raises ComposeError unless both the schema and the typed parser accept the model."""
    validator = jsonschema.Draft202012Validator(schema())
    problems = [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(model)]
    if problems:
        raise ComposeError("compose schema: " + "; ".join(problems))
    try:
        PyCompose.from_json(json.dumps(model))
    except ValueError as exc:
        raise ComposeError(f"compose parser: {exc}") from exc


def load(environ: Mapping[str, str] | None = None, path: Path = COMPOSE_FILE, text: str | None = None) -> dict:
    """The file as the engine sees it with `environ` (default: no variable set), validated."""
    model = interpolate(yaml.safe_load(path.read_text() if text is None else text), environ or {})
    validate(model)
    return model
