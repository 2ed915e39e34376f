"""Gradient dtypes in the torch front ends (issue 18 item 6, torch path).

An integer or bool gradient cannot be unscaled (multiplying by the reciprocal cast to it gives
0; applying it unscaled is ``loss_scale`` times too large): every entry point that unscales
rejects it with a TypeError naming where it is, before anything changes. Complex gradients are
unscaled and checked through their float views (torch.amp.GradScaler's kernel has no complex
dtype and raises NotImplementedError).
"""

from __future__ import annotations

import pytest
import torch

from lossscale.torch import GradScaler, LossScaleOptimizer


def _int_param() -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.arange(3), requires_grad=False)
    p.grad = torch.full((3,), 8, dtype=torch.int64)  # torch allows a same-dtype .grad
    return p


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize(
    ("bad", "what"),
    [
        (torch.tensor([4, 8]), "torch.int64"),
        (torch.tensor([True]), "torch.bool"),
        (3.0, "3.0"),
    ],
)
def test_get_unscaled_gradients_rejects_non_float_entries(
    enabled: bool, bad: object, what: str
) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(torch.optim.SGD([p], lr=0.1), initial_scale=4.0, enabled=enabled)
    with pytest.raises(TypeError, match=rf"grads\[1\]: .*got (dtype )?{what}"):
        opt.get_unscaled_gradients([torch.ones(2), bad, None])
    assert float(opt.loss_scale) == (4.0 if enabled else 1.0)


def test_get_unscaled_gradients_of_complex_gradients() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(torch.optim.SGD([p], lr=0.1), initial_scale=3.0)
    g = torch.tensor([6 + 3j, -9 + 1.5j], dtype=torch.complex64)
    (out,) = opt.get_unscaled_gradients([g])
    assert out.dtype == torch.complex64
    assert torch.equal(out, g * torch.reciprocal(torch.tensor(3.0)).to(torch.complex64))


def test_optimizer_step_rejects_an_integer_gradient_and_changes_nothing() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    q = _int_param()
    opt = LossScaleOptimizer(torch.optim.SGD([w, q], lr=0.1), initial_scale=4.0)
    w.grad = torch.full((2,), 4.0)
    opt.get_scaled_loss(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\] .*torch.int64"):
        opt.step()
    assert torch.equal(w, torch.ones(2)) and torch.equal(q, torch.arange(3))
    assert torch.equal(w.grad, torch.full((2,), 4.0))  # not unscaled
    assert float(opt.loss_scale) == 4.0 and opt.dynamic_counter == 0


def test_an_integer_parameter_without_a_gradient_is_left_alone() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    q = torch.nn.Parameter(torch.arange(3), requires_grad=False)
    opt = LossScaleOptimizer(torch.optim.SGD([w, q], lr=0.5), initial_scale=4.0)
    w.grad = torch.full((2,), 4.0)
    opt.get_scaled_loss(torch.tensor(1.0))
    opt.step()
    assert torch.equal(w, torch.full((2,), 0.5)) and torch.equal(q, torch.arange(3))


@pytest.mark.parametrize("call", ["unscale_", "step"])
def test_grad_scaler_rejects_an_integer_gradient_and_changes_nothing(call: str) -> None:
    w = torch.nn.Parameter(torch.ones(2))
    q = _int_param()
    opt = torch.optim.SGD([w, q], lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    w.grad = torch.full((2,), 4.0)
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\] .*torch.int64"):
        getattr(scaler, call)(opt)
    assert torch.equal(w, torch.ones(2)) and torch.equal(w.grad, torch.full((2,), 4.0))
    assert scaler.get_scale() == 4.0


def _complex_grad(bad: bool) -> torch.Tensor:
    g = torch.tensor([8 + 4j, -2 + 6j], dtype=torch.complex64)
    if bad:
        g[1] = complex(1.0, float("inf"))  # only the imaginary part overflows
    return g


