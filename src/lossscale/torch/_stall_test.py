"""The stall alarm of ``LossScaleOptimizer`` (issue 19 item 1; GradScaler's is in _scaler_test)."""

from __future__ import annotations

import linecache
import warnings

import pytest
import torch

from lossscale.core import LossScaleStalledError, LossScaleStalledWarning
from lossscale.torch import LossScaleOptimizer, experimental

# fused optimizers: both the CPU's host decision and a GPU's device decision (conftest)
pytestmark = pytest.mark.usefixtures("fused_decision")

INF = float("inf")


def _run(lso: LossScaleOptimizer, overflow: list[bool]) -> list[str]:
    w = lso.param_groups[0]["params"][0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for bad in overflow:
            lso.get_scaled_loss(w.sum()).backward()
            if bad:
                w.grad = torch.full_like(w, INF)
            lso.step()
            lso.zero_grad()
    return [str(w.message) for w in caught if w.category is LossScaleStalledWarning]


def _lso(fused: bool = False, **kwargs: object) -> LossScaleOptimizer:
    w = torch.nn.Parameter(torch.ones(2))
    return LossScaleOptimizer(torch.optim.Adam([w], lr=1e-3, fused=fused), **kwargs)  # type: ignore[arg-type]


def test_warns_once_at_the_floor_with_the_step_sync() -> None:
    lso = _lso(initial_scale=4.0, stall_steps=5)
    messages = _run(lso, [True] * 30)
    assert len(messages) == 1
    assert "LossScaleOptimizer" in messages[0] and "last 5 steps" in messages[0]
    assert "minimum (1.0)" in messages[0]


def test_default_fires_within_a_thousand_skipped_steps_at_the_floor() -> None:
    assert len(_run(_lso(initial_scale=1.0), [True] * 1000)) == 1
    assert _run(_lso(initial_scale=1.0), [True] * 999) == []


def test_healthy_run_with_rare_overflows_stays_silent() -> None:
    pattern = [i % 50 == 7 for i in range(2000)]
    assert _run(_lso(initial_scale=2.0**10, dynamic_growth_steps=20), pattern) == []


def test_raise_and_off() -> None:
    with pytest.raises(LossScaleStalledError, match="last 3 steps"):
        _run(_lso(initial_scale=1.0, stall_steps=3, on_stall="raise"), [True] * 5)
    assert _run(_lso(initial_scale=1.0, stall_steps=None), [True] * 1500) == []
    with pytest.raises(ValueError, match="on_stall"):
        _lso(on_stall="loud")


def test_fused_steps_are_checked_where_the_state_is_read(fused_decision: str) -> None:
    lso = _lso(fused=True, initial_scale=1.0, stall_steps=3)
    if fused_decision == "host":  # the CPU's step reads the flag: checked there, as unfused
        assert len(_run(lso, [True] * 10)) == 1
        return
    assert _run(lso, [True] * 10) == []  # no sync in a fused step: nothing read yet
    with pytest.warns(LossScaleStalledWarning, match="last 10 steps"):
        assert lso.dynamic_counter == 0


def test_experimental_form_and_config_carry_the_alarm() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    exp = experimental.LossScaleOptimizer(
        torch.optim.SGD([w], lr=0.1), "dynamic", stall_steps=7, on_stall="raise"
    )
    config = exp.get_config()
    assert (config["stall_steps"], config["on_stall"]) == (7, "raise")
    again = LossScaleOptimizer.from_config(config, [torch.nn.Parameter(torch.ones(2))])
    assert again.get_config() == config
    assert "stall_steps" not in _lso().get_config()


def test_the_warning_names_the_callers_line(fused_decision: str) -> None:
    """Every path that reports a stall points the warning at the user's call: the step (plain
    or with a closure; fused on the CPU), GradScaler's update and get_scale, dynamic_counter
    and state_dict after fused steps on the device."""
    from lossscale.torch import GradScaler

    def where(fn: object) -> list[str]:
        """The line of this file each stall warning names (or the other file it names)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()  # type: ignore[operator]
        return [
            linecache.getline(w.filename, w.lineno).strip()
            if w.filename == __file__
            else w.filename
            for w in caught
            if w.category is LossScaleStalledWarning
        ]

    def at(lines: list[str], call: str) -> bool:
        """One warning, naming a line of this file with ``call`` on it (for a lambda, whose
        line is the assertion's own)."""
        return len(lines) == 1 and call in lines[0]

    def overflow(w: torch.nn.Parameter) -> None:
        w.grad = torch.full_like(w, INF)

    plain = _lso(initial_scale=1.0, stall_steps=2)
    w = plain.param_groups[0]["params"][0]

    def lso_steps(lso: LossScaleOptimizer = plain) -> None:
        w = lso.param_groups[0]["params"][0]
        for _ in range(3):
            lso.get_scaled_loss(w.sum()).backward()
            overflow(w)
            lso.step()

    def closure() -> torch.Tensor:
        loss = plain.get_scaled_loss(w.sum())
        loss.backward()
        overflow(w)
        return loss

    fused = _lso(fused=True, initial_scale=1.0, stall_steps=2)
    fused_again = _lso(fused=True, initial_scale=1.0, stall_steps=2)
    p = torch.nn.Parameter(torch.ones(2))
    opts = {"sgd": torch.optim.SGD([p], lr=0.1), "fused": torch.optim.Adam([p], fused=True)}
    scalers = {k: GradScaler("cpu", init_scale=1.0, stall_steps=2) for k in opts}

    def scaler_steps(kind: str) -> None:
        for _ in range(3):
            scalers[kind].scale(p.sum()).backward()
            overflow(p)
            scalers[kind].step(opts[kind])
            scalers[kind].update()

    assert where(lso_steps) == ["lso.step()"]
    plain._ls.stall_warned = False  # type: ignore[union-attr]
    assert at(where(lambda: plain.step(closure)), "plain.step(closure)")
    assert where(lambda: scaler_steps("sgd")) == ["scalers[kind].update()"]
    if fused_decision == "host":  # the CPU: fused steps read the flag and report as unfused
        assert where(lambda: lso_steps(fused)) == ["lso.step()"]
        assert where(lambda: scaler_steps("fused")) == ["scalers[kind].update()"]
        return
    assert where(lambda: lso_steps(fused)) == []  # fused steps on the device: nothing read yet
    assert where(lambda: lso_steps(fused_again)) == []
    assert at(where(lambda: fused.dynamic_counter), "fused.dynamic_counter")
    in_where = ["fn()  # type: ignore[operator]"]  # the line of where() that calls them
    assert where(fused_again.state_dict) == in_where
    assert where(lambda: scaler_steps("fused")) == []
    assert where(scalers["fused"].get_scale) == in_where
    scalers["fused"]._ls.stall_warned = False  # type: ignore[union-attr]
    assert where(scalers["fused"].state_dict) == in_where
