"""Pickle and deepcopy of the stateful classes: the copy has the same config and state, works
on, and is independent of the original."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from lossscale import DynamicLossScale, FixedLossScale

COPIES: dict[str, Callable[[Any], Any]] = {
    "pickle": lambda x: pickle.loads(pickle.dumps(x)),
    "deepcopy": copy.deepcopy,
}


def _grads(finite: bool, like: str) -> list[Any]:
    g = np.asarray([1.0, 1.0 if finite else np.inf], np.float32)
    if like == "torch":
        torch = pytest.importorskip("torch")
        return [torch.from_numpy(g)]
    return [g]


@pytest.mark.parametrize("like", ["numpy", "torch"])
@pytest.mark.parametrize("how", COPIES)
def test_dynamic_loss_scale_pickles_and_copies_with_its_state(how: str, like: str) -> None:
    ls = DynamicLossScale(64.0, 3, 1.5, hysteresis=2, stall_steps=7)
    for finite in (True, False, True):
        ls.update(_grads(finite, like))
    copied = COPIES[how](ls)
    assert copied.get_config() == ls.get_config() and copied.state_dict() == ls.state_dict()
    for finite in (True, True, False, False):  # both go on alike, independently
        copied.update(_grads(finite, like))
        ls.update(_grads(finite, like))
        assert copied.state_dict() == ls.state_dict()
    copied.update(_grads(False, like))
    assert copied.state_dict() != ls.state_dict()


@pytest.mark.parametrize("how", COPIES)
def test_fixed_loss_scale_pickles_and_copies(how: str) -> None:
    copied = COPIES[how](FixedLossScale(128))
    assert isinstance(copied, FixedLossScale) and float(copied()) == 128.0
