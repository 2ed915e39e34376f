"""``set_cuda_arch_list``: ``TORCH_CUDA_ARCH_LIST`` from the visible devices when unset, the
user's value kept where DeepSpeed parses it and its ``9.0a`` entries rewritten where not,
nothing without CUDA; and DeepSpeed's own JIT op builder (``FusedAdam``'s)
parsing what it sets, where torch's Hopper entry ``9.0a`` fails (DeepSpeed #7589). The devices
are torch's answers patched to an H100 and to a mixed pair on a machine without one."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("deepspeed")

from lossscale.deepspeed import set_cuda_arch_list


@pytest.fixture(autouse=True)
def unset(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``TORCH_CUDA_ARCH_LIST`` unset for each test (and put back after)."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    yield


def _devices(monkeypatch: pytest.MonkeyPatch, capabilities: list[tuple[int, int]]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(capabilities))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capabilities[i])


def _deepspeed_builds_for(value: str) -> str:
    """What DeepSpeed's FusedAdam builder makes of ``value`` in JIT mode (its canonical list),
    or raises as it does."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = value
    try:
        builder.compute_capability_args()
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


def test_torchs_hopper_entry_fails_in_deepspeeds_builder() -> None:
    with pytest.raises(ValueError, match="0a"):
        _deepspeed_builds_for("9.0a")


def test_on_a_hopper_device_it_sets_what_deepspeed_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    _devices(monkeypatch, [(9, 0)])
    assert set_cuda_arch_list() == "9.0"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert _deepspeed_builds_for("9.0") == "9.0+PTX"


def test_several_devices_each_once_ascending(monkeypatch: pytest.MonkeyPatch) -> None:
    _devices(monkeypatch, [(9, 0), (8, 0), (9, 0)])
    assert set_cuda_arch_list() == "8.0;9.0"
    assert _deepspeed_builds_for("8.0;9.0") == "8.0;9.0+PTX"


def test_the_users_value_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    _devices(monkeypatch, [(9, 0)])
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0+PTX")
    assert set_cuda_arch_list() == "8.0 9.0+PTX"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0 9.0+PTX"


def test_an_arch_specific_entry_is_rewritten_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _devices(monkeypatch, [(9, 0)])
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a 9.0 10.0a+PTX")
    with pytest.warns(UserWarning, match=r"'8\.0 9\.0a 9\.0 10\.0a\+PTX'.*#7589"):
        assert set_cuda_arch_list() == "8.0;9.0;10.0+PTX"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"
    assert _deepspeed_builds_for("8.0;9.0;10.0+PTX") == "8.0;9.0;10.0+PTX"


def test_without_cuda_nothing_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    _devices(monkeypatch, [])
    assert set_cuda_arch_list() is None
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ
