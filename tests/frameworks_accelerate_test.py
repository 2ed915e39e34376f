"""``lossscale.torch.GradScaler`` inside Hugging Face Accelerate, side by side with
``torch.amp.GradScaler``.

Accelerate builds ``torch.amp.GradScaler`` itself for fp16 on a GPU; the plug-in point is
``accelerator.scaler``, set before ``prepare`` (the prepared optimizer takes it). It then calls
``scale`` in ``accelerator.backward``, ``unscale_`` in ``clip_grad_norm_``, ``step`` and
``update`` in the prepared optimizer's ``step`` (which notices a skipped step by patching the
optimizer's ``step`` and reports ``step_was_skipped``; the prepared scheduler then does not
step), and ``state_dict`` / ``load_state_dict`` in ``save_state`` / ``load_state``. On the CPU
``Accelerator(mixed_precision="fp16", cpu=True)`` builds no scaler and no autocast, so the test
sets the scaler and ``native_amp`` by hand and runs the forward under float16 autocast on the
CPU: the GPU code path.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from lossscale.torch import GradScaler  # noqa: E402

STEPS = 10
OVERFLOW_AT = {1, 2, 6}


def _accelerator(scaler: Any) -> Any:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.scaler = scaler  # the plug-in point, before prepare
    accelerator.native_amp = True  # so clip_grad_norm_ unscales through the scaler
    return accelerator


def _setup(scaler: Any) -> tuple[Any, Any, Any, Any]:
    accelerator = _accelerator(scaler)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.8**step)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    return accelerator, model, opt, sched


def _train(
    accelerator: Any, model: Any, opt: Any, sched: Any, steps: range
) -> dict[str, list[Any]]:
    seen: dict[str, list[Any]] = {"skipped": [], "lr": [], "scale": []}
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        if step in OVERFLOW_AT:
            model[0].weight.grad[0, 0] = math.inf
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        seen["skipped"].append(opt.step_was_skipped)
        seen["lr"].append(opt.param_groups[0]["lr"])
        seen["scale"].append(accelerator.scaler.get_scale())
    return seen


def _run(make_scaler: Any) -> tuple[dict[str, list[Any]], list[Any]]:
    accelerator, model, opt, sched = _setup(make_scaler())
    seen = _train(accelerator, model, opt, sched, range(STEPS))
    return seen, [p.detach().clone() for p in model.parameters()]


def test_skips_schedule_weights_and_scales_match_torch_grad_scaler() -> None:
    ours, ours_params = _run(lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=2))
    theirs, theirs_params = _run(
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    )
    assert ours == theirs
    # Accelerate saw every skipped step, and its prepared scheduler did not step on them
    assert [i for i, skipped in enumerate(ours["skipped"]) if skipped] == sorted(OVERFLOW_AT)
    assert ours["lr"][-1] == pytest.approx(0.1 * 0.8 ** (STEPS - len(OVERFLOW_AT)))
    for a, b in zip(ours_params, theirs_params, strict=True):
        assert torch.equal(a, b)


def test_save_state_and_load_state_round_trip_the_scaler(tmp_path: Path) -> None:
    def resume(make_scaler: Any, where: Path) -> tuple[dict[str, Any], dict[str, list[Any]]]:
        accelerator, model, opt, sched = _setup(make_scaler())
        _train(accelerator, model, opt, sched, range(5))
        accelerator.save_state(str(where))
        saved = accelerator.scaler.state_dict()
        accelerator, model, opt, sched = _setup(make_scaler())
        accelerator.load_state(str(where))
        return saved, _train(accelerator, model, opt, sched, range(5, STEPS))

    ours = resume(lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=2), tmp_path / "a")
    theirs = resume(
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2), tmp_path / "b"
    )
    assert {k: v for k, v in ours[0].items() if k != "lossscale"} == theirs[0]
    assert ours[1] == theirs[1]
    uninterrupted, _ = _run(lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=2))
    assert ours[1]["scale"] == uninterrupted["scale"][5:]  # the scale and counter came back
