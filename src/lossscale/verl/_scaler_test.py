"""The scaler verl builds after ``import lossscale.verl``: lossscale's engine, torch's type, and
verl's calls in verl's order (scale, backward, unscale_, clip, step, update), side by side with
the torch scaler verl 0.9 hard-codes."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

import lossscale.torch
import lossscale.verl as lv
from lossscale.verl import _testing
from lossscale.verl._scaler import scaler_factory


def test_it_is_lossscale_s_scaler_and_an_instance_of_torch_s() -> None:
    scaler = lv.ShardedGradScaler("cpu", growth_interval=400)
    assert isinstance(scaler, TorchSharded)  # verl's own test checks this
    assert isinstance(scaler, lossscale.torch.ShardedGradScaler)
    assert isinstance(scaler, torch.amp.GradScaler)
    # every method is lossscale's: torch's class is a base for isinstance only
    for name in ("scale", "unscale_", "step", "update", "state_dict", "load_state_dict"):
        assert getattr(type(scaler), name) is getattr(lossscale.torch.ShardedGradScaler, name)
    # torch's private helpers, which work on torch's own state, are not inherited
    for name in ("_unscale_grads_", "_maybe_opt_step", "_amp_update_scale_cpu_"):
        assert not hasattr(scaler, name)
    assert not hasattr(lossscale.torch.ShardedGradScaler("cpu"), "_unscale_grads_")
    assert scaler.get_growth_interval() == 400 and scaler.get_scale() == 2.0**16


def _verl_order(scaler: torch.amp.GradScaler, model: torch.nn.Linear, overflow: bool) -> bool:
    """verl's FSDPEngine calls: ``scaler.scale(loss).backward()`` (forward_backward_batch),
    then ``unscale_``, the clip, ``step``, ``update`` (optimizer_step). Returns whether the
    weights changed."""
    optimizer = model._test_optimizer  # type: ignore[attr-defined]
    before = model.weight.detach().clone()
    optimizer.zero_grad()
    loss = model(torch.ones(2, 4)).float().pow(2).mean()
    if overflow:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
    return not torch.equal(before, model.weight)


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model._test_optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)  # type: ignore[assignment]
    return model


def test_verl_s_call_order_gives_torch_s_trajectory() -> None:
    """The same run with verl's hard-coded scaler (torch's, on the CPU) and with the one
    lossscale.verl gives verl: the same weights, the same scale, the same skipped step."""
    ours, theirs = _model(), _model()
    ours_scaler = lv.ShardedGradScaler("cpu", growth_interval=2)
    theirs_scaler = TorchSharded("cpu", growth_interval=2)
    with _testing.process_group():  # both agree over the default group in unscale_
        for step, overflow in enumerate([False, True, False, False, False]):
            changed = _verl_order(ours_scaler, ours, overflow)
            assert changed == _verl_order(theirs_scaler, theirs, overflow) == (not overflow)
            assert torch.equal(ours.weight, theirs.weight), step
            assert ours_scaler.get_scale() == theirs_scaler.get_scale()
    assert ours_scaler.get_scale() == 2.0**16  # halved by the overflow, doubled twice since
    assert int(ours_scaler.skipped_steps) == 1


def test_the_factory_keeps_verl_s_arguments_and_puts_the_environment_over_them() -> None:
    build = scaler_factory(lv.settings({}), "cpu")
    scaler = build(growth_interval=400)  # verl 0.9's call
    assert isinstance(scaler, lv.ShardedGradScaler)
    assert (scaler.get_growth_interval(), scaler.get_scale(), scaler.is_enabled()) == (
        400,
        2.0**16,
        True,
    )
    env = {"LOSSSCALE_INIT_SCALE": "1024", "LOSSSCALE_GROWTH_INTERVAL": "100"}
    scaler = scaler_factory(lv.settings(env), "cpu")(growth_interval=400)
    assert (scaler.get_growth_interval(), scaler.get_scale()) == (100, 1024.0)
    # torch's positional order; a device verl names is kept
    scaler = scaler_factory(lv.settings({}), "cuda")("cpu", 8.0, 0.25, 4.0, 7)
    assert (scaler.get_scale(), scaler.get_backoff_factor(), scaler.get_growth_factor()) == (
        8.0,
        0.25,
        4.0,
    )
    assert scaler.get_growth_interval() == 7 and scaler.is_enabled()
    with pytest.raises(TypeError):
        build(growth_intervall=400)


def test_a_setting_the_scaler_refuses_names_its_variable_when_verl_builds_it() -> None:
    settings = lossscale.verl._settings.Settings({"init_scale": 8.0, "max_loss_scale": 4.0}, None)
    with pytest.raises(ValueError, match=r"^LOSSSCALE_INIT_SCALE=8\.0, LOSSSCALE_MAX_LOSS_SCALE="):
        scaler_factory(settings, "cpu")(growth_interval=400)
    # an argument of verl's own that the scaler refuses: its error, unchanged
    with pytest.raises(ValueError, match=r"^growth_interval must be"):
        scaler_factory(lv.settings({}), "cpu")(growth_interval=0)
