"""The ``{}`` state of a disabled GradScaler in every torch front end (issue 18 item 8).

torch's own enabled GradScaler raises RuntimeError for it and a disabled one ignores it; every
lossscale front end raises a ValueError saying where the state came from (never a KeyError) and
changes nothing, and a disabled one ignores it as torch's does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lossscale.torch import GradScaler, LossScaleOptimizer, experimental


def _sgd() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)


def _scale(obj: Any) -> float:
    return obj.get_scale() if isinstance(obj, GradScaler) else float(obj.loss_scale)


ENABLED: dict[str, Callable[[], Any]] = {
    "optimizer": lambda: LossScaleOptimizer(_sgd(), initial_scale=8.0),
    "optimizer_fixed": lambda: LossScaleOptimizer(_sgd(), dynamic=False, initial_scale=8.0),
    "experimental": lambda: experimental.LossScaleOptimizer(_sgd(), "dynamic"),
    "experimental_fixed": lambda: experimental.LossScaleOptimizer(_sgd(), 8),
    "grad_scaler": lambda: GradScaler("cpu", init_scale=8.0),
}


def _empty() -> dict[str, Any]:
    state = torch.amp.GradScaler("cpu", enabled=False).state_dict()
    assert state == {}
    return state


def test_torchs_own_scaler_rejects_it() -> None:
    with pytest.raises(RuntimeError, match="disabled"):
        torch.amp.GradScaler("cpu").load_state_dict(_empty())


@pytest.mark.parametrize("name", list(ENABLED))
def test_every_enabled_front_end_says_it_came_from_a_disabled_scaler(name: str) -> None:
    obj = ENABLED[name]()
    before = _scale(obj)
    with pytest.raises(ValueError, match="saved from a disabled GradScaler"):
        obj.load_state_dict(_empty())
    assert _scale(obj) == before


@pytest.mark.parametrize(
    "make",
    [
        lambda: LossScaleOptimizer(_sgd(), enabled=False),
        lambda: experimental.LossScaleOptimizer(_sgd(), "dynamic", enabled=False),
        lambda: GradScaler("cpu", enabled=False),
    ],
)
def test_a_disabled_front_end_ignores_it_as_torchs_disabled_scaler(make: Any) -> None:
    torch.amp.GradScaler("cpu", enabled=False).load_state_dict(_empty())  # torch: no error
    obj = make()
    obj.load_state_dict(_empty())
    assert _scale(obj) == 1.0
