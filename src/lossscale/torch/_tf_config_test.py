"""TensorFlow's names and configs in the torch optimizers (issue 18 items 1 and 2).

TensorFlow 2.4+ loads a TF ≤ 2.3 ``LossScaleOptimizer`` config
(``{'optimizer': ..., 'loss_scale': {'class_name', 'config'}}``) by converting it
(tf_semantics.md §5.7, §6); TF's constructor names its first argument ``inner_optimizer``.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from lossscale.core import upgrade_optimizer_config
from lossscale.torch import LossScaleOptimizer, experimental

SGD = {"class_name": "SGD", "config": {"lr": 0.5}}


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(2))]


def _tf23(loss_scale: dict[str, Any]) -> dict[str, Any]:
    return {"optimizer": dict(SGD), "loss_scale": loss_scale}


def _dynamic(**config: Any) -> dict[str, Any]:
    return {"class_name": "DynamicLossScale", "config": config}


FIXED_64 = {"class_name": "FixedLossScale", "config": {"loss_scale_value": 64.0}}
DYN_1024_3 = _dynamic(initial_loss_scale=1024.0, increment_period=3, multiplier=2.0)


@pytest.mark.parametrize("cls", [LossScaleOptimizer, experimental.LossScaleOptimizer])
def test_tf23_fixed_config_loads_as_dynamic_false(cls: Any) -> None:
    opt = cls.from_config(_tf23(FIXED_64), _params())
    assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (False, 64.0, None)
    assert float(opt.loss_scale) == 64.0
    assert type(opt.inner_optimizer) is torch.optim.SGD
    assert opt.inner_optimizer.defaults["lr"] == 0.5


@pytest.mark.parametrize("cls", [LossScaleOptimizer, experimental.LossScaleOptimizer])
def test_tf23_dynamic_config_loads_its_initial_scale_and_period(cls: Any) -> None:
    params = _params()
    opt = cls.from_config(_tf23(DYN_1024_3), params)
    assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (True, 1024.0, 3)
    # the period is live: three finite steps double the scale
    for _ in range(3):
        opt.zero_grad()
        opt.get_scaled_loss(params[0].sum()).backward()
        opt.step()
    assert float(opt.loss_scale) == 2048.0
    # and the config it writes is TF 2.4+'s, equal to the directly built optimizer's
    direct = LossScaleOptimizer(torch.optim.SGD(_params(), lr=0.5), True, 1024.0, 3)
    assert opt.get_config() == direct.get_config()


def test_tf23_config_without_multiplier_and_with_extensions() -> None:
    config = _tf23(_dynamic(initial_loss_scale=8.0, increment_period=5, min_loss_scale=0.25))
    opt = LossScaleOptimizer.from_config(config, _params())
    assert (opt.initial_scale, opt.dynamic_growth_steps) == (8.0, 5)
    assert opt.get_config()["min_loss_scale"] == 0.25


@pytest.mark.parametrize("cls", [LossScaleOptimizer, experimental.LossScaleOptimizer])
@pytest.mark.parametrize("multiplier", [3.0, 2.0000001, 0.5])
def test_tf23_multiplier_other_than_2_is_a_clear_value_error(cls: Any, multiplier: float) -> None:
    config = _tf23(_dynamic(initial_loss_scale=8.0, increment_period=5, multiplier=multiplier))
    with pytest.raises(ValueError, match=r"multiplier is not 2 \(only 2 is supported\)"):
        cls.from_config(config, _params())


@pytest.mark.parametrize(
    ("loss_scale", "match"),
    [
        ({"class_name": "MyLossScale", "config": {}}, "only FixedLossScale and DynamicLossScale"),
        ({"config": {}}, "must be a serialized"),
        ("dynamic", "must be a serialized"),
    ],
)
def test_tf23_other_loss_scales_are_value_errors(loss_scale: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LossScaleOptimizer.from_config(_tf23(loss_scale), _params())


def test_optimizer_config_leaves_new_configs_and_its_input_alone() -> None:
    new = {"inner_optimizer": dict(SGD), "dynamic": False, "initial_scale": 4.0}
    assert upgrade_optimizer_config(new) == new and upgrade_optimizer_config(new) is not new
    old = _tf23(FIXED_64)
    snapshot = {k: v for k, v in old.items()}
    upgrade_optimizer_config(old)
    assert old == snapshot


def test_only_inner_optimizer_key_takes_tensorflows_defaults() -> None:
    opt = LossScaleOptimizer.from_config({"inner_optimizer": dict(SGD)}, _params())
    assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (True, 32768.0, 2000)


# -- item 2: TensorFlow's keyword names -------------------------------------------------------
def test_constructor_parameters_have_tensorflows_names() -> None:
    names = list(inspect.signature(LossScaleOptimizer.__init__).parameters)[1:5]
    assert names == ["inner_optimizer", "dynamic", "initial_scale", "dynamic_growth_steps"]
    # TF 2.3's experimental LossScaleOptimizerV1(optimizer, loss_scale)
    names = list(inspect.signature(experimental.LossScaleOptimizer.__init__).parameters)[1:3]
    assert names == ["optimizer", "loss_scale"]


def test_tensorflows_keywords_are_accepted() -> None:
    opt = LossScaleOptimizer(
        inner_optimizer=torch.optim.SGD(_params(), lr=0.1),
        dynamic=True,
        initial_scale=16,
        dynamic_growth_steps=7,
    )
    assert (opt.initial_scale, opt.dynamic_growth_steps) == (16.0, 7)
    fixed = experimental.LossScaleOptimizer(
        optimizer=torch.optim.SGD(_params(), lr=0.1), loss_scale=8
    )
    assert (fixed.dynamic, fixed.initial_scale) == (False, 8.0)


def test_a_bad_inner_optimizer_is_named_by_tensorflows_name() -> None:
    with pytest.raises(TypeError, match='"inner_optimizer" must be an instance'):
        LossScaleOptimizer(inner_optimizer=1)  # type: ignore[arg-type]
    sgd = torch.optim.SGD(_params(), lr=0.1)
    LossScaleOptimizer(sgd)
    with pytest.raises(ValueError, match='"inner_optimizer" is already wrapped'):
        LossScaleOptimizer(inner_optimizer=sgd)
