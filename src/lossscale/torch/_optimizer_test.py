"""Tests of lossscale.torch.LossScaleOptimizer: TensorFlow's API (spec §5) on torch.optim."""

from __future__ import annotations

import copy
import io
import math
import random
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import lossscale  # noqa: E402
from lossscale.torch import LossScaleOptimizer, step_together  # noqa: E402

# fused optimizers: both the CPU's host decision and a GPU's device decision (conftest)
pytestmark = pytest.mark.usefixtures("fused_decision")

LSO = LossScaleOptimizer
INF = float("inf")
NAN = float("nan")


def _param(values: Any, dtype: Any = None, device: str = "cpu") -> Any:
    return torch.nn.Parameter(torch.tensor(values, dtype=dtype or torch.float32, device=device))


def _sgd(*params: Any, lr: float = 1.0, **kwargs: Any) -> Any:
    return torch.optim.SGD(list(params) or [_param([1.0])], lr=lr, **kwargs)


def _f32(x: float) -> float:
    return float(np.float32(x))


# -- constructor (spec §5.1) ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [1, None, "sgd", [torch.zeros(1)], torch.nn.Linear(1, 1)])
def test_non_optimizer_is_a_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        LSO(bad)


@pytest.mark.parametrize("dynamic", ["x", "dynamic", 1, 0, None, np.True_, 1.0])
def test_dynamic_not_a_bool_is_a_type_error(dynamic: Any) -> None:
    with pytest.raises(TypeError, match="dynamic must be a bool"):
        LSO(_sgd(), dynamic=dynamic)


def test_optimizer_type_is_checked_before_dynamic() -> None:
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        LSO(1, dynamic="x")


def test_dynamic_is_checked_before_the_nesting_check() -> None:
    outer = LSO(_sgd())
    with pytest.raises(TypeError, match="dynamic must be a bool"):
        LSO(outer, dynamic="x")


def test_wrapping_a_loss_scale_optimizer_is_a_type_error() -> None:
    outer = LSO(_sgd())
    with pytest.raises(TypeError, match="cannot wrap another LossScaleOptimizer"):
        LSO(outer)


def test_wrapping_twice_is_a_value_error() -> None:
    inner = _sgd()
    LSO(inner)
    with pytest.raises(ValueError, match="already wrapped"):
        LSO(inner)
    with pytest.raises(ValueError, match="already wrapped"):
        LSO(inner, dynamic=False, initial_scale=2)


def test_fixed_without_initial_scale_is_a_value_error_even_with_growth_steps() -> None:
    with pytest.raises(ValueError, match='"initial_scale" must be specified'):
        LSO(_sgd(), dynamic=False)
    with pytest.raises(ValueError, match='"initial_scale" must be specified'):
        LSO(_sgd(), dynamic=False, dynamic_growth_steps=2)


@pytest.mark.parametrize("steps", [2, 2000, 1])
def test_fixed_with_growth_steps_is_a_value_error(steps: int) -> None:
    with pytest.raises(ValueError, match='"dynamic_growth_steps" must be None'):
        LSO(_sgd(), dynamic=False, initial_scale=2, dynamic_growth_steps=steps)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"dynamic": False}, ValueError),
        ({"dynamic": False, "initial_scale": 2, "dynamic_growth_steps": 3}, ValueError),
        ({"dynamic": False, "initial_scale": 0.5}, ValueError),
        ({"dynamic": False, "initial_scale": NAN}, ValueError),
        ({"dynamic": False, "initial_scale": 8, "min_loss_scale": 2.0}, ValueError),
        ({"dynamic": "x"}, TypeError),
        ({"initial_scale": 0}, ValueError),
        ({"initial_scale": -3}, ValueError),
        ({"initial_scale": NAN}, ValueError),
        ({"initial_scale": INF}, ValueError),
        ({"initial_scale": 1e39}, ValueError),
        ({"initial_scale": "8"}, TypeError),
        ({"dynamic_growth_steps": 0}, ValueError),
        ({"dynamic_growth_steps": -1}, ValueError),
        ({"dynamic_growth_steps": 2.7}, TypeError),
        ({"hysteresis": 0}, ValueError),
    ],
    ids=lambda x: repr(x) if isinstance(x, dict) else x.__name__,
)
def test_a_failing_constructor_leaves_the_optimizer_unmarked(
    kwargs: dict[str, Any], error: type[Exception]
) -> None:
    inner = _sgd()
    with pytest.raises(error):
        LSO(inner, **kwargs)
    lso = LSO(inner)  # TensorFlow would raise "already wrapped" here
    assert lso.inner_optimizer is inner
    with pytest.raises(ValueError, match="already wrapped"):
        LSO(inner)


def test_positional_form() -> None:
    lso = LSO(_sgd(), True, 4, 3)
    assert (lso.dynamic, lso.initial_scale, lso.dynamic_growth_steps) == (True, 4.0, 3)


# -- attributes (spec §5.2) ---------------------------------------------------------------------


def test_dynamic_attributes_defaults() -> None:
    inner = _sgd()
    lso = LSO(inner)
    assert lso.dynamic is True
    assert lso.inner_optimizer is inner
    assert type(lso.initial_scale) is float and lso.initial_scale == 32768.0
    assert type(lso.dynamic_growth_steps) is int and lso.dynamic_growth_steps == 2000
    assert type(lso.dynamic_counter) is int and lso.dynamic_counter == 0
    scale = lso.loss_scale
    assert isinstance(scale, torch.Tensor)
    assert scale.shape == () and scale.dtype == torch.float32 and scale.device.type == "cpu"
    assert scale.item() == 32768.0


def test_fixed_attributes() -> None:
    lso = LSO(_sgd(), dynamic=False, initial_scale=123)
    assert lso.dynamic is False
    assert type(lso.initial_scale) is float and lso.initial_scale == 123.0
    assert lso.dynamic_growth_steps is None
    assert lso.dynamic_counter is None
    assert lso.loss_scale.dtype == torch.float32 and lso.loss_scale.shape == ()
    assert lso.loss_scale.item() == 123.0


def test_initial_scale_is_a_float_and_never_the_current_scale() -> None:
    p = _param([1.0])
    lso = LSO(_sgd(p), initial_scale=2, dynamic_growth_steps=1)
    assert type(lso.initial_scale) is float and lso.initial_scale == 2.0
    for _ in range(3):
        p.grad = torch.ones(1)
        lso.step()
    assert lso.loss_scale.item() == 16.0
    assert lso.initial_scale == 2.0


def test_dynamic_counter_is_a_live_int() -> None:
    p = _param([1.0])
    lso = LSO(_sgd(p), initial_scale=4, dynamic_growth_steps=3)
    counters = []
    for grad in [1.0, 1.0, INF, 1.0, 1.0, 1.0]:
        p.grad = torch.tensor([grad])
        lso.step()
        counters.append(lso.dynamic_counter)
    assert counters == [1, 2, 0, 1, 2, 0]
    assert all(type(c) is int for c in counters)


def test_loss_scale_is_read_only() -> None:
    lso = LSO(_sgd(), initial_scale=8)
    with pytest.raises(AttributeError):
        lso.loss_scale = 2.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        lso.loss_scale = torch.tensor(2.0)  # type: ignore[misc]
    assert lso.loss_scale.item() == 8.0


def test_loss_scale_reference_is_a_snapshot() -> None:
    p = _param([1.0])
    lso = LSO(_sgd(p), initial_scale=8)
    before = lso.loss_scale
    p.grad = torch.tensor([INF])
    lso.step()
    assert before.item() == 8.0
    assert lso.loss_scale.item() == 4.0


