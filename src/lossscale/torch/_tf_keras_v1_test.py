"""Four of tf_keras' ``LossScaleOptimizer`` tests (TensorFlow 2.4-2.10's
``keras/mixed_precision/loss_scale_optimizer_test.py``) on lossscale's peers.

tf_keras is not installed here, so each test below reproduces one of them step for step, with
lossscale's peers of what it uses:

* ``LossScaleOptimizerV1(opt, loss_scale)`` → ``lossscale.torch.experimental.LossScaleOptimizer``
  (``from_config='v1'``), ``LossScaleOptimizer`` → ``lossscale.torch.LossScaleOptimizer``
  (``'v2'``);
* ``tf_loss_scale_module`` (``tf.compat.v1.mixed_precision``) → :data:`V1`, whose
  ``FixedLossScale`` and ``DynamicLossScale`` are *subclasses* of lossscale's, as a user's
  subclass would be (TensorFlow accepts any instance, subclasses included);
* ``gradient_descent.SGD(lr, momentum=...)`` → ``torch.optim.SGD``; a ``tf.Variable([5.0])`` →
  a parameter ``[5.0]``;
* ``_run_fn_with_grad_check(strategy, var, opt, expected_grad)`` (the loss is the identity of
  the variable, and the gradient reaching it is checked to be ``expected_grad``, the loss scale
  on one replica) → :func:`_step_with_grad_check`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import lossscale
from lossscale.torch import LossScaleOptimizer, experimental


class _FixedLossScale(lossscale.FixedLossScale):
    pass


class _DynamicLossScale(lossscale.DynamicLossScale):
    pass


_FixedLossScale.__name__ = _FixedLossScale.__qualname__ = "FixedLossScale"
_DynamicLossScale.__name__ = _DynamicLossScale.__qualname__ = "DynamicLossScale"

#: The peer of ``tf_loss_scale_module``.
V1 = SimpleNamespace(
    LossScale=lossscale.LossScale,
    FixedLossScale=_FixedLossScale,
    DynamicLossScale=_DynamicLossScale,
)


def _step_with_grad_check(var: torch.nn.Parameter, opt: Any, expected_grad: float) -> None:
    """One ``minimize`` of ``loss = var`` (summed) whose scaled gradient must be
    ``expected_grad``."""
    opt.zero_grad()
    opt.get_scaled_loss(var.sum()).backward()
    assert var.grad is not None and var.grad.tolist() == [expected_grad]
    opt.step()


@pytest.mark.parametrize("from_config", ["v1", "v2"])
def test_get_config_dynamic_v1(from_config: str) -> None:
    """testGetConfigDynamic, get_config='v1', from_config='v1' and 'v2'."""
    var = torch.nn.Parameter(torch.tensor([5.0]))
    opt: Any = torch.optim.SGD([var], lr=2.0, momentum=0.5)
    loss_scale = V1.DynamicLossScale(initial_loss_scale=2, increment_period=3)
    opt = experimental.LossScaleOptimizer(opt, loss_scale)
    config = opt.get_config()
    cls = experimental.LossScaleOptimizer if from_config == "v1" else LossScaleOptimizer
    opt = cls.from_config(config, [var])

    assert opt.inner_optimizer.param_groups[0]["lr"] == 2.0
    assert opt.inner_optimizer.param_groups[0]["momentum"] == 0.5
    assert float(opt.loss_scale) == 2.0
    assert opt.initial_scale == 2.0
    assert opt.dynamic_growth_steps == 3
    assert opt.dynamic

    _step_with_grad_check(var, opt, 2)
    assert var.tolist() == [3.0]
    assert opt.dynamic_counter == 1


def test_passing_v1_loss_scale() -> None:
    """testPassingV1LossScale (the default strategy)."""
    learning_rate = 2.0
    # FixedLossScale
    var = torch.nn.Parameter(torch.tensor([5.0]))
    opt: Any = torch.optim.SGD([var], lr=learning_rate)
    opt = experimental.LossScaleOptimizer(opt, V1.FixedLossScale(2.0))
    assert isinstance(opt.loss_scale, torch.Tensor)
    assert float(opt.loss_scale) == 2
    _step_with_grad_check(var, opt, 2)
    assert var.tolist() == [3.0]  # 5 - 1 * 2

    # DynamicLossScale
    var = torch.nn.Parameter(torch.tensor([5.0]))
    opt = torch.optim.SGD([var], lr=learning_rate)
    loss_scale = V1.DynamicLossScale(initial_loss_scale=4, increment_period=1, multiplier=2)
    loss_scale.update([float("inf")])  # its current scale, now 2, is not copied (TF 2.4+)
    assert float(loss_scale()) == 2
    opt = experimental.LossScaleOptimizer(opt, loss_scale)
    assert opt.initial_scale == 4
    assert opt.dynamic_growth_steps == 1
    assert float(opt.loss_scale) == 4  # reinitialized to the initial scale
    assert opt.dynamic_counter == 0
    _step_with_grad_check(var, opt, 4)
    assert var.tolist() == [3.0]


def test_passing_v1_loss_scale_errors() -> None:
    """testPassingV1LossScaleErrors."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.01)
    loss_scale = V1.DynamicLossScale(multiplier=4)
    with pytest.raises(
        ValueError,
        match=r'When passing a DynamicLossScale to "loss_scale", '
        r"DynamicLossScale.multiplier must be 2. Got: "
        r"DynamicLossScale",
    ):
        experimental.LossScaleOptimizer(opt, loss_scale)

    class MyLossScale(V1.LossScale):  # type: ignore[name-defined,misc]
        def __call__(self) -> Any:
            return 1.0

        def update(self, grads: Any) -> tuple[None, bool]:
            return None, True

        def get_config(self) -> dict[str, Any]:
            return {}

    with pytest.raises(
        TypeError,
        match=r"Passing a LossScale that is not a FixedLossScale or a "
        r"DynamicLossScale is no longer supported. Got:",
    ):
        experimental.LossScaleOptimizer(opt, MyLossScale())
