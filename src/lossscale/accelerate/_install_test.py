"""``lossscale.accelerate.install`` on a real ``accelerate.Accelerator`` on the CPU, side by side
with what Accelerate does on its own there (no scaler, no float16) and with torch's
``GradScaler`` set by hand the same way; the refusals, each leaving the accelerator as it was;
and the dummy step of a checkpoint load passed through."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, GradScalerKwargs

from lossscale._testing import one_torch_thread
from lossscale.accelerate import (
    AcceleratorGradScaler,
    AcceleratorShardedGradScaler,
    install,
)
from lossscale.accelerate._install import SUPPORTED_ACCELERATE, check_accelerate_version

pytestmark = pytest.mark.usefixtures("_one_thread")
_one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)

OVERFLOW_AT = 2  # the step whose gradient gets an inf


def _accelerator(**kwargs: Any) -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **{"mixed_precision": "fp16", **kwargs})


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _snapshot(accelerator: Accelerator) -> tuple[Any, bool]:
    return accelerator.scaler, accelerator.native_amp


def _train(accelerator: Accelerator, steps: int = 5) -> dict[str, Any]:
    """A few steps of a prepared SGD-with-momentum loop; an inf planted in a gradient at
    :data:`OVERFLOW_AT`. What each step left: weights, optimizer state, LR, skip, scale, and the
    dtype the first layer computed in."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    seen: dict[str, Any] = {"weights": [], "momentum": [], "lr": [], "skipped": [], "scale": []}
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        if step == OVERFLOW_AT:
            model[0].weight.grad[0, 0] = math.inf
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        seen["weights"].append([p.detach().clone() for p in model.parameters()])
        seen["momentum"].append([s["momentum_buffer"].clone() for s in opt.state.values()])
        seen["lr"].append(opt.param_groups[0]["lr"])
        seen["skipped"].append(opt.step_was_skipped)
        scaler = accelerator.scaler
        seen["scale"].append(None if scaler is None else scaler.get_scale())
    seen["dtypes"] = sorted({str(d) for d in dtypes})
    return seen


def test_on_the_cpu_accelerate_alone_has_no_scaler_and_no_float16() -> None:
    accelerator = _accelerator()
    assert (accelerator.scaler, accelerator.native_amp) == (None, False)
    seen = _train(accelerator)
    assert seen["dtypes"] == ["torch.float32"]  # fp16 asked for, float32 ran
    assert not any(seen["skipped"])  # the inf step was applied: the weights went non-finite
    assert not all(torch.isfinite(w).all() for w in seen["weights"][-1])


def test_install_trains_in_float16_on_the_cpu_as_torch_scaler_set_by_hand() -> None:
    accelerator = _accelerator()
    scaler = install(accelerator, init_scale=2.0**10, growth_interval=2)
    assert accelerator.scaler is scaler and accelerator.native_amp
    assert type(scaler) is AcceleratorGradScaler and scaler._device == "cpu"
    ours = _train(accelerator)
    by_hand = _accelerator()
    by_hand.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    by_hand.native_amp = True
    theirs = _train(by_hand)
    assert ours["dtypes"] == ["torch.float16"]
    assert ours["skipped"] == [step == OVERFLOW_AT for step in range(5)]
    for key in ("lr", "skipped", "scale", "dtypes"):
        assert ours[key] == theirs[key], key
    for key in ("weights", "momentum"):
        for a, b in zip(ours[key], theirs[key], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), key
    # the skipped step: weights and optimizer state bit-identical, the schedule held back
    before, after = OVERFLOW_AT - 1, OVERFLOW_AT
    for key in ("weights", "momentum"):
        assert all(
            torch.equal(x, y) for x, y in zip(ours[key][before], ours[key][after], strict=True)
        )
    assert ours["lr"][after] == ours["lr"][before]
    assert ours["scale"][after] == ours["scale"][before] / 2


def test_the_scaler_handler_keywords_are_defaults_under_the_settings() -> None:
    accelerator = _accelerator(kwargs_handlers=[GradScalerKwargs(init_scale=512.0)])
    scaler = install(accelerator, growth_interval=7)
    assert scaler.get_scale() == 512.0 and scaler.get_growth_interval() == 7


