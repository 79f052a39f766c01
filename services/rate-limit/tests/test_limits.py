"""The limits file: parsing, inheritance, and hot reload that keeps the old limits on a bad file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sluice_rate_limit.budgets import Budget, Kind, Policy
from sluice_rate_limit.limits import LimitsError, LimitsFile, parse_limits

GOOD = """
[failure_policy]
tokens_per_minute = "open"

[defaults]
requests_per_minute = 10
tokens_per_minute = 1000
interactive_floor = 0.2

[tenants.acme]
tokens_per_minute = 5000
[tenants.acme.models."m1"]
requests_in_flight = 2

[tenants.quiet]
shadow = true

[models."m1"]
tokens_in_flight = 4000
"""


def test_tenants_inherit_defaults_and_models_add_capacity() -> None:
    limits = parse_limits(GOOD)
    checks, shadow = limits.checks("acme", "m1", True, 1, 300)
    by_name = {c.name: c for c in checks}
    assert not shadow
    assert by_name["requests_per_minute"].limit == 10
    assert by_name["tokens_per_minute"].limit == 5000 and by_name["tokens_per_minute"].floor == 1000
    assert by_name["tokens_per_minute"].refundable and by_name["tokens_per_minute"].policy is Policy.OPEN
    assert by_name["requests_in_flight"].kind is Kind.GAUGE
    capacity = by_name["model_capacity.tokens_in_flight"]
    assert capacity.budget == Budget.MODEL_CAPACITY and capacity.cost == 300 and capacity.key == "m:tif"
    # another model: no per-model override, no model capacity
    assert {c.name for c in limits.checks("acme", "m2", True, 1, 1)[0]} == {"requests_per_minute", "tokens_per_minute"}
    # an unknown tenant gets the defaults; a shadow tenant is flagged
    assert limits.checks("nobody", "m2", True, 1, 1)[0][1].limit == 1000
    assert limits.checks("quiet", "m2", True, 1, 1)[1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[defaults\n", "not valid TOML"),
        ("[defaults]\nrequests_per_minit = 3\n", "unknown field"),
        ("[defaults]\ntokens_per_minute = -1\n", "integer >= 0"),
        ("[defaults]\ninteractive_floor = 1.5\n", "[0, 1)"),
        ('[failure_policy]\ntokens_per_minute = "maybe"\n', '"open" or "closed"'),
        ("limit = 3\n", "unknown top-level"),
    ],
)
def test_bad_files_are_rejected_with_a_reason(text: str, message: str) -> None:
    with pytest.raises(LimitsError, match=None) as caught:
        parse_limits(text)
    assert message in str(caught.value)


def _write(path: Path, text: str, bump: int) -> None:
    path.write_text(text)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + bump * 1_000_000_000))


def test_reload_applies_a_good_file_and_keeps_the_old_limits_on_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    _write(path, GOOD, 0)
    file = LimitsFile(path)
    assert file.maybe_reload() is None  # unchanged
    _write(path, GOOD.replace("tokens_per_minute = 5000", "tokens_per_minute = 7000"), 1)
    assert file.maybe_reload() is True
    assert file.current.tenant("acme").base.tokens_per_minute == 7000
    version = file.current.version
    _write(path, "[defaults]\ntokens_per_minute = 'lots'\n", 2)
    assert file.maybe_reload() is False
    assert "tokens_per_minute" in file.error
    assert file.current.version == version and file.current.tenant("acme").base.tokens_per_minute == 7000
    assert file.maybe_reload() is None  # the same bad file is reported once
    _write(path, GOOD, 3)
    assert file.maybe_reload() is True and file.error == ""


def test_a_bad_file_at_startup_is_fatal(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    path.write_text("[defaults\n")
    with pytest.raises(LimitsError):
        LimitsFile(path)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('failure_policy = "closed"\n', "failure_policy"),
        ("models = 1\n", "models"),
        ('[tenants.a]\nmodels = "x"\n', "tenants.a.models"),
        ("[tenants.a.models]\nm = 3\n", "tenants.a.models.m"),
        ("[models]\nm = 3\n", "models.m"),
    ],
)
def test_a_value_where_a_table_belongs_is_rejected_on_reload(tmp_path: Path, text: str, key: str) -> None:
    """It raised AttributeError out of the reloader, whose task died and restarted at every poll."""
    path = tmp_path / "limits.toml"
    _write(path, GOOD, 0)
    file = LimitsFile(path)
    _write(path, text, 1)
    assert file.maybe_reload() is False
    assert file.error.startswith(f"{key} must be a table"), file.error
    assert file.current.tenant("acme").base.tokens_per_minute == 5000


def test_a_limit_beyond_2_to_the_53_is_rejected() -> None:
    """Accepted, it granted a lease whose reply could not be built (int64): INTERNAL, the lease held."""
    assert parse_limits(f"[defaults]\ntokens_per_minute = {2**53}\n").defaults.base.tokens_per_minute == 2**53
    for text, key in (
        (f"[defaults]\ntokens_per_minute = {2**53 + 1}\n", "defaults.tokens_per_minute"),
        (f"[models.m]\nrequests_in_flight = {2**63 - 1}\n", "models.m.requests_in_flight"),
    ):
        with pytest.raises(LimitsError, match="2\\*\\*53") as caught:
            parse_limits(text)
        assert str(caught.value).startswith(key)