def test_shares_param_groups_state_and_defaults() -> None:
    inner = torch.optim.Adam([_param([1.0, 2.0])], lr=0.1)
    lso = LSO(inner)
    assert lso.param_groups is inner.param_groups
    assert lso.state is inner.state
    assert lso.defaults is inner.defaults
    lso.param_groups[0]["lr"] = 0.5
    assert inner.param_groups[0]["lr"] == 0.5


def test_add_param_group_reaches_the_inner_optimizer_and_is_stepped() -> None:
    a, b = _param([1.0]), _param([10.0])
    inner = _sgd(a, lr=1.0)
    lso = LSO(inner, initial_scale=2)
    a.grad = torch.tensor([2.0])
    lso.step()
    lso.add_param_group({"params": [b], "lr": 0.5})
    assert len(inner.param_groups) == 2 and lso.param_groups is inner.param_groups
    a.grad, b.grad = torch.tensor([2.0]), torch.tensor([4.0])
    lso.step()
    assert a.item() == -1.0  # 1 - 1*1 - 1*1
    assert b.item() == 9.0  # 10 - 0.5 * (4 / 2)


def test_lr_scheduler_changes_the_lr_the_inner_optimizer_uses() -> None:
    p = _param([0.0])
    inner = _sgd(p, lr=1.0)
    lso = LSO(inner, initial_scale=1)
    scheduler = torch.optim.lr_scheduler.StepLR(lso, step_size=1, gamma=0.5)
    moves = []
    for _ in range(3):
        before = p.item()
        p.grad = torch.ones(1)
        lso.step()
        scheduler.step()
        moves.append(before - p.item())
    assert moves == [1.0, 0.5, 0.25]
    assert inner.param_groups[0]["lr"] == 0.125


def test_clip_grad_norm_works_on_the_shared_params() -> None:
    p = _param([0.0, 0.0])
    lso = LSO(_sgd(p), initial_scale=1)
    p.grad = torch.tensor([3.0, 4.0])
    params = [q for g in lso.param_groups for q in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    lso.step()
    assert p.detach().tolist() == pytest.approx([-0.6, -0.8], rel=1e-6)


# -- get_scaled_loss (T2, spec §5.3) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
    ids=str,
)
def test_scaled_loss_dtype(dtype: Any, expected: Any) -> None:
    lso = LSO(_sgd(), initial_scale=4)
    scaled = lso.get_scaled_loss(torch.tensor(5.0, dtype=dtype))
    assert scaled.dtype == expected
    assert scaled.item() == 20.0


def test_float16_loss_with_a_large_scale_is_not_inf() -> None:
    lso = LSO(_sgd(), initial_scale=65536)  # 65536 itself is inf in float16
    scaled = lso.get_scaled_loss(torch.tensor(1.0, dtype=torch.float16))
    assert scaled.dtype == torch.float32 and scaled.item() == 65536.0
    default = LSO(_sgd())  # TensorFlow: f16 5 * f16(32768) = inf
    assert default.get_scaled_loss(torch.tensor(5.0, dtype=torch.float16)).item() == 163840.0


def test_scaled_loss_backward_scales_the_gradients() -> None:
    p = _param([3.0])
    lso = LSO(_sgd(p), initial_scale=8)
    lso.get_scaled_loss((p * p).sum()).backward()
    assert p.grad.item() == 48.0


def test_scaled_loss_of_a_vector() -> None:
    lso = LSO(_sgd(), initial_scale=2)
    out = lso.get_scaled_loss(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert out.dtype == torch.float64 and out.tolist() == [2.0, 4.0]


def test_scaled_loss_of_a_callable_is_a_callable_reading_the_scale_when_called() -> None:
    p = _param([1.0])
    lso = LSO(_sgd(p), initial_scale=8)
    scaled = lso.get_scaled_loss(lambda: torch.tensor(3.0))
    assert callable(scaled) and not isinstance(scaled, torch.Tensor)
    assert scaled().item() == 24.0
    p.grad = torch.tensor([INF])
    lso.step()  # scale 8 -> 4
    assert scaled().item() == 12.0


@pytest.mark.parametrize("bad", [torch.tensor(5), torch.tensor(True), 5.0, np.float32(5)])
def test_scaled_loss_of_a_non_float_tensor_is_a_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match="loss must be"):
        LSO(_sgd()).get_scaled_loss(bad)


# -- get_unscaled_gradients (T3, spec §5.4) ---------------------------------------------------


def test_unscaled_gradients_multiply_by_the_float32_reciprocal() -> None:
    lso = LSO(_sgd(), initial_scale=3)
    grads = torch.tensor([5.0, 7.0, 10.0, 100.0])
    (out,) = lso.get_unscaled_gradients([grads])
    # TensorFlow's values (true division would give 1.6666666, 2.3333333, 3.3333333, 33.333332)
    assert out.tolist() == [_f32(1.6666667), _f32(2.3333335), _f32(3.3333335), _f32(33.333336)]
    assert torch.equal(out, grads * torch.reciprocal(torch.tensor(3.0)))


def test_unscaled_float64_gradient_uses_the_float32_reciprocal() -> None:
    lso = LSO(_sgd(), initial_scale=3)
    (out,) = lso.get_unscaled_gradients([torch.tensor(3.0, dtype=torch.float64)])
    assert out.dtype == torch.float64
    assert out.item() == 1.0000000298023224


def test_unscaled_gradients_new_list_nones_kept_dtypes_kept_inputs_untouched() -> None:
    lso = LSO(_sgd(), initial_scale=2)
    grads = (
        torch.tensor([3.0]),
        None,
        torch.tensor([-4.0], dtype=torch.float16),
        torch.tensor([6.0], dtype=torch.bfloat16),
        torch.tensor([8.0], dtype=torch.float64),
    )
    originals = [None if g is None else g.clone() for g in grads]
    out = lso.get_unscaled_gradients(grads)
    assert isinstance(out, list) and len(out) == 5
    assert out[1] is None
    assert [o.dtype for o in out if o is not None] == [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
    ]
    assert [o.item() for o in out if o is not None] == [1.5, -2.0, 3.0, 4.0]
    for g, o, orig in zip(grads, out, originals, strict=True):
        if g is not None:
            assert o is not g and o.data_ptr() != g.data_ptr()
            assert torch.equal(g, orig)


def test_unscaled_half_gradients_are_computed_in_float32() -> None:
    # TensorFlow casts 1/2**25 to float16 first (it underflows to 0); float32 math does not.
    lso = LSO(_sgd(), initial_scale=2**25)
    (out,) = lso.get_unscaled_gradients([torch.tensor([1000.0], dtype=torch.float16)])
    expected = (torch.tensor([1000.0]) * torch.reciprocal(torch.tensor(2.0**25))).half()
    assert out.dtype == torch.float16
    assert out.item() != 0.0
    assert torch.equal(out, expected)


def test_unscaled_gradients_reject_non_tensors() -> None:
    with pytest.raises(TypeError, match=r"grads\[0\]: gradients must be floating-point"):
        LSO(_sgd()).get_unscaled_gradients([1.0])


# -- step ------------------------------------------------------------------------------------


def test_step_unscales_in_place_and_applies() -> None:
    p = _param([1.0, 2.0])
    lso = LSO(_sgd(p, lr=0.5), initial_scale=4, dynamic_growth_steps=10)
    lso.get_scaled_loss((p * p).sum()).backward()  # grad 4 * 2p = [8, 16]
    assert p.grad.tolist() == [8.0, 16.0]
    assert lso.step() is None
    assert p.grad.tolist() == [2.0, 4.0]  # .grad holds the unscaled gradients after step (T6)
    assert p.detach().tolist() == [0.0, 0.0]
    assert lso.last_step_applied.item() is True
    assert lso.dynamic_counter == 1 and lso.loss_scale.item() == 4.0