def test_fsdp1_gets_the_sharded_scaler(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the CPU Accelerate turns an FSDP plugin into DDP, so the FSDP1 case is set directly.
    accelerator = _accelerator()
    monkeypatch.setattr(AcceleratorState(), "distributed_type", DistributedType.FSDP)
    monkeypatch.setattr(Accelerator, "is_fsdp2", property(lambda self: False))
    scaler = install(accelerator, init_scale=256.0)
    assert type(scaler) is AcceleratorShardedGradScaler and scaler.get_scale() == 256.0
    monkeypatch.setattr(Accelerator, "is_fsdp2", property(lambda self: True))
    assert type(install(_accelerator())) is AcceleratorGradScaler


def test_a_second_install_returns_the_scaler_or_refuses_other_settings() -> None:
    accelerator = _accelerator()
    scaler = install(accelerator, init_scale=256.0)
    assert install(accelerator, init_scale=256.0) is scaler
    with pytest.raises(ValueError, match=r"already holds the scaler installed with"):
        install(accelerator, init_scale=512.0)
    assert accelerator.scaler is scaler and scaler.get_scale() == 256.0


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        (torch.nn.Linear(2, 2), TypeError, r"got torch\.nn\.modules\.linear\.Linear"),
        ("fp16", TypeError, r"Accelerator or a transformers\.Trainer .*got builtins\.str"),
    ],
)
def test_a_target_that_is_neither_is_refused(target: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        install(target)


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_an_accelerator_not_in_float16_is_refused_and_unchanged(precision: str) -> None:
    accelerator = _accelerator(mixed_precision=precision)
    before = _snapshot(accelerator)
    with pytest.raises(ValueError, match=rf"mixed_precision is '{precision}', not 'fp16'"):
        install(accelerator)
    assert _snapshot(accelerator) == before


def test_deepspeed_under_accelerate_is_refused_and_points_to_lossscale_deepspeed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    accelerator = _accelerator()
    monkeypatch.setattr(AcceleratorState(), "distributed_type", DistributedType.DEEPSPEED)
    before = _snapshot(accelerator)
    with pytest.raises(ValueError, match=r"runs DeepSpeed.*lossscale\.deepspeed\.install"):
        install(accelerator)
    assert _snapshot(accelerator) == before


def test_after_prepare_of_the_optimizer_it_is_refused_saying_when_to_call_it() -> None:
    accelerator = _accelerator()
    model = _model()
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = _snapshot(accelerator)
    with pytest.raises(ValueError, match=r"prepared its optimizer already.*before trainer\.train"):
        install(accelerator)
    assert _snapshot(accelerator) == before


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"init_scale": -1.0}, ValueError, "init_scale"),
        ({"growth_interval": 1.5}, TypeError, "growth_interval"),
        ({"device": "cuda"}, TypeError, r"device=\.\.\.\): not a setting"),
        ({"enabled": False}, TypeError, r"enabled=\.\.\.\): not a setting"),
    ],
)
def test_bad_settings_are_refused_and_nothing_changes(
    settings: dict[str, Any], error: type, match: str
) -> None:
    accelerator = _accelerator()
    before = _snapshot(accelerator)
    with pytest.raises(error, match=match):
        install(accelerator, **settings)
    assert _snapshot(accelerator) == before
    assert install(accelerator) is accelerator.scaler  # and a good install still works


def test_the_accelerate_version_check() -> None:
    check_accelerate_version("1.15.0")
    with pytest.raises(RuntimeError, match=r"supports Accelerate 1\.0 to below 2\.0.*0\.34\.2"):
        check_accelerate_version("0.34.2")
    with pytest.warns(UserWarning, match=r"not tested with Accelerate 2\.1\.0"):
        check_accelerate_version("2.1.0")
    assert SUPPORTED_ACCELERATE == ("1.0", "2.0")


def test_a_step_without_a_scaled_loss_passes_through_uncounted() -> None:
    """The dummy step of ``torch.distributed.checkpoint``'s optimizer load: zero gradients at
    learning rate 0, never scaled. torch's scaler counts it as a finite iteration (and grows
    here); lossscale's steps the optimizer (its state is created) and counts nothing."""

    def dummy_step(scaler: Any) -> tuple[float, int, list[str]]:
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.Adam([w], lr=0.0)
        scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 1})
        w.grad = torch.zeros(3)
        scaler.step(opt)
        scaler.update()
        return scaler.get_scale(), scaler._get_growth_tracker(), sorted(opt.state[w])

    ours = AcceleratorGradScaler("cpu", init_scale=1024.0, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    theirs.scale(torch.ones(()))  # torch's state is created lazily
    assert dummy_step(ours) == (1024.0, 1, ["exp_avg", "exp_avg_sq", "step"])
    assert dummy_step(theirs)[:2] == (2048.0, 0)
    assert ours.passed_through_steps == 1 and int(ours.skipped_steps) == 0
