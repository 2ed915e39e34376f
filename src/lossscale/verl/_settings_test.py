"""lossscale's settings for verl, from the environment: parsed, checked, named when wrong."""

from __future__ import annotations

import pytest

import lossscale.verl as lv
from lossscale.verl import _settings


def test_each_variable_sets_its_keyword_and_unset_ones_stay_verl_s() -> None:
    env = {
        "LOSSSCALE_INIT_SCALE": "1024",
        "LOSSSCALE_GROWTH_INTERVAL": " 50 ",
        "LOSSSCALE_MIN_LOSS_SCALE": "0.5",
        "LOSSSCALE_MAX_LOSS_SCALE": "1e6",
        "LOSSSCALE_HYSTERESIS": "2",
        "LOSSSCALE_PLAN": "/plans/policy.json",
    }
    found = _settings.read(env)  # lv.settings also reads the plan file (see _plan_test)
    assert found == lv.settings({k: v for k, v in env.items() if k != "LOSSSCALE_PLAN"})._replace(
        plan="/plans/policy.json"
    )
    assert found.scaler == {
        "init_scale": 1024.0,
        "growth_interval": 50,
        "min_loss_scale": 0.5,
        "max_loss_scale": 1e6,
        "hysteresis": 2,
    }
    assert found.plan == "/plans/policy.json"
    assert lv.settings({"LOSSSCALE_INIT_SCALE": "", "LOSSSCALE_PLAN": " "}) == lv.Settings({}, None)
    assert [v for v, _, _ in _settings.VARIABLES] == [
        "LOSSSCALE_INIT_SCALE",
        "LOSSSCALE_GROWTH_INTERVAL",
        "LOSSSCALE_MIN_LOSS_SCALE",
        "LOSSSCALE_MAX_LOSS_SCALE",
        "LOSSSCALE_HYSTERESIS",
    ]


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("LOSSSCALE_INIT_SCALE", "lots", "is not a number"),
        ("LOSSSCALE_INIT_SCALE", "inf", "is not a finite number"),
        ("LOSSSCALE_GROWTH_INTERVAL", "4.5", "is not an integer"),
        ("LOSSSCALE_HYSTERESIS", "two", "is not an integer"),
        ("LOSSSCALE_MIN_LOSS_SCALE", "nan", "is not a finite number"),
    ],
)
def test_a_malformed_value_names_its_variable(variable: str, value: str, says: str) -> None:
    with pytest.raises(ValueError, match=rf"^{variable}={value!r} {says}"):
        lv.settings({variable: value})


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"LOSSSCALE_INIT_SCALE": "-1"}, r"LOSSSCALE_INIT_SCALE=-1\.0: init_scale must be"),
        ({"LOSSSCALE_GROWTH_INTERVAL": "0"}, r"LOSSSCALE_GROWTH_INTERVAL=0: growth_interval"),
        ({"LOSSSCALE_HYSTERESIS": "0"}, r"LOSSSCALE_HYSTERESIS=0: hysteresis must be"),
        # verl's init_scale (2**16) above the ceiling asked for
        ({"LOSSSCALE_MAX_LOSS_SCALE": "1000"}, r"LOSSSCALE_MAX_LOSS_SCALE=1000\.0: "),
        ({"LOSSSCALE_MIN_LOSS_SCALE": "0"}, r"LOSSSCALE_MIN_LOSS_SCALE=0\.0: min_loss_scale"),
    ],
)
def test_a_value_the_scaler_refuses_names_its_variable(env: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        lv.settings(env)


def test_every_keyword_has_its_variable() -> None:
    for variable, keyword, _ in _settings.VARIABLES:
        assert _settings.variable_of(keyword) == variable
    with pytest.raises(KeyError):
        _settings.variable_of("growth_factor")
