"""GradScaler's scale bit for bit with torch.amp.GradScaler for factors float32 cannot hold.

torch's ``_amp_update_scale_`` rounds the float64 product ``scale * factor`` to float32; the
torch engine evaluates the core rule on a float64 copy of the scale for such factors (0.3, 1.1),
and in float32 for exact ones (2, 0.5, 1.5), where the float32 product is already torch's. Both
homes of the state are covered: the host (an ordinary optimizer) and the device (a fused one).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

from lossscale.core import dynamic_rule
from lossscale.torch import GradScaler, _engine
from lossscale.torch._state import needs_float64

FLOOR = 2.0**-126  # the smallest normal float32: never binds in these runs (checked)


def _scales(
    scaler: object, overflows: list[bool], fused: bool = False, device: str = "cpu"
) -> list[float]:
    w = torch.nn.Parameter(torch.ones(2, device=device))
    opt = torch.optim.SGD([w], lr=0.0, fused=fused or None)
    out = []
    for bad in overflows:
        opt.zero_grad()
        scaler.scale(w.sum()).backward()  # type: ignore[attr-defined]
        if bad:
            w.grad[0] = float("inf")  # type: ignore[index]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's lr-scheduler order hints and the like
            scaler.step(opt)  # type: ignore[attr-defined]
        scaler.update()  # type: ignore[attr-defined]
        out.append(scaler.get_scale())  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["host", "device"])
@pytest.mark.parametrize(
    ("growth", "backoff"), [(1.1, 0.3), (1.7, 0.9), (3.3, 0.123), (2.0, 0.3), (1.1, 0.5)]
)
def test_inexact_factors_follow_torchs_float64_products(
    monkeypatch: pytest.MonkeyPatch, growth: float, backoff: float, fused: bool, device: str
) -> None:
    if fused:  # the device home: the decision stays on the device, as on a GPU
        monkeypatch.setattr(_engine, "device_decides", lambda device, device_side_skip: True)
    rng = np.random.default_rng(7)
    for trial in range(3):
        overflows = list(rng.random(200) < 0.3)
        kw: dict[str, Any] = {
            "init_scale": float(rng.uniform(10, 1e4)),
            "growth_factor": growth,
            "backoff_factor": backoff,
            "growth_interval": int(rng.integers(1, 4)),
        }
        theirs = _scales(torch.amp.GradScaler(device, **kw), overflows, fused, device)
        assert min(theirs) > FLOOR / backoff  # the floor cannot bind
        ours = _scales(GradScaler(device, min_loss_scale=FLOOR, **kw), overflows, fused, device)
        assert ours == theirs, trial


@pytest.mark.parametrize("fused", [False, True], ids=["host", "device"])
def test_float32_arithmetic_would_differ_so_the_test_can_fail(
    monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    """With the float64 evaluation turned off, the trajectories part within 200 steps."""
    if fused:
        monkeypatch.setattr(_engine, "device_decides", lambda device, device_side_skip: True)
    monkeypatch.setattr("lossscale.torch._state.needs_float64", lambda rule: False)
    monkeypatch.setattr("lossscale.torch._state.fused_factors", lambda rule: None)
    overflows = list(np.random.default_rng(0).random(200) < 0.3)
    kw: dict[str, Any] = {"init_scale": 1000.0, "growth_factor": 1.1, "backoff_factor": 0.3}
    kw["growth_interval"] = 2
    theirs = _scales(torch.amp.GradScaler("cpu", **kw), overflows, fused)
    ours = _scales(GradScaler("cpu", min_loss_scale=FLOOR, **kw), overflows, fused)
    assert ours != theirs
    assert max(abs(a - b) / b for a, b in zip(ours, theirs, strict=True)) < 1e-5  # last bits


def test_exact_factors_stay_in_float32() -> None:
    assert not needs_float64(dynamic_rule(2000, 2.0, backoff_factor=0.5))
    assert not needs_float64(dynamic_rule(2000, 1.5, backoff_factor=0.75))
    assert not needs_float64(dynamic_rule(2000, 1.1))  # TF's rule divides: no backoff factor
    assert needs_float64(dynamic_rule(2000, 1.1, backoff_factor=0.5))
    assert needs_float64(dynamic_rule(2000, 2.0, backoff_factor=0.3))
