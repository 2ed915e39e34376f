"""End to end: training under autocast with injected overflows, and torch.compile."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lossscale.torch import LossScaleOptimizer  # noqa: E402

OVERFLOW_STEPS = (5, 12)
STEPS = 60


def _data(device: str) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    y = torch.tanh(x @ w) + 0.01 * torch.randn(256, 1, generator=g)
    return x.to(device), y.to(device)


def _model(device: str) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model.to(device)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_autocast_training_with_injected_overflows_converges(
    dtype: Any, fused: bool, device: str
) -> None:
    x, y = _data(device)
    model = _model(device)
    lso = LossScaleOptimizer(
        torch.optim.Adam(model.parameters(), lr=3e-2, fused=fused or None),
        initial_scale=2.0**12,
        dynamic_growth_steps=15,
    )
    loss_fn = torch.nn.functional.mse_loss
    with torch.no_grad():
        initial_loss = loss_fn(model(x), y).item()
    skipped, scales = [], []
    for step in range(STEPS):
        idx = torch.arange(step * 32, step * 32 + 32, device=device) % 256
        with torch.autocast(device, dtype=dtype):
            out = model(x[idx])
        assert out.dtype == dtype  # autocast is really on
        loss = loss_fn(out.float(), y[idx])
        lso.get_scaled_loss(loss).backward()
        if step in OVERFLOW_STEPS:
            model[0].weight.grad.mul_(float("inf"))
        before = [p.detach().clone() for p in model.parameters()]
        lso.step()
        if not lso.last_step_applied.item():
            skipped.append(step)
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        lso.zero_grad()
        scales.append(lso.loss_scale.item())
    assert skipped == list(OVERFLOW_STEPS)
    assert lso.skipped_steps.item() == len(OVERFLOW_STEPS)
    assert scales[OVERFLOW_STEPS[0]] == scales[OVERFLOW_STEPS[0] - 1] / 2  # backed off
    assert max(scales) > 2.0**12  # and grew again
    with torch.no_grad():
        final_loss = loss_fn(model(x), y).item()
    assert final_loss < initial_loss / 10, (initial_loss, final_loss)


# -- torch.compile -------------------------------------------------------------------------------


# torch.compile's tracing touches the deprecated torch.jit.script_method: not ours to fix.
COMPILE_WARNINGS = pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning")


@pytest.fixture
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile_setup(fused: bool = True, device: str = "cpu") -> tuple[Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(device)
    lso = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused or None),
        initial_scale=256.0,
        dynamic_growth_steps=2,
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    return model, lso, x.to(device), y.to(device)


@COMPILE_WARNINGS
@pytest.mark.xfail(
    strict=True,
    raises=torch._dynamo.exc.Unsupported,
    reason=(
        "torch 2.13: every torch.optim step (fused included) is wrapped by "
        "_use_grad_for_differentiable, which calls torch._dynamo.graph_break() "
        "unconditionally, so no train step that calls a torch.optim step compiles with "
        "fullgraph=True (see test_a_bare_fused_torch_optimizer_step_does_not_compile_fullgraph). "
        "Tensor.backward() also needs torch._dynamo.config.trace_autograd_ops=True."
    ),
)
def test_compile_fullgraph_of_a_whole_train_step(fresh_dynamo: Any) -> None:
    model, lso, x, y = _compile_setup()

    def train_step(x: Any, y: Any) -> Any:
        loss = torch.nn.functional.mse_loss(model(x), y)
        lso.get_scaled_loss(loss).backward()
        lso.step()
        lso.zero_grad()
        return loss.detach()

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        step = torch.compile(train_step, fullgraph=True, backend="eager")
        step(x, y)
    assert lso.last_step_applied.item() is True


@COMPILE_WARNINGS
def test_a_bare_fused_torch_optimizer_step_does_not_compile_fullgraph(fresh_dynamo: Any) -> None:
    # The reason of the xfail above lies in torch, not in lossscale: when this starts to pass
    # (fails here), remove the xfail.
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    model(torch.ones(2, 4)).sum().backward()
    step = torch.compile(opt.step, fullgraph=True, backend="eager")
    with pytest.raises(torch._dynamo.exc.Unsupported, match="graph_break"):
        step()


@COMPILE_WARNINGS
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_compiled_step_matches_eager(
    fused: bool, fresh_dynamo: Any, device: str, request: pytest.FixtureRequest
) -> None:
    # torch.compile (graph breaks allowed) of step(): same params, scale, counter and skip
    # record as eager. torch.compile drops attribute stores on Optimizer instances, so this
    # fails if the step's record lives on the optimizer object itself.
    if device == "cuda" and tuple(int(n) for n in torch.__version__.split(".")[:2]) < (2, 13):
        request.applymarker(
            pytest.mark.xfail(
                reason="seen on an H200 with torch 2.11: its dynamo fails inside the compiled "
                "step on CUDA (a setattr on the optimizer, a sympy error); CI pins torch 2.13",
                strict=False,
            )
        )
    eager_model, eager, x, y = _compile_setup(fused, device)
    model, lso, _, _ = _compile_setup(fused, device)
    compiled_step = torch.compile(lso.step, backend="eager")
    for i, bad in enumerate([1.0, 1.0, float("inf"), 1.0, 1.0]):
        for m, opt, step in ((eager_model, eager, eager.step), (model, lso, compiled_step)):
            loss = torch.nn.functional.mse_loss(m(x), y) * bad
            opt.get_scaled_loss(loss).backward()
            if i == 3:
                opt.unscale_()  # a pending unscale_() must be consumed by the compiled step
            step()
            opt.zero_grad()
        assert lso.last_step_applied.item() is eager.last_step_applied.item() is (bad == 1.0)
        assert lso.skipped_steps.item() == eager.skipped_steps.item()
        assert lso.loss_scale.item() == eager.loss_scale.item()
        assert lso.dynamic_counter == eager.dynamic_counter
        for p, q in zip(model.parameters(), eager_model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert lso.skipped_steps.item() == 1