def test_unscale_then_step_unscales_once() -> None:
    p = _param([0.0, 0.0])
    lso = LSO(_sgd(p, lr=1.0), initial_scale=8)
    p.grad = torch.tensor([8.0, 24.0])
    lso.unscale_()
    assert p.grad.tolist() == [1.0, 3.0]
    lso.unscale_()  # idempotent until the step
    assert p.grad.tolist() == [1.0, 3.0]
    lso.step()
    assert p.grad.tolist() == [1.0, 3.0]
    assert p.detach().tolist() == [-1.0, -3.0]
    # the next step unscales again
    p.grad = torch.tensor([8.0, 8.0])
    lso.unscale_()
    lso.step()
    assert p.detach().tolist() == [-2.0, -4.0]


def test_unscale_then_step_with_a_non_finite_grad_skips() -> None:
    p = _param([1.0, 1.0])
    lso = LSO(_sgd(p), initial_scale=8)
    p.grad = torch.tensor([8.0, INF])
    lso.unscale_()
    lso.step()
    assert p.detach().tolist() == [1.0, 1.0]
    assert lso.last_step_applied.item() is False
    assert lso.loss_scale.item() == 4.0


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_a_non_finite_step_is_skipped_and_backs_off(bad: float) -> None:
    p = _param([1.0, 2.0])
    lso = LSO(_sgd(p), initial_scale=8, dynamic_growth_steps=10)
    p.grad = torch.tensor([4.0, 4.0])
    lso.step()
    assert lso.dynamic_counter == 1
    p.grad = torch.tensor([4.0, bad])
    lso.step()
    assert p.detach().tolist() == [0.5, 1.5]
    assert lso.loss_scale.item() == 4.0
    assert lso.dynamic_counter == 0
    assert lso.last_step_applied.item() is False
    assert lso.skipped_steps.item() == 1
    p.grad = torch.tensor([4.0, 4.0])
    lso.step()
    assert p.detach().tolist() == [-0.5, 0.5]
    assert lso.last_step_applied.item() is True
    assert lso.skipped_steps.item() == 1


def test_the_scale_never_backs_off_below_one() -> None:
    p = _param([1.0])
    lso = LSO(_sgd(p), initial_scale=2)
    for _ in range(3):
        p.grad = torch.tensor([NAN])
        lso.step()
    assert lso.loss_scale.item() == 1.0
    assert lso.skipped_steps.item() == 3


def test_step_with_a_closure_returns_its_value() -> None:
    p = _param([2.0])
    lso = LSO(_sgd(p, lr=0.25), initial_scale=4)
    returned = []

    def closure() -> Any:
        lso.zero_grad()
        loss = (p * p).sum()
        lso.get_scaled_loss(loss).backward()
        returned.append(loss)
        return loss

    out = lso.step(closure)
    assert out is returned[0]
    assert out.item() == 4.0
    assert p.item() == 1.0  # 2 - 0.25 * 4
    assert lso.last_step_applied.item() is True


def test_step_with_a_closure_skips_a_non_finite_step_and_returns_its_value() -> None:
    p = _param([2.0])
    lso = LSO(_sgd(p, lr=0.25), initial_scale=4)

    def closure() -> Any:
        lso.zero_grad()
        loss = (p * p).sum() * INF
        lso.get_scaled_loss(loss).backward()
        return loss

    out = lso.step(closure)
    assert out.item() == INF
    assert p.item() == 2.0
    assert lso.last_step_applied.item() is False
    assert lso.loss_scale.item() == 2.0


def test_minimize_tensor_tf_docstring_example() -> None:
    # TF: SGD(0.25), var 1, loss var**2, default LSO -> minimize -> 0.5
    var = _param([1.0])
    lso = LSO(_sgd(var, lr=0.25))
    loss = (var * var).sum()
    assert lso.minimize(loss) is loss
    assert var.item() == 0.5
    assert lso.dynamic_counter == 1
    assert lso.loss_scale.item() == 32768.0


def test_minimize_callable() -> None:
    var = _param([1.0])
    lso = LSO(_sgd(var, lr=0.25))
    out = lso.minimize(lambda: (var * var).sum())
    assert isinstance(out, torch.Tensor) and out.item() == 1.0
    assert var.item() == 0.5


def test_minimize_nan_loss_skips() -> None:
    var = _param([1.0])
    lso = LSO(_sgd(var, lr=0.25), initial_scale=8)
    lso.minimize(lambda: (var * var).sum() * NAN)
    assert var.item() == 1.0
    assert lso.loss_scale.item() == 4.0
    assert lso.skipped_steps.item() == 1


def test_minimize_does_not_zero_gradients_first() -> None:
    # T5: gradients accumulate until zero_grad(): minimize(loss2) after a scaled backward of
    # loss1 steps on the gradient of loss1 + loss2.
    var = _param([1.0])
    lso = LSO(_sgd(var, lr=0.25), initial_scale=8)
    lso.get_scaled_loss((3 * var).sum()).backward()
    lso.minimize((var * var).sum())
    assert var.item() == 1.0 - 0.25 * (3.0 + 2.0)


def test_step_applies_params_of_several_groups_and_ignores_params_without_grads() -> None:
    a, b, unused = _param([1.0]), _param([1.0]), _param([7.0])
    inner = torch.optim.SGD([{"params": [a, unused]}, {"params": [b], "lr": 0.5}], lr=1.0)
    lso = LSO(inner, initial_scale=2)
    (lso.get_scaled_loss(a.sum() + 2 * b.sum())).backward()
    assert unused.grad is None
    lso.step()
    assert (a.item(), b.item(), unused.item()) == (0.0, 0.0, 7.0)
    assert unused.grad is None
    # a non-finite gradient in one group skips every group
    a.grad, b.grad = torch.tensor([2.0]), torch.tensor([INF])
    lso.step()
    assert (a.item(), b.item()) == (0.0, 0.0)
    assert lso.last_step_applied.item() is False


def test_a_step_without_any_gradient_counts_as_finite() -> None:
    p = _param([1.0])
    lso = LSO(_sgd(p), initial_scale=4, dynamic_growth_steps=1)
    lso.step()
    assert p.item() == 1.0
    assert lso.last_step_applied.item() is True
    assert lso.loss_scale.item() == 8.0


# -- float16 / bfloat16 / mixed dtypes / sparse ----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_params_and_grads(dtype: Any, device: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(device, dtype)
    lso = LSO(torch.optim.SGD(model.parameters(), lr=0.1), initial_scale=1024)
    x = torch.randn(8, 4, dtype=dtype).to(device)
    before = [p.detach().clone() for p in model.parameters()]
    lso.get_scaled_loss(model(x).float().pow(2).mean()).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    assert all(g.dtype == dtype for g in scaled)
    lso.step()
    inv = torch.reciprocal(torch.tensor(1024.0, device=device))
    for p, b, g in zip(model.parameters(), before, scaled, strict=True):
        unscaled = (g.float() * inv).to(dtype)
        assert torch.equal(p.grad, unscaled)
        assert torch.equal(p.detach(), b.add(unscaled, alpha=-0.1))
        assert p.dtype == dtype


