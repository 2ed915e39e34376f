"""Tests of lossscale.torch.experimental.LossScaleOptimizer: TF 2.3's form (spec §6)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lossscale  # noqa: E402
from lossscale.torch import LossScaleOptimizer, experimental  # noqa: E402

ExpLSO = experimental.LossScaleOptimizer
PARAMS = [torch.nn.Parameter(torch.ones(2))]


def _sgd() -> Any:
    return torch.optim.SGD(PARAMS, lr=0.1, momentum=0.5)


def _summary(lso: Any) -> tuple[bool, float, int | None]:
    return lso.dynamic, lso.initial_scale, lso.dynamic_growth_steps


@pytest.mark.parametrize(
    ("loss_scale", "expected"),
    [
        (123, (False, 123.0, None)),
        (4.5, (False, 4.5, None)),
        (np.float32(8), (False, 8.0, None)),
        ("dynamic", (True, 32768.0, 2000)),
        (lossscale.FixedLossScale(64), (False, 64.0, None)),
        (lossscale.DynamicLossScale(), (True, 32768.0, 2000)),
        (lossscale.DynamicLossScale(2048, 500), (True, 2048.0, 500)),
        (
            {"class_name": "FixedLossScale", "config": {"loss_scale_value": 16}},
            (False, 16.0, None),
        ),
        (
            {
                "class_name": "DynamicLossScale",
                "config": {"initial_loss_scale": 256, "increment_period": 7, "multiplier": 2.0},
            },
            (True, 256.0, 7),
        ),
        (
            lossscale.serialize(lossscale.DynamicLossScale(8, 3)),
            (True, 8.0, 3),
        ),
    ],
    ids=[
        "int",
        "float",
        "np.float32",
        "'dynamic'",
        "FixedLossScale",
        "DynamicLossScale()",
        "DynamicLossScale(2048,500)",
        "fixed dict",
        "dynamic dict",
        "serialize()",
    ],
)
def test_input_kinds(loss_scale: Any, expected: tuple[bool, float, int | None]) -> None:
    lso = ExpLSO(_sgd(), loss_scale)
    assert _summary(lso) == expected
    assert lso.loss_scale.item() == expected[1]
    assert type(lso.initial_scale) is float


def test_the_current_state_of_a_dynamic_loss_scale_is_not_copied() -> None:
    ls = lossscale.DynamicLossScale(4, 10)
    ls.update([np.float32("inf")])
    assert float(ls()) == 2.0
    lso = ExpLSO(_sgd(), ls)
    assert lso.loss_scale.item() == 4.0 and lso.dynamic_counter == 0


def test_dynamic_loss_scale_extensions_are_carried_over() -> None:
    ls = lossscale.DynamicLossScale(8, 3, min_loss_scale=0.5, hysteresis=2)
    lso = ExpLSO(_sgd(), ls)
    config = lso.get_config()
    assert config["min_loss_scale"] == 0.5 and config["hysteresis"] == 2


@pytest.mark.parametrize(
    "loss_scale",
    [
        lossscale.DynamicLossScale(multiplier=3),
        lossscale.DynamicLossScale(multiplier=2.0000001),
        {
            "class_name": "DynamicLossScale",
            "config": {"initial_loss_scale": 8, "increment_period": 2, "multiplier": 4.0},
        },
    ],
    ids=["3", "2.0000001", "dict"],
)
def test_multiplier_not_two_is_a_value_error_and_leaves_the_optimizer_unmarked(
    loss_scale: Any,
) -> None:
    inner = _sgd()
    with pytest.raises(ValueError, match="multiplier must be 2"):
        ExpLSO(inner, loss_scale)
    lso = ExpLSO(inner, "dynamic")  # not marked as wrapped
    assert lso.inner_optimizer is inner


class _OtherLossScale(lossscale.LossScale):
    def __call__(self) -> Any:
        return np.float32(1)

    def update(self, grads: Any) -> tuple[None, Any]:
        return None, True

    def get_config(self) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize(
    "loss_scale",
    [None, "Dynamic", "123", "fixed", True, [4], object(), 1 + 2j],
    ids=repr,
)
def test_anything_else_is_a_value_error(loss_scale: Any) -> None:
    inner = _sgd()
    with pytest.raises(ValueError, match="Invalid value passed to loss_scale"):
        ExpLSO(inner, loss_scale)
    ExpLSO(inner, 8)  # a failed constructor left the optimizer unmarked


class DynamicLossScale(lossscale.DynamicLossScale):  # a user's subclass, under TF's name
    pass


def test_custom_loss_scale_subclasses_are_a_type_error_naming_what_is_supported() -> None:
    # TensorFlow: "custom LossScale subclasses are no longer supported" (a TypeError)
    inner = _sgd()
    with pytest.raises(TypeError, match="custom LossScale subclasses are no longer supported") as e:
        ExpLSO(inner, _OtherLossScale())
    assert '"dynamic", a number' in str(e.value) and "FixedLossScale" in str(e.value)
    ExpLSO(inner, 8)  # a failed constructor left the optimizer unmarked


def test_a_subclass_of_dynamic_loss_scale_is_accepted_as_by_tensorflow() -> None:
    opt = ExpLSO(_sgd(), DynamicLossScale(64, 5))  # TensorFlow checks with isinstance
    assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (True, 64.0, 5)


def test_loss_scale_is_required() -> None:
    with pytest.raises(TypeError):
        ExpLSO(_sgd())  # type: ignore[call-arg]


@pytest.mark.parametrize("loss_scale", [0.5, 0, -1, float("nan"), float("inf")])
def test_out_of_range_numbers_use_the_core_validation(loss_scale: float) -> None:
    inner = _sgd()
    with pytest.raises(ValueError):
        ExpLSO(inner, loss_scale)
    ExpLSO(inner, "dynamic")


def test_non_optimizer_and_nesting_are_rejected() -> None:
    with pytest.raises(TypeError):
        ExpLSO(1, "dynamic")
    with pytest.raises(TypeError, match="cannot wrap another"):
        ExpLSO(LossScaleOptimizer(_sgd()), "dynamic")
    inner = _sgd()
    ExpLSO(inner, 4)
    with pytest.raises(ValueError, match="already wrapped"):
        LossScaleOptimizer(inner)


def test_subclass_relation_one_way_only() -> None:
    assert issubclass(ExpLSO, LossScaleOptimizer)
    assert not issubclass(LossScaleOptimizer, ExpLSO)
    exp = ExpLSO(_sgd(), "dynamic")
    plain = LossScaleOptimizer(_sgd())
    assert isinstance(exp, LossScaleOptimizer)
    assert not isinstance(plain, ExpLSO)
    assert isinstance(exp, torch.optim.Optimizer)


def test_config_equality_dynamic() -> None:
    config = ExpLSO(_sgd(), "dynamic").get_config()
    assert config == LossScaleOptimizer(_sgd()).get_config()
    assert (config["dynamic"], config["initial_scale"], config["dynamic_growth_steps"]) == (
        True,
        32768.0,
        2000,
    )


def test_config_equality_fixed() -> None:
    config = ExpLSO(_sgd(), 123).get_config()
    assert config == LossScaleOptimizer(_sgd(), dynamic=False, initial_scale=123).get_config()
    assert (config["dynamic"], config["initial_scale"], config["dynamic_growth_steps"]) == (
        False,
        123.0,
        None,
    )


def test_config_equality_dynamic_loss_scale() -> None:
    config = ExpLSO(_sgd(), lossscale.DynamicLossScale(2048, 500)).get_config()
    expected = LossScaleOptimizer(_sgd(), initial_scale=2048, dynamic_growth_steps=500)
    assert config == expected.get_config()
    assert (config["dynamic"], config["initial_scale"], config["dynamic_growth_steps"]) == (
        True,
        2048.0,
        500,
    )


def test_config_equality_needs_equal_inner_hyperparameters() -> None:
    # the equalities above compare the inner optimizers too
    other = torch.optim.SGD(PARAMS, lr=0.2, momentum=0.5)
    assert ExpLSO(other, "dynamic").get_config() != LossScaleOptimizer(_sgd()).get_config()


def test_the_experimental_form_steps_like_the_plain_one() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    lso = ExpLSO(torch.optim.SGD([p], lr=1.0), lossscale.DynamicLossScale(8, 2))
    p.grad = torch.tensor([8.0, float("inf")])
    lso.step()
    assert p.tolist() == [1.0, 2.0] and lso.loss_scale.item() == 4.0
    p.grad = torch.tensor([4.0, 4.0])
    lso.step()
    assert p.tolist() == [0.0, 1.0] and lso.dynamic_counter == 1


@pytest.mark.parametrize(
    "loss_scale",
    ["dynamic", 123, lossscale.DynamicLossScale(2048, 500)],
    ids=["dynamic", "123", "DynamicLossScale(2048,500)"],
)
def test_from_config_round_trip(loss_scale: Any) -> None:
    config = ExpLSO(_sgd(), loss_scale).get_config()
    rebuilt = ExpLSO.from_config(config, [torch.nn.Parameter(torch.ones(3))])
    assert type(rebuilt) is ExpLSO
    assert rebuilt.get_config() == config
    # the plain class reads the same config
    assert (
        LossScaleOptimizer.from_config(config, [torch.nn.Parameter(torch.ones(3))]).get_config()
        == config
    )


def test_from_config_with_extensions_and_errors() -> None:
    ls = lossscale.DynamicLossScale(8, 3, min_loss_scale=0.5, hysteresis=2)
    config = ExpLSO(_sgd(), ls).get_config()
    assert ExpLSO.from_config(config, [torch.nn.Parameter(torch.ones(1))]).get_config() == config
    without_dynamic = {k: v for k, v in config.items() if k != "dynamic"}
    with pytest.raises(KeyError, match="dynamic"):
        ExpLSO.from_config(without_dynamic, [torch.nn.Parameter(torch.ones(1))])
    fixed = ExpLSO(_sgd(), 4).get_config()
    with pytest.raises(ValueError):
        ExpLSO.from_config(
            {**fixed, "dynamic_growth_steps": 2}, [torch.nn.Parameter(torch.ones(1))]
        )


# -- issue 18: TensorFlow <= 2.3 configs and TensorFlow's keyword names --------------------------


def test_tf23_configs_load_into_both_forms() -> None:
    old = {
        "optimizer": {"class_name": "SGD", "config": {"lr": 0.1}},
        "loss_scale": {
            "class_name": "DynamicLossScale",
            "config": {"initial_loss_scale": 256.0, "increment_period": 7, "multiplier": 2.0},
        },
    }
    for cls in (LossScaleOptimizer, ExpLSO):
        lso = cls.from_config(old, [torch.nn.Parameter(torch.ones(1))])
        assert (lso.dynamic, lso.initial_scale, lso.dynamic_growth_steps) == (True, 256.0, 7)
        assert lso.inner_optimizer.param_groups[0]["lr"] == 0.1
    fixed = {
        **old,
        "loss_scale": {"class_name": "FixedLossScale", "config": {"loss_scale_value": 8}},
    }
    lso = LossScaleOptimizer.from_config(fixed, [torch.nn.Parameter(torch.ones(1))])
    assert (lso.dynamic, lso.initial_scale) == (False, 8.0)
    bad = {**old, "loss_scale": {"class_name": "DynamicLossScale", "config": {"multiplier": 4.0}}}
    with pytest.raises(ValueError, match="only 2 is supported"):
        LossScaleOptimizer.from_config(bad, [torch.nn.Parameter(torch.ones(1))])


def test_tensorflow_keyword_names() -> None:
    lso = LossScaleOptimizer(inner_optimizer=_sgd(), dynamic=True, initial_scale=8)
    assert lso.initial_scale == 8.0
    exp = ExpLSO(optimizer=_sgd(), loss_scale="dynamic")
    assert exp.dynamic
