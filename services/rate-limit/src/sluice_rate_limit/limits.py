"""Limits per tenant and per model from a TOML file, reloaded when the file changes.

    shadow = false                   # decide and record, never deny (every tenant)

    [failure_policy]                 # when Redis cannot be reached, per budget:
    requests_per_minute = "closed"   #   "closed": refuse
    tokens_per_minute = "closed"     #   "open": admit against a local limit of limit / replicas
    requests_in_flight = "open"
    tokens_in_flight = "open"
    model_capacity = "open"

    [defaults]                       # every tenant without its own entry (0 or absent: unlimited)
    requests_per_minute = 60
    tokens_per_minute = 40000
    requests_in_flight = 8
    tokens_in_flight = 16384
    interactive_floor = 0.25         # share of each budget that bulk traffic leaves to interactive
    burst = 0.02                     # share of a per-minute budget admitted at once, then paced
                                     # at limit / window (1.0: no pacing)

    [tenants.acme]                   # fields not given come from [defaults]
    tokens_per_minute = 200000
    shadow = true                    # this tenant only
    [tenants.acme.models."smollm2-135m-instruct"]
    tokens_per_minute = 50000        # this tenant on this model

    [models."smollm2-135m-instruct"] # the model's global capacity, every tenant together
    requests_in_flight = 64
    tokens_in_flight = 131072

A file that does not parse, names an unknown field or gives one a value of the wrong type (a
value where a table belongs, a limit above 2**53) is rejected as a whole; the limits in force
stay, and the reason is logged and shown by GetUsage.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import structlog

from sluice_rate_limit.budgets import MAX_AMOUNT, Budget, Check, Kind, Policy

log = structlog.stdlib.get_logger("sluice.ratelimit.limits")

BUDGET_FIELDS = ("requests_per_minute", "tokens_per_minute", "requests_in_flight", "tokens_in_flight")
POLICY_FIELDS = (*BUDGET_FIELDS, "model_capacity")
DEFAULT_POLICY = {
    "requests_per_minute": Policy.CLOSED,
    "tokens_per_minute": Policy.CLOSED,
    "requests_in_flight": Policy.OPEN,
    "tokens_in_flight": Policy.OPEN,
    "model_capacity": Policy.OPEN,
}


class LimitsError(ValueError):
    pass


@dataclass(frozen=True)
class BudgetLimits:
    """0 means unlimited."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    requests_in_flight: int = 0
    tokens_in_flight: int = 0
    interactive_floor: float = 0.0
    # Share of a per-minute budget admitted at once before admissions are paced at limit / window
    # (sliding_window.py); 1.0 turns pacing off.
    burst: float = 0.02
    shadow: bool = False


@dataclass(frozen=True)
class TenantLimits:
    base: BudgetLimits
    models: dict[str, BudgetLimits] = field(default_factory=dict)

    def for_model(self, model: str) -> BudgetLimits:
        return self.models.get(model, self.base)


@dataclass(frozen=True)
class Limits:
    defaults: TenantLimits = field(default_factory=lambda: TenantLimits(BudgetLimits()))
    tenants: dict[str, TenantLimits] = field(default_factory=dict)
    models: dict[str, BudgetLimits] = field(default_factory=dict)
    policy: dict[str, Policy] = field(default_factory=lambda: dict(DEFAULT_POLICY))
    shadow: bool = False
    version: str = ""
    # (tenant, model) -> (checks with cost 0 and whether each is token-based, shadow): built once
    _plans: dict[tuple[str, str], tuple[list[tuple[Check, bool]], bool]] = field(default_factory=dict, compare=False, repr=False)

    def tenant(self, name: str) -> TenantLimits:
        return self.tenants.get(name, self.defaults)

    def checks(self, tenant: str, model: str, interactive: bool, requests: int, tokens: int) -> tuple[list[Check], bool]:
        """The checks of one request, and whether it is decided in shadow mode."""
        plan = self._plans.get((tenant, model))
        if plan is None:
            mine = self.tenant(tenant).for_model(model)
            templates = _budget_checks(mine, f"t:{tenant}", None, self.policy)
            capacity = self.models.get(model)
            if capacity is not None:
                templates += _budget_checks(capacity, "m", Budget.MODEL_CAPACITY, self.policy)
            if len(self._plans) > 100_000:
                self._plans.clear()
            plan = self._plans[(tenant, model)] = (templates, self.shadow or mine.shadow)
        templates, shadow = plan
        checks = []
        for t, tokens_based in templates:
            cost = tokens if tokens_based else requests
            checks.append(Check(t.budget, t.kind, t.key, t.limit, cost, t.floor, t.burst, t.refundable, t.policy, t.name))
        return checks, shadow

    def known_pairs(self) -> list[tuple[str, str]]:
        pairs = []
        for name, tenant in self.tenants.items():
            for model in {*tenant.models, *self.models} or {""}:
                pairs.append((name, model))
        return pairs


_KIND = {
    "requests_per_minute": (Budget.REQUESTS_PER_MINUTE, Kind.WINDOW, "rpm", False),
    "tokens_per_minute": (Budget.TOKENS_PER_MINUTE, Kind.WINDOW, "tpm", True),
    "requests_in_flight": (Budget.REQUESTS_IN_FLIGHT, Kind.GAUGE, "rif", False),
    "tokens_in_flight": (Budget.TOKENS_IN_FLIGHT, Kind.GAUGE, "tif", True),
}