def test_float16_unscaling_is_computed_in_float32() -> None:
    p = _param([0.0], torch.float16)
    lso = LSO(_sgd(p), initial_scale=2**25)
    p.grad = torch.tensor([1000.0], dtype=torch.float16)
    lso.step()
    expected = (torch.tensor([1000.0]) * torch.reciprocal(torch.tensor(2.0**25))).half()
    assert expected.item() != 0.0  # a float16 reciprocal would give 0
    assert torch.equal(p.grad, expected)
    assert torch.equal(p.detach(), -expected)


def test_params_of_different_dtypes_in_one_optimizer(device: str) -> None:
    a = _param([1.0], device=device)
    b = _param([1.0], torch.float16, device=device)
    c = _param([1.0], torch.bfloat16, device=device)
    d = _param([1.0], torch.float64, device=device)
    lso = LSO(torch.optim.SGD([a, b, c, d], lr=1.0), initial_scale=4)
    for p in (a, b, c, d):
        p.grad = torch.full_like(p, 2.0)
    lso.step()
    assert [p.item() for p in (a, b, c, d)] == [0.5, 0.5, 0.5, 0.5]
    assert [p.dtype for p in (a, b, c, d)] == [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
    ]
    # an overflow in the float16 gradient only skips the whole step
    for p in (a, b, c, d):
        p.grad = torch.full_like(p, 2.0)
    b.grad = torch.tensor([INF], dtype=torch.float16, device=device)
    lso.step()
    assert [p.item() for p in (a, b, c, d)] == [0.5, 0.5, 0.5, 0.5]
    assert lso.loss_scale.item() == 2.0


def test_sparse_gradients_are_unscaled_and_checked(device: str) -> None:
    emb = torch.nn.Embedding(5, 2, sparse=True).to(device)
    with torch.no_grad():
        emb.weight.fill_(1.0)
    lso = LSO(torch.optim.SGD(emb.parameters(), lr=1.0), initial_scale=8)
    lso.get_scaled_loss(emb(torch.tensor([1, 3, 1], device=device)).sum()).backward()
    assert emb.weight.grad.is_sparse
    lso.step()
    expected = torch.ones(5, 2, device=device)
    expected[1] -= 2.0  # index 1 twice
    expected[3] -= 1.0
    assert torch.equal(emb.weight.detach(), expected)
    lso.get_scaled_loss(emb(torch.tensor([2], device=device)).sum() * INF).backward()
    lso.step()
    assert torch.equal(emb.weight.detach(), expected)
    assert lso.loss_scale.item() == 4.0


def test_float16_sparse_gradients_with_duplicate_indices(device: str) -> None:
    emb = torch.nn.Embedding(4, 2, sparse=True).to(device, torch.float16)
    with torch.no_grad():
        emb.weight.zero_()
    lso = LSO(torch.optim.SGD(emb.parameters(), lr=1.0), initial_scale=2**14)
    # index 0 three times: the scaled gradient sums to 3 * 2**14 = 49152 (finite in float16)
    lso.get_scaled_loss(emb(torch.tensor([0, 0, 0, 2], device=device)).float().sum()).backward()
    lso.step()
    assert lso.last_step_applied.item() is True
    assert emb.weight[0].tolist() == [-3.0, -3.0]
    assert emb.weight[2].tolist() == [-1.0, -1.0]


def test_float16_sparse_duplicates_overflowing_when_summed_skip(device: str) -> None:
    # 5 * 2**14 = 81920 overflows float16 once the duplicates are summed: the step must be
    # skipped, not applied with an inf produced later by the optimizer's own coalesce.
    emb = torch.nn.Embedding(4, 2, sparse=True).to(device, torch.float16)
    with torch.no_grad():
        emb.weight.zero_()
    lso = LSO(torch.optim.SGD(emb.parameters(), lr=1.0), initial_scale=2**14)
    lso.get_scaled_loss(emb(torch.tensor([0, 0, 0, 0, 0], device=device)).float().sum()).backward()
    lso.step()
    assert lso.last_step_applied.item() is False
    assert torch.equal(emb.weight.detach(), torch.zeros(4, 2, dtype=torch.float16, device=device))
    assert lso.loss_scale.item() == 2.0**13


# -- last_step_applied, skipped_steps and LR schedulers ---------------------------------------


def test_last_step_applied_and_skipped_steps_are_tensors() -> None:
    p = _param([1.0])
    lso = LSO(_sgd(p), initial_scale=8)
    assert lso.last_step_applied.dtype == torch.bool and lso.last_step_applied.shape == ()
    assert lso.skipped_steps.dtype == torch.int64 and lso.skipped_steps.shape == ()
    outcomes = []
    for grad in [1.0, INF, NAN, 1.0, INF]:
        p.grad = torch.tensor([grad])
        lso.step()
        outcomes.append((lso.last_step_applied.item(), lso.skipped_steps.item()))
    assert outcomes == [(True, 0), (False, 1), (False, 2), (True, 2), (False, 3)]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_step_scheduler_steps_only_when_applied(fused: bool, device: str) -> None:
    p = _param([1.0], device=device)
    lso = LSO(torch.optim.SGD([p], lr=1.0, fused=fused or None), initial_scale=8)
    scheduler = torch.optim.lr_scheduler.StepLR(lso, step_size=1, gamma=0.5)
    results, lrs = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for grad in [INF, 1.0, NAN, 1.0]:
            p.grad = torch.tensor([grad], device=device) * lso.loss_scale  # scaled by hand
            lso.step()
            results.append(lso.step_scheduler(scheduler))
            lrs.append(lso.param_groups[0]["lr"])
    assert results == [False, True, False, True]
    assert lrs == [1.0, 0.5, 0.5, 0.25]
    assert scheduler.last_epoch == 2


