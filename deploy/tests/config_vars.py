"""Every service's configuration variables, read from its config.py without importing it.

`load_config(cls, prefix)` reads `<ENV_PREFIX><FIELD_NAME_UPPER>` for each dataclass field,
including the fields inherited from sluice-common's ServiceConfig or ServerConfig; a field that is a block
(`= nested(Block)` or `= nested(Block, env="...")`) reads the block's fields from
`<ENV_PREFIX><FIELD_NAME_UPPER>_` (or `<ENV_PREFIX><env>`), and a block's switch
(`= block_switch(...)`) is the block's own name without the "_". This module applies the same
naming to the source (ast), so no service environment is needed to know the variables.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMON_CONFIG = ROOT / "libs" / "sluice-common" / "src" / "sluice_common" / "config.py"

# service folder -> its package (python -m <package>)
SERVICES = {
    "gateway": "sluice_gateway",
    "inference-adapter": "sluice_inference_adapter",
    "rate-limit": "sluice_rate_limit",
    "evaluation-logging": "sluice_evaluation_logging",
    "triton-local": "sluice_triton_local",
}

# Variables that set one field of every service at once (sluice_common.config.SHARED_SETTINGS):
# load_config reads the shared name when the service's own <PREFIX><FIELD> is unset, so the own
# one still overrides. The drain grace must agree with every pod's terminationGracePeriodSeconds,
# hence one setting for all (the manifests' ConfigMap sluice-shutdown, compose's x-service).
SHARED_VARIABLES = {"shutdown_grace_s": "SLUICE_SHUTDOWN_GRACE_S"}


@dataclass(frozen=True)
class Field:
    name: str  # the variable's name after the prefix, upper-case
    default: str | None  # source text of the default, None when required


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _dataclass_fields(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> list[Field]:
    """The variables of one dataclass, a block's (see the module) spelled out in its place."""
    fields: list[Field] = []
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name, value = node.target.id.upper(), node.value
        call = value if isinstance(value, ast.Call) else None
        how = ast.unparse(call.func) if call is not None else ""
        if call is not None and how == "nested":
            env = _keyword(call, "env")
            prefix = f"{name}_" if env is None else ast.literal_eval(env)
            block = classes[ast.unparse(call.args[0])]
            fields += [Field(f"{prefix}{f.name}".removesuffix("_"), f.default) for f in _dataclass_fields(block, classes)]
        elif call is not None and how == "block_switch":
            fields.append(Field("", ast.unparse(call.args[0]) if call.args else "False"))
        else:
            fields.append(Field(name, None if value is None else ast.unparse(value)))
    return fields


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    tree = ast.parse(path.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


# sluice-common's base configs -> the bases whose fields they inherit, in order.
BASE_CONFIGS = {"ServiceConfig": ("ServiceConfig",), "ServerConfig": ("ServiceConfig", "ServerConfig")}


def base_config_fields(base: str) -> list[Field]:
    """The fields inherited from sluice-common's base config `base` (none for another name)."""
    classes = _classes(COMMON_CONFIG)
    return [field for name in BASE_CONFIGS.get(base, ()) for field in _dataclass_fields(classes[name], classes)]


def config_path(service: str) -> Path:
    return ROOT / "services" / service / "src" / SERVICES[service] / "config.py"


def _prefix_and_fields(service: str) -> tuple[str, dict[str, str | None]]:
    path = config_path(service)
    tree = ast.parse(path.read_text())
    prefix = next(
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "ENV_PREFIX" for t in node.targets)
        and isinstance(node.value, ast.Constant)
    )
    classes = {**_classes(COMMON_CONFIG), **_classes(path)}
    # The config load_config is given: the dataclass that subclasses a base config, else the only one.
    dataclasses = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(isinstance(d, ast.Call) and ast.unparse(d.func) == "dataclass" or ast.unparse(d) == "dataclass" for d in node.decorator_list)
    ]
    # A service of several roles (the gateway's front and job worker) has one per role: its
    # variables are those of every role.
    roles = {cls: base for cls in dataclasses for base in map(ast.unparse, cls.bases) if base in BASE_CONFIGS}
    if not roles:
        (only,) = dataclasses
        roles = {only: ""}
    fields: dict[str, str | None] = {}
    for base in dict.fromkeys(roles.values()):  # inherited first
        fields.update({f.name: f.default for f in base_config_fields(base)})
    for cls in roles:
        fields.update({f.name: f.default for f in _dataclass_fields(cls, classes)})
    return prefix, fields


def service_variables(service: str) -> dict[str, str | None]:
    """{VARIABLE: default source or None} for one service, in declaration order (inherited first)."""
    prefix, fields = _prefix_and_fields(service)
    return {f"{prefix}{name}": default for name, default in fields.items()}


def env_prefix(service: str) -> str:
    """The service's ENV_PREFIX (SLUICE_GATEWAY_, ...)."""
    return _prefix_and_fields(service)[0]


def shared_variables(service: str) -> dict[str, str]:
    """{the service's own variable: the shared variable that sets it too} for the fields it has."""
    prefix, fields = _prefix_and_fields(service)
    return {f"{prefix}{name.upper()}": shared for name, shared in SHARED_VARIABLES.items() if name.upper() in fields}


def services_with_config() -> list[str]:
    return [service for service in SERVICES if config_path(service).is_file()]