def _budget_checks(limits: BudgetLimits, scope: str, budget: Budget | None, policy: dict[str, Policy]) -> list[tuple[Check, bool]]:
    checks = []
    for name in BUDGET_FIELDS:
        limit = getattr(limits, name)
        if limit <= 0:
            continue
        own_budget, kind, short, tokens_based = _KIND[name]
        checks.append(
            (
                Check(
                    budget=budget or own_budget,
                    kind=kind,
                    key=f"{scope}:{short}",
                    limit=limit,
                    cost=0,
                    floor=int(limit * limits.interactive_floor),
                    burst=max(1, int(limit * limits.burst)) if kind is Kind.WINDOW and limits.burst < 1.0 else 0,
                    refundable=tokens_based and kind is Kind.WINDOW,
                    policy=policy["model_capacity" if budget else name],
                    name=f"model_capacity.{name}" if budget else name,
                ),
                tokens_based,
            )
        )
    return checks


def _budget_limits(where: str, table: object, base: BudgetLimits) -> BudgetLimits:
    if not isinstance(table, dict):
        raise LimitsError(f"{where} must be a table")
    allowed = {f.name for f in fields(BudgetLimits)}
    values: dict[str, object] = {}
    for key, value in table.items():
        if key == "models" and where.startswith("tenants."):
            continue
        if key not in allowed:
            raise LimitsError(f"{where}.{key}: unknown field (known: {', '.join(sorted(allowed))})")
        if key in BUDGET_FIELDS:
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_AMOUNT:
                raise LimitsError(f"{where}.{key} must be an integer >= 0 (0: unlimited) and at most 2**53, got {value!r}")
        elif key == "interactive_floor":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
                raise LimitsError(f"{where}.interactive_floor must be a number in [0, 1), got {value!r}")
            value = float(value)
        elif key == "burst":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < value <= 1.0:
                raise LimitsError(f"{where}.burst must be a number in (0, 1], got {value!r}")
            value = float(value)
        elif key == "shadow" and not isinstance(value, bool):
            raise LimitsError(f"{where}.shadow must be true or false, got {value!r}")
        values[key] = value
    return replace(base, **values)  # type: ignore[arg-type]


def _table(where: str, value: object) -> dict[str, object]:
    """`value` if it is a table (of tables, budgets or policies), else the file is rejected."""
    if not isinstance(value, dict):
        raise LimitsError(f"{where} must be a table, got {value!r}")
    return value


def parse_limits(text: str) -> Limits:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LimitsError(f"not valid TOML: {exc}") from None
    unknown = set(document) - {"shadow", "failure_policy", "defaults", "tenants", "models"}
    if unknown:
        raise LimitsError(f"unknown top-level field(s): {', '.join(sorted(unknown))}")
    shadow = document.get("shadow", False)
    if not isinstance(shadow, bool):
        raise LimitsError(f"shadow must be true or false, got {shadow!r}")
    policy = dict(DEFAULT_POLICY)
    for key, value in _table("failure_policy", document.get("failure_policy", {})).items():
        if key not in POLICY_FIELDS:
            raise LimitsError(f"failure_policy.{key}: unknown budget (known: {', '.join(POLICY_FIELDS)})")
        if value not in ("open", "closed"):
            raise LimitsError(f'failure_policy.{key} must be "open" or "closed", got {value!r}')
        policy[key] = Policy(value)
    defaults = _budget_limits("defaults", document.get("defaults", {}), BudgetLimits())
    tenants: dict[str, TenantLimits] = {}
    raw_tenants = document.get("tenants", {})
    if not isinstance(raw_tenants, dict):
        raise LimitsError("tenants must be a table of [tenants.<name>] tables")
    for name, table in raw_tenants.items():
        base = _budget_limits(f"tenants.{name}", table, defaults)
        per_model = {
            model: _budget_limits(f"tenants.{name}.models.{model}", sub, base)
            for model, sub in _table(f"tenants.{name}.models", table.get("models", {})).items()
        }
        tenants[name] = TenantLimits(base, per_model)
    models = {name: _budget_limits(f"models.{name}", table, BudgetLimits()) for name, table in _table("models", document.get("models", {})).items()}
    version = hashlib.sha256(text.encode()).hexdigest()[:16]
    return Limits(TenantLimits(defaults), tenants, models, policy, shadow, version)


class LimitsFile:
    """The limits in force, re-read when the file's modification time or size changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.error = ""
        self._stamp: tuple[int, int] | None = None
        self.current = self._read()  # a bad file at startup is fatal: raise

    def _stat(self) -> tuple[int, int]:
        stat = os.stat(self.path)
        return stat.st_mtime_ns, stat.st_size

    def _read(self) -> Limits:
        stamp = self._stat()
        limits = parse_limits(self.path.read_text())
        self._stamp = stamp
        return limits

    def maybe_reload(self) -> bool | None:
        """True: new limits in force; False: the file changed but was rejected; None: unchanged."""
        try:
            stamp = self._stat()
        except OSError as exc:
            return self._reject(stamp=None, reason=f"cannot read {self.path}: {exc}")
        if stamp == self._stamp:
            return None
        try:
            limits = parse_limits(self.path.read_text())
        except (OSError, UnicodeDecodeError, LimitsError) as exc:
            return self._reject(stamp, str(exc))
        self._stamp = stamp
        self.error = ""
        if limits.version != self.current.version:
            self.current = limits
            log.info("limits_reloaded", path=str(self.path), version=limits.version)
            return True
        return None

    def _reject(self, stamp: tuple[int, int] | None, reason: str) -> bool | None:
        if stamp is not None:
            self._stamp = stamp  # log a given bad file once, not at every poll
        if reason == self.error:
            return None
        self.error = reason
        log.error("limits_rejected", path=str(self.path), reason=reason, kept_version=self.current.version)
        return False
