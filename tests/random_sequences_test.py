"""Every front end against its oracle, at the top of float32's range and over random sequences.

Oracles: ``torch.amp.GradScaler`` for lossscale's ``GradScaler`` (its factors, including ones
float32 cannot hold), TensorFlow's ``DynamicLossScale`` for the TensorFlow-named front ends
(the multiplier in float32), and the core rule on NumPy where TensorFlow is absent. The Keras
optimizer's sequences are in ``src/lossscale/keras`` (one backend per process).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from lossscale.core import FLOAT32_MAX

torch = pytest.importorskip("torch")

from lossscale.torch import GradScaler  # noqa: E402

#: scale * 1.1 exceeds the float32 maximum in float64 but rounds to it; likewise * 1.03 in float32
TOP_TORCH = 3.0934759522862973e38
TOP_TF = 3.3037122549124685e38


def _device_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the skip decision on the device, as on a GPU: the rule then runs on tensors."""
    from lossscale.torch import _engine

    monkeypatch.setattr(_engine, "SYNCHRONOUS_DEVICES", frozenset())


def _scaler_scales(scaler: Any, infs: list[bool], fused: bool) -> list[float]:
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0, fused=fused or None)
    out = []
    for bad in infs:
        opt.zero_grad()
        scaler.scale(w.sum()).backward()
        if bad:
            w.grad[0] = float("inf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scaler.step(opt)
        scaler.update()
        out.append(scaler.get_scale())
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["host", "device"])
@pytest.mark.parametrize(
    ("init", "growth", "backoff"),
    [
        (TOP_TORCH, 1.1, 0.5),
        (TOP_TORCH, 1.1, 0.3),
        (TOP_TF, 1.03, 0.5),
        (FLOAT32_MAX / 2, 2.0, 0.5),
    ],
)
def test_gradscaler_growth_at_the_top_of_the_range_is_torchs(
    monkeypatch: pytest.MonkeyPatch, init: float, growth: float, backoff: float, fused: bool
) -> None:
    if fused:
        _device_home(monkeypatch)
    kw = {"init_scale": init, "growth_factor": growth, "backoff_factor": backoff}
    infs = [False, False, True, False, False]
    theirs = _scaler_scales(torch.amp.GradScaler("cpu", growth_interval=1, **kw), infs, fused)
    ours = _scaler_scales(GradScaler("cpu", growth_interval=1, **kw), infs, fused)
    assert ours == theirs
