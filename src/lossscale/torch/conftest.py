"""Fixtures of the torch tests."""

from __future__ import annotations

import pytest

from lossscale.torch import _engine


def force_device_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decide every fused step on the device (:func:`_engine.device_decides`), as a GPU does
    with ``device_side_skip=True``: ``found_inf`` handed to the kernel, the rule on the
    device. Forced so that CPU-only CI runs that path."""
    monkeypatch.setattr(_engine, "device_decides", lambda device, device_side_skip: True)


@pytest.fixture(params=["host", "device"])
def fused_decision(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where a fused optimizer's step is decided (:func:`_engine.device_decides`): ``"host"``,
    the default (the flag read, a skipped step not called), or ``"device"``, a GPU's way with
    ``device_side_skip=True`` (:func:`force_device_decision`)."""
    if request.param == "device":
        force_device_decision(monkeypatch)
    return str(request.param)