def test_no_scheduler_order_warning_when_the_first_step_is_skipped() -> None:
    p = _param([1.0])
    lso = LSO(_sgd(p), initial_scale=8)
    scheduler = torch.optim.lr_scheduler.StepLR(lso, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.grad = torch.tensor([INF]) * lso.loss_scale  # scaled by hand
        lso.step()
        assert lso.last_step_applied.item() is False
        scheduler.step()  # direct call after a skipped first step: no warning
    assert lso.param_groups[0]["lr"] == 0.5


def test_scheduler_order_warning_is_real() -> None:
    # the check above could fail: the warning fires when no step() came first
    lso = LSO(_sgd(), initial_scale=8)
    scheduler = torch.optim.lr_scheduler.StepLR(lso, step_size=1)
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        scheduler.step()


def test_step_together_counts_as_a_step_for_the_scheduler() -> None:
    p, q = _param([1.0]), _param([1.0])
    a, b = LSO(_sgd(p), initial_scale=8), LSO(_sgd(q), initial_scale=8)
    scheduler = torch.optim.lr_scheduler.StepLR(a, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.grad, q.grad = torch.tensor([INF]) * a.loss_scale, torch.tensor([1.0]) * b.loss_scale
        step_together(a, b)
        scheduler.step()


# -- several optimizers (GAN) -----------------------------------------------------------------


def _pair(fused_g: bool, fused_d: bool, device: str = "cpu") -> tuple[Any, Any, Any, Any]:
    g, d = _param([1.0, 1.0], device=device), _param([2.0, 2.0], device=device)
    opt_g = LSO(torch.optim.Adam([g], lr=0.1, fused=fused_g or None), initial_scale=64)
    opt_d = LSO(torch.optim.Adam([d], lr=0.1, fused=fused_d or None), initial_scale=16)
    return g, d, opt_g, opt_d


FUSED_PAIRS = [(False, False), (True, True), (True, False), (False, True)]


@pytest.mark.parametrize(("fg", "fd"), FUSED_PAIRS, ids=["unfused", "fused", "fg", "fd"])
@pytest.mark.parametrize("bad", ["g", "d", "both"])
def test_step_together_skips_both_on_any_overflow(
    fg: bool, fd: bool, bad: str, device: str
) -> None:
    g, d, opt_g, opt_d = _pair(fg, fd, device)
    g.grad, d.grad = (
        torch.tensor([64.0, 64.0], device=device),
        torch.tensor([16.0, 16.0], device=device),
    )
    applied = step_together(opt_g, opt_d)
    assert applied.item() is True
    g1, d1 = g.detach().clone(), d.detach().clone()
    state_g = copy.deepcopy(opt_g.state[g])
    g.grad = torch.tensor([64.0, INF if bad in ("g", "both") else 64.0], device=device)
    d.grad = torch.tensor([NAN if bad in ("d", "both") else 16.0, 16.0], device=device)
    applied = step_together(opt_g, opt_d)
    assert applied.dtype == torch.bool and applied.item() is False
    assert torch.equal(g, g1) and torch.equal(d, d1)
    assert all(torch.equal(v, state_g[k]) for k, v in opt_g.state[g].items())
    assert (opt_g.loss_scale.item(), opt_d.loss_scale.item()) == (32.0, 8.0)
    assert opt_g.last_step_applied.item() is False and opt_d.last_step_applied.item() is False
    assert (opt_g.skipped_steps.item(), opt_d.skipped_steps.item()) == (1, 1)
    g.grad, d.grad = (
        torch.tensor([32.0, 32.0], device=device),
        torch.tensor([8.0, 8.0], device=device),
    )
    assert step_together(opt_g, opt_d).item() is True
    assert not torch.equal(g, g1) and not torch.equal(d, d1)


def test_step_together_rejects_non_loss_scale_optimizers() -> None:
    with pytest.raises(TypeError):
        step_together()
    with pytest.raises(TypeError):
        step_together(LSO(_sgd()), _sgd())


# -- gradient accumulation and clipping --------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_gradient_accumulation_equals_one_big_batch(fused: bool, device: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(32, 5).to(device), torch.randn(32, 1).to(device)

    def make() -> tuple[Any, Any]:
        torch.manual_seed(1)
        model = torch.nn.Linear(5, 1).to(device)
        return model, LSO(torch.optim.Adam(model.parameters(), lr=0.01, fused=fused or None))

    big_model, big = make()
    big.get_scaled_loss(torch.nn.functional.mse_loss(big_model(x), y)).backward()
    big.step()

    acc_model, acc = make()
    for xb, yb in zip(x.chunk(4), y.chunk(4), strict=True):
        loss = torch.nn.functional.mse_loss(acc_model(xb), yb) / 4
        acc.get_scaled_loss(loss).backward()
    acc.step()
    assert acc.dynamic_counter == 1
    for p, q in zip(big_model.parameters(), acc_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_with_an_overflowing_micro_batch_skips() -> None:
    p = _param([1.0])
    lso = LSO(_sgd(p), initial_scale=8)
    lso.get_scaled_loss(p.sum()).backward()
    lso.get_scaled_loss(p.sum() * INF).backward()
    lso.get_scaled_loss(p.sum()).backward()
    lso.step()
    assert p.item() == 1.0 and lso.loss_scale.item() == 4.0


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_clipping_after_unscale_never_unscales_twice(fused: bool, device: str) -> None:
    p = _param([0.0, 0.0], device=device)
    lso = LSO(torch.optim.SGD([p], lr=1.0, fused=fused or None), initial_scale=16)
    lso.get_scaled_loss((p * torch.tensor([3.0, 4.0], device=device)).sum()).backward()
    assert p.grad.tolist() == [48.0, 64.0]
    lso.unscale_()
    norm = torch.nn.utils.clip_grad_norm_(p, max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    lso.unscale_()  # a second call does nothing
    assert p.grad.tolist() == pytest.approx([0.6, 0.8], rel=1e-6)
    lso.step()
    assert p.detach().tolist() == pytest.approx([-0.6, -0.8], rel=1e-6)
    assert p.grad.tolist() == pytest.approx([0.6, 0.8], rel=1e-6)
    assert lso.last_step_applied.item() is True


def test_clipping_an_overflow_still_skips() -> None:
    p = _param([0.0, 0.0])
    lso = LSO(_sgd(p), initial_scale=16)
    p.grad = torch.tensor([INF, 1.0])
    lso.unscale_()
    torch.nn.utils.clip_grad_norm_(p, max_norm=1.0)
    lso.step()
    assert p.detach().tolist() == [0.0, 0.0]
    assert lso.last_step_applied.item() is False
    assert lso.loss_scale.item() == 8.0


# -- overflow diagnostics ----------------------------------------------------------------------


def test_nonfinite_gradients_names_and_max_abs() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    lso = LSO(torch.optim.SGD(model.parameters(), lr=0.1))
    lso.get_scaled_loss(model(torch.ones(4, 2)).sum()).backward()
    assert lso.nonfinite_gradients(model) == []
    assert lso.nonfinite_gradients() == []
    model[1].weight.grad[0, 1] = -INF
    model[0].bias.grad[2] = NAN
    report = lso.nonfinite_gradients(model)
    assert [name for name, _ in report] == ["0.bias", "1.weight"]
    assert math.isnan(report[0][1])
    assert report[1][1] == INF
    unnamed = lso.nonfinite_gradients()
    assert [name for name, _ in unnamed] == ["param_groups[0][1]", "param_groups[0][2]"]
    lso.step()  # skipped: the unfused path keeps the non-finite entries for inspection
    assert lso.last_step_applied.item() is False
    assert [name for name, _ in lso.nonfinite_gradients(model)] == ["0.bias", "1.weight"]


def test_nonfinite_gradients_ignores_params_without_grads_and_sparse() -> None:
    emb = torch.nn.Embedding(3, 2, sparse=True)
    other = torch.nn.Parameter(torch.ones(2))
    lso = LSO(torch.optim.SGD([emb.weight, other], lr=0.1))
    lso.get_scaled_loss(emb(torch.tensor([1])).sum()).backward()
    assert lso.nonfinite_gradients() == []
    emb.weight.grad = torch.sparse_coo_tensor(
        torch.tensor([[0]]), torch.tensor([[INF, 2.0]]), (3, 2), check_invariants=True
    )
    assert lso.nonfinite_gradients() == [("param_groups[0][0]", INF)]


# -- a fixed scale never skips (TensorFlow) ----------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_fixed_scale_applies_non_finite_gradients(fused: bool, device: str) -> None:
    p = _param([1.0, 2.0], device=device)
    lso = LSO(torch.optim.SGD([p], lr=1.0, fused=fused or None), dynamic=False, initial_scale=4)
    scheduler = torch.optim.lr_scheduler.StepLR(lso, 1)
    p.grad = torch.tensor([4.0, 8.0], device=device)
    lso.step()
    assert p.detach().tolist() == [0.0, 0.0]
    p.grad = torch.tensor([NAN, 4.0], device=device)
    lso.step()
    assert math.isnan(p[0].item()) and p[1].item() == -1.0
    assert lso.last_step_applied.item() is True
    assert lso.skipped_steps.item() == 0
    assert lso.loss_scale.item() == 4.0
    assert lso.step_scheduler(scheduler) is True


def test_fixed_scale_with_a_closure_applies_non_finite_gradients() -> None:
    p = _param([1.0])
    lso = LSO(_sgd(p), dynamic=False, initial_scale=2)

    def closure() -> Any:
        lso.zero_grad()
        loss = (p * INF).sum()
        lso.get_scaled_loss(loss).backward()
        return loss

    lso.step(closure)
    assert p.item() == -INF


# -- trajectories equal the core's -------------------------------------------------------------


def _trajectory(
    flags: list[bool], fused: bool, initial: float, period: int, device: str = "cpu"
) -> None:
    p = _param([0.5, -0.5], device=device)
    inner = torch.optim.Adam([p], lr=1e-3, fused=fused or None)
    lso = LSO(inner, initial_scale=initial, dynamic_growth_steps=period)
    core = lossscale.DynamicLossScale(initial, period)
    for i, finite in enumerate(flags):
        grad = [0.5, 0.25] if finite else [0.5, INF if i % 2 else NAN]
        scale = lso.loss_scale.item()
        p.grad = torch.tensor(grad, device=device) * scale
        lso.step()
        _, should_apply = core.update([np.array(grad, np.float32)])
        assert lso.last_step_applied.item() is bool(should_apply), i
        assert lso.loss_scale.item() == float(core()), i
        assert lso.dynamic_counter == core.num_good_steps, i
    assert lso.skipped_steps.item() == flags.count(False)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize(
    ("initial", "period"), [(2.0**10, 3), (2.0**126, 1), (2.0, 2), (1.0, 1)], ids=str
)
def test_trajectory_equals_the_core_on_a_seeded_sequence(
    fused: bool, initial: float, period: int, device: str
) -> None:
    rng = random.Random(f"{initial}-{period}")
    flags = [rng.random() < 0.7 for _ in range(120)]
    _trajectory(flags, fused, initial, period, device)


@settings(max_examples=25, deadline=None)
@given(
    flags=st.lists(st.booleans(), max_size=30),
    fused=st.booleans(),
    exponent=st.integers(0, 127),
    period=st.integers(1, 4),
)
def test_trajectory_equals_the_core_property(
    flags: list[bool], fused: bool, exponent: int, period: int
) -> None:
    _trajectory(flags, fused, 2.0**exponent, period)


# -- state_dict / load_state_dict --------------------------------------------------------------


def _adam_run(steps: list[float], fused: bool = False, device: str = "cpu") -> tuple[Any, Any]:
    torch.manual_seed(3)
    model = torch.nn.Linear(3, 2).to(device)
    lso = LSO(
        torch.optim.Adam(model.parameters(), lr=0.01, fused=fused or None),
        initial_scale=64,
        dynamic_growth_steps=2,
    )
    _train(model, lso, steps, device)
    return model, lso


def _train(model: Any, lso: Any, steps: list[float], device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(len(steps))
    for bad in steps:
        x = torch.randn(4, 3, generator=g).to(device)
        loss = model(x).pow(2).mean() * bad
        lso.get_scaled_loss(loss).backward()
        lso.step()
        lso.zero_grad()


def test_state_dict_contents() -> None:
    _, lso = _adam_run([1.0, INF, 1.0])
    sd = lso.state_dict()
    assert set(sd) == {"state", "param_groups", "loss_scale", "skipped_steps"}
    assert sd["loss_scale"] == {
        "version": 1,
        "class_name": "DynamicLossScale",
        "current_loss_scale": 32.0,
        "num_good_steps": 1,
        "num_nonfinite_steps": 0,
    }
    assert sd["skipped_steps"] == 1
    assert sd["state"][0]["step"].item() == 2.0  # the skipped step did not count
    fixed = LSO(_sgd(), dynamic=False, initial_scale=8).state_dict()
    assert fixed["loss_scale"]["class_name"] == "FixedLossScale"
    assert fixed["loss_scale"]["current_loss_scale"] == 8.0
    assert fixed["skipped_steps"] == 0


def test_load_into_a_fresh_optimizer_before_the_first_step() -> None:
    model, lso = _adam_run([1.0, INF, 1.0, 1.0, 1.0])
    buffer = io.BytesIO()
    torch.save(lso.state_dict(), buffer)
    buffer.seek(0)
    sd = torch.load(buffer, weights_only=True)
    fresh_model = copy.deepcopy(model)
    inner = torch.optim.Adam(fresh_model.parameters(), lr=0.5)
    fresh = LSO(inner, initial_scale=64, dynamic_growth_steps=2)
    fresh.load_state_dict(sd)
    assert fresh.loss_scale.item() == lso.loss_scale.item() == 64.0
    assert fresh.dynamic_counter == lso.dynamic_counter == 1
    assert fresh.skipped_steps.item() == 1
    assert fresh.param_groups[0]["lr"] == 0.01
    assert fresh.param_groups is inner.param_groups
    assert fresh.state is inner.state
    assert all(
        torch.equal(inner.state[p]["exp_avg"], lso.state[q]["exp_avg"])
        for p, q in zip(fresh_model.parameters(), model.parameters(), strict=True)
    )


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_resume_mid_run_continues_identically(fused: bool, device: str) -> None:
    first = [1.0, 1.0, INF, 1.0, 1.0, 1.0]
    second = [1.0, NAN, 1.0, 1.0, 1.0, INF, 1.0]
    full_model, full = _adam_run(first, fused, device)
    part_model, part = _adam_run(first, fused, device)
    buffer = io.BytesIO()
    torch.save({"model": part_model.state_dict(), "opt": part.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)

    torch.manual_seed(99)
    resumed_model = torch.nn.Linear(3, 2).to(device)
    resumed_model.load_state_dict(ckpt["model"])
    resumed = LSO(
        torch.optim.Adam(resumed_model.parameters(), lr=0.01, fused=fused or None),
        initial_scale=64,
        dynamic_growth_steps=2,
    )
    resumed.load_state_dict(ckpt["opt"])
    _train(full_model, full, second, device)
    _train(resumed_model, resumed, second, device)
    for p, q in zip(full_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert resumed.loss_scale.item() == full.loss_scale.item()
    assert resumed.dynamic_counter == full.dynamic_counter
    assert resumed.skipped_steps.item() == full.skipped_steps.item() == 3


def test_load_state_dict_keeps_sharing_for_lr_schedulers() -> None:
    p = _param([0.0])
    inner = _sgd(p, lr=1.0)
    lso = LSO(inner, initial_scale=1)
    lso.load_state_dict(LSO(_sgd(_param([0.0]), lr=1.0), initial_scale=1).state_dict())
    assert lso.param_groups is inner.param_groups
    assert lso.state is inner.state
    scheduler = torch.optim.lr_scheduler.StepLR(lso, step_size=1, gamma=0.5)
    p.grad = torch.ones(1)
    lso.step()
    scheduler.step()
    p.grad = torch.ones(1)
    lso.step()
    assert p.item() == -1.5  # the second step used the scheduled lr 0.5


def test_load_a_plain_torch_optimizer_state_dict_keeps_the_scale() -> None:
    p = _param([1.0])
    lso = LSO(torch.optim.Adam([p], lr=0.1), initial_scale=8)
    p.grad = torch.tensor([INF])
    lso.step()
    q = _param([1.0])
    other = torch.optim.Adam([q], lr=0.3)
    q.grad = torch.ones(1)
    other.step()
    lso.load_state_dict(other.state_dict())
    assert lso.param_groups[0]["lr"] == 0.3
    assert lso.state[p]["step"].item() == 1.0
    assert lso.loss_scale.item() == 4.0
    assert lso.skipped_steps.item() == 1


MALFORMED = {
    "not a dict": 4.0,
    "missing key": {"version": 1, "class_name": "DynamicLossScale", "current_loss_scale": 2.0},
    "negative scale": {
        "version": 1,
        "class_name": "DynamicLossScale",
        "current_loss_scale": -2.0,
        "num_good_steps": 0,
        "num_nonfinite_steps": 0,
    },
    "counter out of range": {
        "version": 1,
        "class_name": "DynamicLossScale",
        "current_loss_scale": 2.0,
        "num_good_steps": 2,
        "num_nonfinite_steps": 0,
    },
    "other class": {"version": 1, "class_name": "FixedLossScale", "current_loss_scale": 2.0},
    "other version": {
        "version": 2,
        "class_name": "DynamicLossScale",
        "current_loss_scale": 2.0,
        "num_good_steps": 0,
        "num_nonfinite_steps": 0,
    },
}


@pytest.mark.parametrize("name", [*MALFORMED, "skipped -1", "skipped 1.5", "skipped True"])
def test_a_malformed_loss_scale_state_changes_nothing(name: str) -> None:
    p = _param([1.0])
    inner = torch.optim.Adam([p], lr=0.1)
    lso = LSO(inner, initial_scale=8, dynamic_growth_steps=2)
    p.grad = torch.ones(1) * 8
    lso.step()
    before_state = copy.deepcopy(inner.state_dict())
    sd = _adam_run([1.0, 1.0, 1.0])[1].state_dict()
    sd["param_groups"][0]["params"] = [0]
    sd["state"] = {0: sd["state"][0]}
    sd["param_groups"][0]["lr"] = 0.7
    if name.startswith("skipped"):
        sd["skipped_steps"] = {"skipped -1": -1, "skipped 1.5": 1.5, "skipped True": True}[name]
        match = "skipped_steps"
    else:
        sd["loss_scale"] = MALFORMED[name]
        match = "state"
    with pytest.raises(ValueError, match=match):
        lso.load_state_dict(sd)
    after = inner.state_dict()
    assert after["param_groups"] == before_state["param_groups"]
    assert inner.param_groups[0]["lr"] == 0.1
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(after["state"][0][key], before_state["state"][0][key])
    assert lso.loss_scale.item() == 8.0
    assert lso.dynamic_counter == 1
    assert lso.skipped_steps.item() == 0


def test_grad_scaler_state_dict_loads_its_scale_and_growth_tracker() -> None:
    model = torch.nn.Linear(2, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2000)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        scaler.scale(model(torch.ones(3, 2)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    sd = scaler.state_dict()
    assert sd["_growth_tracker"] == 3
    lso = LSO(torch.optim.SGD(model.parameters(), lr=0.01))
    inner_before = copy.deepcopy(lso.inner_optimizer.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lso.load_state_dict(sd)
    assert lso.loss_scale.item() == 4096.0
    assert lso.dynamic_counter == 3
    assert lso.inner_optimizer.state_dict() == inner_before


def test_grad_scaler_state_with_other_settings_warns_and_clamps_the_tracker() -> None:
    sd = {
        "scale": 256.0,
        "growth_factor": 3.0,
        "backoff_factor": 0.5,
        "growth_interval": 100,
        "_growth_tracker": 40,
    }
    lso = LSO(_sgd(), dynamic_growth_steps=10)
    with pytest.warns(UserWarning) as record:
        lso.load_state_dict(sd)
    messages = " ".join(str(w.message) for w in record)
    assert "growth_factor" in messages and "growth_interval" in messages
    assert lso.loss_scale.item() == 256.0
    assert lso.dynamic_counter == 9
    assert lso.dynamic_growth_steps == 10


def test_grad_scaler_state_into_a_fixed_optimizer_is_a_value_error() -> None:
    sd = torch.amp.GradScaler("cpu").state_dict()
    lso = LSO(_sgd(), dynamic=False, initial_scale=4)
    with pytest.raises(ValueError, match="dynamic"):
        lso.load_state_dict(sd)
    assert lso.loss_scale.item() == 4.0


def test_load_state_dict_rejects_non_dicts() -> None:
    with pytest.raises(TypeError):
        LSO(_sgd()).load_state_dict([("state", {})])  # type: ignore[arg-type]


# -- config ----------------------------------------------------------------------------------


def test_get_config_has_tensorflows_keys() -> None:
    inner = torch.optim.SGD([_param([1.0])], lr=0.1, momentum=0.9)
    lso = LSO(inner, initial_scale=8, dynamic_growth_steps=3)
    config = lso.get_config()
    assert config == {
        "inner_optimizer": {"class_name": "SGD", "config": dict(inner.defaults)},
        "dynamic": True,
        "initial_scale": 8.0,
        "dynamic_growth_steps": 3,
    }
    assert config["inner_optimizer"]["config"]["momentum"] == 0.9
    assert LSO(_sgd(), dynamic=False, initial_scale=5).get_config()["dynamic_growth_steps"] is None


def test_get_config_keeps_the_initial_scale_after_updates() -> None:
    p = _param([1.0])
    lso = LSO(_sgd(p), initial_scale=8)
    p.grad = torch.tensor([INF])
    lso.step()
    assert lso.get_config()["initial_scale"] == 8.0


def test_get_config_includes_non_default_extensions() -> None:
    lso = LSO(_sgd(), initial_scale=8, min_loss_scale=0.5, hysteresis=2)
    config = lso.get_config()
    assert config["min_loss_scale"] == 0.5 and config["hysteresis"] == 2
    assert "max_loss_scale" not in config


def test_from_config_round_trip() -> None:
    inner = torch.optim.Adam([_param([1.0])], lr=0.02)
    config = LSO(inner, initial_scale=8, dynamic_growth_steps=3).get_config()
    rebuilt = LSO.from_config(config, [_param([2.0])])
    assert rebuilt.get_config() == config
    assert isinstance(rebuilt.inner_optimizer, torch.optim.Adam)
    with pytest.raises(ValueError, match="unknown"):
        LSO.from_config({**config, "inner_optimizer": {"class_name": "Nope", "config": {}}}, [])


# -- scales below one (the min_loss_scale extension) -------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_a_gradient_overflowing_when_unscaled_by_a_scale_below_one_is_skipped(
    fused: bool, fused_decision: str, device: str
) -> None:
    # scale 0.5 multiplies by 2: finite scaled gradients become inf once unscaled
    p = _param([0.0], torch.float16, device=device)
    lso = LSO(
        torch.optim.SGD([p], lr=1.0, fused=fused or None), initial_scale=0.5, min_loss_scale=0.5
    )
    p.grad = torch.tensor([60000.0], dtype=torch.float16, device=device)
    lso.step()
    assert p.item() == 0.0
    assert lso.last_step_applied.item() is False
    q = _param([0.0], device=device)
    adam = LSO(
        torch.optim.Adam([q], lr=1.0, fused=fused or None), initial_scale=0.5, min_loss_scale=0.5
    )
    q.grad = torch.tensor([3e38], device=device)
    adam.step()
    assert q.item() == 0.0
    assert adam.last_step_applied.item() is False
    if fused and fused_decision == "device":  # the kernel ran with found_inf = 1: step back to 0
        assert adam.state[q]["step"].item() == 0.0
    else:
        assert q not in adam.state
    q.grad = torch.tensor([1.0], device=device)
    adam.step()  # a finite step is unscaled once: Adam's first step moves by lr
    assert adam.last_step_applied.item() is True
    assert q.item() == pytest.approx(-1.0, rel=1e-6)
    assert q.grad.item() == 2.0


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_trajectory_with_extensions_equals_the_core(fused: bool, device: str) -> None:
    rng = random.Random(7)
    flags = [rng.random() < 0.6 for _ in range(80)]
    p = _param([0.5, -0.5], device=device)
    kwargs = {"min_loss_scale": 0.25, "hysteresis": 2}
    lso = LSO(
        torch.optim.Adam([p], lr=1e-3, fused=fused or None),
        initial_scale=2.0,
        dynamic_growth_steps=3,
        **kwargs,
    )
    core = lossscale.DynamicLossScale(2.0, 3, **kwargs)
    lowest = INF
    for i, finite in enumerate(flags):
        grad = [0.5, 0.25] if finite else [0.5, INF]
        p.grad = torch.tensor(grad, device=device) * lso.loss_scale
        lso.step()
        lowest = min(lowest, lso.loss_scale.item())
        _, should_apply = core.update([np.array(grad, np.float32)])
        assert lso.last_step_applied.item() is bool(should_apply), i
        assert lso.loss_scale.item() == float(core()), i
        assert lso.dynamic_counter == core.num_good_steps, i
    assert lowest == 0.25  # the run went below 1, down to the floor


# -- what .grad holds after step() (T6) ----------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
def test_grads_after_a_step(fused: bool, fused_decision: str, device: str) -> None:
    # Unfused: unscaled, applied or skipped. Fused, decided on the device (a GPU): the kernel
    # gets the scale (grad_scale) and unscales .grad as it applies the step; a skipped fused
    # step leaves the grads scaled, as under torch's GradScaler (pytorch PR #97415): the check
    # is the loss scaling's only pass. Fused on the CPU: stepped as unfused.
    p = _param([1.0, 1.0], device=device)
    lso = LSO(torch.optim.Adam([p], lr=0.1, fused=fused), initial_scale=8)
    p.grad = torch.tensor([8.0, 16.0], device=device)
    lso.step()
    assert bool(lso.last_step_applied)
    assert p.grad.tolist() == [1.0, 2.0]
    p.grad = torch.tensor([8.0, INF], device=device)
    lso.step()
    assert not bool(lso.last_step_applied)
    scaled = fused and fused_decision == "device"
    assert p.grad.tolist() == ([8.0, INF] if scaled else [1.0, INF])


def test_grads_after_a_fused_step_are_unscaled_after_unscale_(device: str) -> None:
    p = _param([1.0, 1.0], device=device)
    lso = LSO(torch.optim.Adam([p], lr=0.1, fused=True), initial_scale=8)
    p.grad = torch.tensor([8.0, INF], device=device)
    lso.unscale_()
    lso.step()
    assert not bool(lso.last_step_applied)
    assert p.grad.tolist() == [1.0, INF]


def test_grads_after_an_unfused_skipped_step_are_unscaled() -> None:
    p = _param([1.0, 1.0])
    lso = LSO(torch.optim.Adam([p], lr=0.1), initial_scale=8)
    p.grad = torch.tensor([8.0, INF])
    lso.step()
    assert p.grad.tolist() == [1.0, INF]


def test_unscaled_sparse_gradients() -> None:
    indices = torch.tensor([[0, 0, 2]])
    sparse = torch.sparse_coo_tensor(
        indices, torch.tensor([2.0, 4.0, 6.0]), (3,), check_invariants=True
    )
    (out,) = LSO(_sgd(), initial_scale=2).get_unscaled_gradients([sparse])
    assert out.is_sparse and out.dtype == torch.float32
    assert torch.equal(out.to_dense(), torch.tensor([3.0, 0.0, 3.0]))
    assert torch.equal(sparse._values(), torch.tensor([2.0, 4.0, 6.0]))


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_step_with_a_closure_on_a_fused_optimizer_unscales_once(fused: bool, device: str) -> None:
    p = _param([1.0], device=device)
    lso = LSO(torch.optim.SGD([p], lr=0.25, fused=fused or None), initial_scale=8)

    def closure() -> Any:
        lso.zero_grad()
        loss = (p * p).sum()
        lso.get_scaled_loss(loss).backward()
        return loss

    lso.step(closure)
    assert p.grad.item() == 2.0
    assert p.item() == 0.5


# -- a half dtype the fused kernel lacks (bfloat16 on CUDA, pytorch#127176) ----------------------
# CPU-only: a simulation of CUDA's missing kernel (on CUDA: _dtypes_test.py, the real one).
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_bfloat16_grads_where_the_fused_kernel_lacks_them(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA, ``_amp_foreach_non_finite_check_and_unscale_`` has no bfloat16 kernel (torch
    raises NotImplementedError, and GradScaler fails). Simulated here on CPU: the optimizer
    falls back to float32 copies and ends bit-identical to the native kernel's run."""
    real = torch._amp_foreach_non_finite_check_and_unscale_
    calls = {"refused": 0}

    def no_bfloat16(tensors: Any, found: Any, inv: Any) -> None:
        if tensors and tensors[0].dtype == torch.bfloat16:
            calls["refused"] += 1
            raise NotImplementedError(
                "\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'"
            )
        real(tensors, found, inv)

    def run(patch: bool) -> tuple[list[Any], list[float], list[bool]]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (5, 7)]
        params.append(torch.nn.Parameter(torch.randn(3)))  # a float32 group beside it
        inner = torch.optim.Adam(params, lr=0.1, fused=True if fused else None, foreach=not fused)
        opt = LossScaleOptimizer(inner, initial_scale=2.0**10, dynamic_growth_steps=2)
        if patch:
            monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", no_bfloat16)
        scales, applied = [], []
        for step in range(6):
            for i, p in enumerate(params):
                p.grad = (torch.linspace(-3, 3, p.numel()) * 2.0**10 * (i + 1)).to(p.dtype)
            if step in (2, 4):
                params[step // 2 - 1].grad[1] = math.inf if step == 2 else math.nan
            opt.step()
            scales.append(float(opt.loss_scale))
            applied.append(bool(opt.last_step_applied))
        monkeypatch.undo()
        return [p.detach().clone() for p in params], scales, applied

    native = run(patch=False)
    fallback = run(patch=True)
    assert calls["refused"] == 1  # tried once, then the group is remembered
    assert fallback[1:] == native[1:]
    assert fallback[2] == [True, True, False, True, False, True]
    assert all(torch.equal(a, b) for a, b in zip(fallback[0], native[0], strict=True))
    assert fallback[0][0].dtype == torch.bfloat16


def test_a_remembered_fallback_stays_with_its_group_when_other_groups_lose_their_grads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-group memory (bfloat16 refused by the kernel) belongs to the bfloat16 group, not
    to a position among this step's groups with grads: a float32 group that has no grads at
    the first step and grads later must not shift it (the kernel is refused only once)."""
    real = torch._amp_foreach_non_finite_check_and_unscale_
    refused: list[Any] = []

    def no_bfloat16(tensors: Any, found: Any, inv: Any) -> None:
        if tensors and tensors[0].dtype == torch.bfloat16:
            refused.append(tensors[0].dtype)
            raise NotImplementedError("not implemented for 'BFloat16'")
        real(tensors, found, inv)

    first = torch.nn.Parameter(torch.ones(3))  # float32, grouped first
    second = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = LossScaleOptimizer(torch.optim.SGD([first, second], lr=0.1), initial_scale=2.0)
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", no_bfloat16)
    for step in range(3):
        second.grad = torch.full((4,), 2.0, dtype=torch.bfloat16)
        first.grad = None if step == 0 else torch.full((3,), 2.0)
        opt.step()
        assert bool(opt.last_step_applied)
    assert refused == [torch.bfloat16]  # refused once, remembered for its own group
    assert second.grad.tolist() == [1.0] * 4 and first.grad.tolist() == [1.0] * 3
