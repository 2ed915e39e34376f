"""Trained float16 parameters (``model.half()`` fine-tuning, PEFT adapters kept in float16):
torch's GradScaler refuses them ("Attempting to unscale FP16 gradients"); lossscale's scalers
train on and warn once per optimizer (:class:`Float16ParametersWarning`), naming them."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lossscale.torch import Float16ParametersWarning, GradScaler, LossScaleOptimizer


def _half_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).half()


def _scaler_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    scaler = GradScaler("cpu", init_scale=2.0**4)
    x = torch.randn(4, 8).half()
    for _ in range(steps):
        scaler.scale(model(x).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def _optimizer_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    wrapped = LossScaleOptimizer(opt, initial_scale=2.0**4)
    x = torch.randn(4, 8).half()
    for _ in range(steps):
        wrapped.get_scaled_loss(model(x).float().pow(2).mean()).backward()
        wrapped.step()
        wrapped.zero_grad()


@pytest.mark.parametrize("run", [_scaler_steps, _optimizer_steps])
def test_float16_parameters_train_with_one_warning_naming_them(run: Callable[..., None]) -> None:
    model = _half_model()
    before = [p.clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.warns(Float16ParametersWarning) as caught:
        run(model, opt)
    ours = [w for w in caught if w.category is Float16ParametersWarning]
    assert len(ours) == 1  # once, over three steps
    message = str(ours[0].message)
    assert "4 trained parameters are float16" in message
    assert "param_groups[0]['params'][0]" in message and "float32" in message
    assert ours[0].filename == __file__  # the user's line
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(
        s.dtype == torch.float16
        for s in opt.state[next(model.parameters())].values()
        if s.dim() > 0
    )


def test_torchs_scaler_refuses_what_lossscale_trains_with_a_warning() -> None:
    model = _half_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8).half()).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(opt)


def test_named_parameters_are_named_and_frozen_ones_are_not_counted() -> None:
    model = _half_model()
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.named_parameters() if p[1].requires_grad])
    with pytest.warns(Float16ParametersWarning, match=r"2 trained parameters .*'1\.weight'"):
        _scaler_steps(model, opt, steps=1)


def test_float32_parameters_under_autocast_do_not_warn() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters())
    scaler = GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def _lora_on_half(**kwargs: Any) -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from lossscale.torch._audit import _testing as models

    base = models.llama().half()
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, config, **kwargs)


def _peft_step(model: torch.nn.Module) -> None:
    from lossscale.torch._audit import _testing as models

    opt = torch.optim.AdamW([p for p in model.named_parameters() if p[1].requires_grad])
    scaler = GradScaler("cpu", init_scale=2.0**4)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = models.token_sum_loss(model, models.batches(1)[0])
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_peft_adapters_kept_in_float16_warn_and_float32_ones_do_not() -> None:
    float16 = _lora_on_half(autocast_adapter_dtype=False)
    with pytest.warns(Float16ParametersWarning, match=r"8 trained parameters .*lora_A"):
        _peft_step(float16)
    float32 = _lora_on_half()  # PEFT's default: adapters in float32 on a float16 base
    with warnings.catch_warnings():
        warnings.simplefilter("error", Float16ParametersWarning)
        _peft_step(float32)
