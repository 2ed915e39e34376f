"""Fixtures of the torch tests."""

from __future__ import annotations

import pytest

from lossscale._testing import torch_devices
from lossscale.torch import _engine

#: The devices a device-parametrized test runs on (:func:`lossscale._testing.torch_devices`).
DEVICES = torch_devices()


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device type a test runs on, ``"cpu"`` or ``"cuda"``: the same assertions on each."""
    return str(request.param)


def force_device_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decide every fused step on the device (:func:`_engine.device_decides`), as a GPU does
    with ``device_side_skip=True``: ``found_inf`` handed to the kernel, the rule on the
    device. Forced so that CPU-only CI runs that path (on CUDA it is what
    ``device_side_skip=True`` does, so the forced path is the real one there)."""
    monkeypatch.setattr(_engine, "device_decides", lambda device, device_side_skip: True)


@pytest.fixture(params=["host", "device"])
def fused_decision(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where a fused optimizer's step is decided (:func:`_engine.device_decides`): ``"host"``,
    the default (the flag read, a skipped step not called), or ``"device"``, a GPU's way with
    ``device_side_skip=True`` (:func:`force_device_decision`)."""
    if request.param == "device":
        force_device_decision(monkeypatch)
    return str(request.param)
