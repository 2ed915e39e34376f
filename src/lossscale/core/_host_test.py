"""The host-side scale step (:mod:`lossscale.core._host`): the rule and the stall count in one
place, and the three wings that decide steps on the host built on it."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import numpy as np
import pytest

from lossscale.core import (
    LossScaleStalledError,
    LossScaleStalledWarning,
    dynamic_rule,
    dynamic_state,
    dynamic_update,
    stall_alarm,
    stall_update,
)
from lossscale.core._host import check_host_stall, fresh_host_state, host_state, host_step

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("refill", ["on_backoff", "on_growth", "on_finite_step"])
def test_host_step_is_the_rule_and_the_stall_count(refill: str) -> None:
    rule = dynamic_rule(3, hysteresis=2, min_loss_scale=2.0, hysteresis_refill=refill)
    rng = np.random.default_rng(0)
    state, reference, stalled, count = fresh_host_state(16.0, rule), dynamic_state(16.0, rule), 0, 0
    for finite in rng.random(300) < 0.4:
        step = host_step(state, bool(finite), rule, stalled)
        flag = np.asarray(bool(finite))
        count = int(stall_update(np.asarray(count), flag, reference.loss_scale, rule))
        reference = dynamic_update(reference, flag, rule)
        state, stalled = step
        assert [float(x) for x in state] == [float(x) for x in reference]
        assert stalled == count


def test_host_step_without_the_alarm_keeps_the_count() -> None:
    rule = dynamic_rule(min_loss_scale=4.0)
    step = host_step(host_state(4.0), False, rule, 7, count_stall=False)
    assert step.stalled == 7 and float(step.state.loss_scale) == 4.0


def test_check_host_stall_warns_once_and_rearms() -> None:
    alarm = stall_alarm(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warned = check_host_stall(1, 1.0, alarm, warned=False, where="w")
        assert not warned
        warned = check_host_stall(2, 1.0, alarm, warned=warned, where="w")
        warned = check_host_stall(3, 1.0, alarm, warned=warned, where="w")
        assert warned and len(caught) == 1
        assert caught[0].category is LossScaleStalledWarning
        assert not check_host_stall(0, 1.0, alarm, warned=warned, where="w")  # re-armed
    assert not check_host_stall(10**6, 1.0, None, warned=False, where="w")
    assert not check_host_stall(10**6, 1.0, stall_alarm(None), warned=False, where="w")
    with pytest.raises(LossScaleStalledError, match="w: the last 2 steps"):
        check_host_stall(2, 1.0, stall_alarm(2, "raise"), warned=False, where="w")


@pytest.mark.parametrize("path", ["torch/_state.py", "deepspeed/_scaler.py", "megatron/_scaler.py"])
def test_the_host_wings_step_through_the_helper(path: str) -> None:
    """Each wing that decides a step on the host calls ``host_step`` and ``check_host_stall``
    and writes no step of its own (no call of the rule, the stall count or the report)."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    called = {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert {"host_step", "check_host_stall"} <= called
    assert not called & {"stall_update", "report_stall"}
    if path != "torch/_state.py":  # torch evaluates the rule on tensors in its device home
        assert "dynamic_update" not in called
