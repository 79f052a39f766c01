"""bench-transport's Python-backend side runs deploy/triton's own step model with the other sides' settings."""

from __future__ import annotations

from bench_transport import STEP_MODEL, _set_parameter
from sluice_stack import REPO_ROOT

SHIPPED = (REPO_ROOT / "deploy" / "triton" / "models" / STEP_MODEL / "config.pbtxt").read_text()


def test_the_shipped_step_models_parameters_are_set_and_nothing_else_changes() -> None:
    config = SHIPPED
    for key, value in (("THREADS", "2"), ("PREFIX_CACHE", "false"), ("MAX_SLOTS", "32")):
        config, replaced = _set_parameter(config, key, value)
        assert replaced, key
        assert f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}' in config
    changed = [(a, b) for a, b in zip(SHIPPED.splitlines(), config.splitlines()) if a != b]
    assert len(changed) <= 3 and all(a.startswith("parameters:") for a, _ in changed)


def test_a_parameter_the_model_lacks_is_reported() -> None:
    _, replaced = _set_parameter(SHIPPED, "NO_SUCH_PARAMETER", "1")
    assert not replaced
