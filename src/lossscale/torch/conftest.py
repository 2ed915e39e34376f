"""Fixtures of the torch tests."""

from __future__ import annotations

import pytest

from lossscale.torch import _engine


@pytest.fixture(params=["host", "device"])
def fused_decision(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where a fused optimizer's step is decided (:func:`_engine.decided_on_host`): ``"host"``,
    the CPU's way (the flag read, a skipped step not called), or ``"device"``, a GPU's way
    (``found_inf`` handed to the kernel, the rule on the device), forced here so that CPU-only
    CI runs both."""
    if request.param == "device":
        monkeypatch.setattr(_engine, "SYNCHRONOUS_DEVICES", frozenset())
    return str(request.param)
