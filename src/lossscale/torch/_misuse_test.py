"""Misuse of the torch front ends that once ended in someone else's error or in silence: each
now raises a TypeError/ValueError naming the cause, or keeps what it loads, and leaves the
object unchanged when it raises."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lossscale.torch import GradScaler, LossScaleOptimizer, ShardedGradScaler


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(2))]


def _lso() -> LossScaleOptimizer:
    return LossScaleOptimizer(torch.optim.Adam(_params(), lr=0.1), initial_scale=64.0)


def _skipped_once(opt: LossScaleOptimizer) -> LossScaleOptimizer:
    param = opt.param_groups[0]["params"][0]
    opt.get_scaled_loss(param.sum()).backward()
    param.grad[0] = float("inf")  # type: ignore[index]
    opt.step()
    return opt


# -- LossScaleOptimizer.load_state_dict without an optimizer state -----------------------------
@pytest.mark.parametrize("keys", [("loss_scale",), ("loss_scale", "skipped_steps"), ("state",)])
def test_a_state_without_param_groups_is_a_value_error_naming_the_key(keys: tuple[str]) -> None:
    opt = _lso()
    before = opt.state_dict()
    state = {key: before[key] for key in keys}
    with pytest.raises(ValueError, match=r"'param_groups'") as err:
        opt.load_state_dict(state)
    assert "torch.optim" in str(err.value)  # says what a full state holds
    assert opt.state_dict() == before


def test_a_partial_grad_scaler_state_names_the_missing_key() -> None:
    opt = _lso()
    before = opt.state_dict()
    theirs = torch.amp.GradScaler("cpu", init_scale=16.0)
    theirs.scale(torch.ones(()))  # torch's state is lazy
    partial = theirs.state_dict()
    del partial["growth_interval"]
    with pytest.raises(ValueError, match="GradScaler state is missing key 'growth_interval'"):
        opt.load_state_dict(partial)
    assert opt.state_dict() == before


# -- a process group this rank is not in ----------------------------------------------------------
@pytest.mark.parametrize("front_end", ["optimizer", "scaler", "sharded"])
def test_a_process_group_without_this_rank_is_a_value_error(front_end: str) -> None:
    """``dist.new_group(ranks)`` returns ``GroupMember.NON_GROUP_MEMBER`` (-100) on the ranks it
    leaves out; passing that is a ValueError that says so, not "got -100"."""
    not_member = torch.distributed.GroupMember.NON_GROUP_MEMBER
    with pytest.raises(ValueError, match="this rank is not a member") as err:
        if front_end == "optimizer":
            LossScaleOptimizer(torch.optim.SGD(_params(), lr=0.1), process_group=not_member)
        elif front_end == "scaler":
            GradScaler("cpu", process_group=not_member)
        else:
            ShardedGradScaler("cpu", process_group=not_member)
    assert "new_group" in str(err.value)


# -- the two constructors' argument orders --------------------------------------------------------
def test_sharded_grad_scaler_given_grad_scalers_order_names_the_order() -> None:
    # GradScaler's order: init_scale, growth_factor, backoff_factor
    with pytest.raises(ValueError, match=r"backoff_factor before growth_factor") as err:
        ShardedGradScaler("cpu", 2.0**16, 2.0, 0.5)
    assert "ShardedGradScaler(device, init_scale, backoff_factor, growth_factor" in str(err.value)
    assert "pass them by keyword" in str(err.value)
    scaler = ShardedGradScaler("cpu", 2.0**16, 0.5, 2.0)  # torch's order
    assert (scaler.get_backoff_factor(), scaler.get_growth_factor()) == (0.5, 2.0)


def test_grad_scaler_given_sharded_grad_scalers_order_names_the_order() -> None:
    with pytest.raises(ValueError, match=r"growth_factor before backoff_factor") as err:
        GradScaler("cpu", 2.0**16, 0.5, 2.0)
    assert "GradScaler(device, init_scale, growth_factor, backoff_factor" in str(err.value)


def test_other_bad_factors_keep_their_plain_message() -> None:
    with pytest.raises(ValueError, match=r"^growth_factor must be finite and > 1, got 1\.0$"):
        ShardedGradScaler("cpu", 2.0**16, 0.5, 1.0)


# -- checkpoints across the front ends keep the skipped-step count --------------------------------
@pytest.mark.parametrize("cls", [GradScaler, ShardedGradScaler])
def test_a_loss_scale_optimizer_state_keeps_its_skipped_steps_in_a_scaler(cls: Any) -> None:
    state = _skipped_once(_lso()).state_dict()
    assert state["skipped_steps"] == 1
    scaler = cls("cpu")
    scaler.load_state_dict(state)
    assert int(scaler.skipped_steps) == 1
    assert scaler.get_scale() == 32.0
    bad = {**state, "skipped_steps": -1}
    with pytest.raises(ValueError, match=r"state_dict\['skipped_steps'\] must be an int >= 0"):
        cls("cpu").load_state_dict(bad)


def test_a_scaler_state_keeps_its_counters_in_a_loss_scale_optimizer() -> None:
    scaler = GradScaler("cpu", init_scale=64.0, hysteresis=2)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(3):  # three overflows with hysteresis 2: back off, then count one
        w.grad = torch.tensor([float("inf"), 1.0])
        scaler.step(opt)
        scaler.update()
    state = scaler.state_dict()
    assert state["lossscale"]["skipped_steps"] == 3
    lso = LossScaleOptimizer(torch.optim.SGD(_params(), lr=0.1), hysteresis=2)
    lso.load_state_dict(state)
    assert lso.state_dict()["skipped_steps"] == 3
    assert lso.state_dict()["loss_scale"]["num_nonfinite_steps"] == 1
    assert float(lso.loss_scale) == scaler.get_scale()


# -- one way to keep an LR schedule on applied steps, on every torch front end ---------------------
@pytest.mark.parametrize("front_end", ["GradScaler", "ShardedGradScaler", "LossScaleOptimizer"])
def test_step_scheduler_on_every_front_end(front_end: str) -> None:
    """``step_scheduler(scheduler)`` after the iteration: steps it only after applied steps."""
    w = torch.nn.Parameter(torch.ones(2))
    inner = torch.optim.SGD([w], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    lso = LossScaleOptimizer(inner) if front_end == "LossScaleOptimizer" else None
    scaler = (
        None
        if lso
        else {"GradScaler": GradScaler, "ShardedGradScaler": ShardedGradScaler}[front_end]("cpu")
    )
    stepped = []
    for bad in (False, True, False):
        if lso is not None:
            lso.get_scaled_loss(w.sum()).backward()
        else:
            scaler.scale(w.sum()).backward()
        if bad:
            w.grad[0] = float("nan")  # type: ignore[index]
        if lso is not None:
            lso.step()
            stepped.append((lso.step_scheduler(sched), sched.last_epoch))
            lso.zero_grad()
        else:
            scaler.step(inner)
            scaler.update()
            stepped.append((scaler.step_scheduler(sched), sched.last_epoch))
            inner.zero_grad()
    assert stepped == [(True, 1), (False, 1), (True, 2)]
    disabled = GradScaler("cpu", enabled=False)
    assert disabled.step_scheduler(sched) is True and sched.last_epoch == 3