@pytest.mark.parametrize("front_end", ["optimizer", "grad_scaler"])
@pytest.mark.parametrize("foreach", [False, True])  # torch's fused optimizers take no complex
def test_complex_parameters_step_like_the_inner_on_unscaled_gradients(
    front_end: str, foreach: bool
) -> None:
    """Finite: the inner optimizer's update with grad / scale; an inf imaginary part: skipped,
    the scale backs off. Side by side with Adam alone on the unscaled gradient."""
    kw = {"foreach": foreach}
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    ref = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    ref_opt = torch.optim.Adam([ref], lr=0.1, **kw)  # type: ignore[arg-type]
    inner = torch.optim.Adam([w], lr=0.1, **kw)  # type: ignore[arg-type]
    lso = LossScaleOptimizer(inner, initial_scale=4.0) if front_end == "optimizer" else None
    scaler = GradScaler("cpu", init_scale=4.0, growth_interval=100)
    for step, bad in enumerate([False, True, False]):
        scale = 4.0 if step == 0 else 2.0
        w.grad = _complex_grad(bad) * scale
        if lso is not None:
            lso.get_scaled_loss(torch.tensor(1.0))
            lso.step()
            now = float(lso.loss_scale)
        else:
            scaler.scale(torch.tensor(1.0))
            scaler.step(inner)
            scaler.update()
            now = scaler.get_scale()
        if not bad:
            ref.grad = _complex_grad(False)
            ref_opt.step()
        assert torch.equal(w, ref), step
        assert now == (2.0 if step else 4.0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.uint8, torch.bool])
def test_grad_scaler_scales_integer_outputs_as_torch_does(dtype: torch.dtype) -> None:
    """torch promotes to float32 (the scale is never cast to the integer dtype, which would
    wrap int8/uint8 and turn bool outputs into bools)."""
    out = torch.tensor([1, 0, 1]).to(dtype)
    ours = GradScaler("cpu").scale(out)
    theirs = torch.amp.GradScaler("cpu").scale(out)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, torch.tensor([65536.0, 0.0, 65536.0]))


def test_get_unscaled_gradients_rejects_a_single_tensor() -> None:
    """Iterating one gradient tensor would unscale its rows and return them as a list."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(torch.optim.SGD([p], lr=0.1), initial_scale=4.0)
    with pytest.raises(TypeError, match=r"got a single tensor; pass \[grad\]"):
        opt.get_unscaled_gradients(torch.ones(2, 3))  # type: ignore[arg-type]
    (out,) = opt.get_unscaled_gradients([torch.ones(2, 3)])
    assert torch.equal(out, torch.full((2, 3), 0.25))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("front_end", ["optimizer", "grad_scaler"])
def test_half_gradients_are_unscaled_in_float32_and_checked(
    front_end: str, dtype: torch.dtype, fused: bool, device: str
) -> None:
    """float16 and bfloat16 parameters and gradients (on CUDA bfloat16 goes through float32
    copies: torch's kernel lacks it there): unscaled with one rounding of ``g * (1 / s)`` in
    float32, then applied; an inf in one of them skips the step and halves the scale."""
    scale = 2.0**10
    params = [torch.nn.Parameter(torch.ones(n, dtype=dtype, device=device)) for n in (5, 3)]
    inner = torch.optim.SGD(params, lr=0.5, fused=True if fused else None, foreach=not fused)
    lso = LossScaleOptimizer(inner, initial_scale=scale) if front_end == "optimizer" else None
    scaler = GradScaler(device, init_scale=scale)

    def step() -> float:
        if lso is not None:
            lso.step()
            return float(lso.loss_scale)
        scaler.scale(torch.ones((), device=device))
        scaler.step(inner)
        scaler.update()
        return scaler.get_scale()

    grads = [torch.linspace(-3000, 3000, p.numel(), device=device).to(dtype) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    assert step() == scale
    inv = torch.reciprocal(torch.tensor(scale, device=device))
    for p, g in zip(params, grads, strict=True):
        unscaled = (g.float() * inv).to(dtype)
        assert p.dtype == p.grad.dtype == dtype
        assert torch.equal(p.grad, unscaled)
        assert torch.equal(p.detach(), torch.ones_like(p).add(unscaled, alpha=-0.5))
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    params[1].grad[0] = float("inf")
    assert step() == scale / 2
    assert all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
