"""torch's scaler surface that code in the wild reads: ``ShardedGradScaler``'s constructor,
the private members of ``torch.amp.GradScaler``, torch's error for a step without gradients,
and which fused steps a framework can see skipped (``device_side_skip``)."""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest
import torch
from torch.amp.grad_scaler import OptState
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

from lossscale.torch import GradScaler, LossScaleOptimizer, ShardedGradScaler, _engine

FRONT_ENDS = [GradScaler, ShardedGradScaler]


def test_sharded_constructor_is_torchs_then_keyword_only_extensions() -> None:
    want = list(inspect.signature(TorchSharded).parameters.values())
    have = list(inspect.signature(ShardedGradScaler).parameters.values())
    assert [(p.name, p.kind, p.default) for p in have[: len(want)]] == [
        (p.name, p.kind, p.default) for p in want
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in have[len(want) :])
    # positional order: backoff before growth, as torch's
    s = ShardedGradScaler("cpu", 256.0, 0.25, 4.0, 7)
    assert (s.get_backoff_factor(), s.get_growth_factor(), s.get_growth_interval()) == (
        0.25,
        4.0,
        7,
    )


def _one_step(scaler: Any, opt: torch.optim.Optimizer, w: torch.Tensor, bad: bool) -> Any:
    opt.zero_grad()
    scaler.scale((w.float() ** 2).sum()).backward()
    if bad:
        w.grad[0] = math.inf
    scaler.unscale_(opt)
    return scaler


@pytest.mark.parametrize("cls", FRONT_ENDS)
def test_private_surface_reads_as_torchs(cls: Any) -> None:
    runs = []
    for make in (lambda: torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2), None):
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([w], lr=0.1)
        scaler = make() if make else cls("cpu", init_scale=8.0, growth_interval=2)
        seen = []
        for bad in (False, True, False, False):
            _one_step(scaler, opt, w, bad)
            state = scaler._per_optimizer_states[id(opt)]
            assert state["stage"] == OptState.UNSCALED
            flags = scaler._found_inf_per_device(opt)
            assert flags is state["found_inf_per_device"]
            seen.append(sum(float(f) for f in flags.values()))
            scaler.step(opt)
            assert scaler._per_optimizer_states[id(opt)]["stage"] == OptState.STEPPED
            scaler.update()
            assert scaler._per_optimizer_states[id(opt)]["stage"] == OptState.READY
            seen.append((float(scaler._scale), int(scaler._growth_tracker)))
            assert scaler._get_scale_async() is scaler._scale
            assert scaler._scale.dtype == torch.float32 and scaler._scale.dim() == 0
            assert scaler._growth_tracker.dtype == torch.int32
        assert scaler._enabled is True and scaler._device == "cpu"
        runs.append((seen, w.tolist()))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("cls", FRONT_ENDS)
def test_a_max_all_reduce_of_found_inf_per_device_decides_the_step(cls: Any) -> None:
    """The idiom's in-place write to the flags (here: what a MAX all-reduce with an
    overflowing rank leaves) decides ``step`` and ``update``."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = cls("cpu", init_scale=8.0)
    _one_step(scaler, opt, w, bad=False)
    for flag in scaler._found_inf_per_device(opt).values():
        torch.maximum(flag, torch.ones(()), out=flag)  # another rank overflowed
    assert scaler.step(opt) is None
    scaler.update()
    assert w.tolist() == [1.0, 1.0, 1.0]
    assert scaler.get_scale() == 4.0 and not bool(scaler.last_step_applied)


@pytest.mark.parametrize("cls", FRONT_ENDS)
def test_check_inf_per_device_checks_without_unscaling(cls: Any) -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = cls("cpu", init_scale=8.0)
    w.grad = torch.tensor([8.0, math.nan])
    flags = scaler._check_inf_per_device(opt)
    assert [float(f) for f in flags.values()] == [1.0]
    assert w.grad[0].item() == 8.0  # not unscaled
    assert scaler._per_optimizer_states[id(opt)]["stage"] == OptState.READY


def test_step_without_gradients_raises_as_torch_does() -> None:
    """GradScaler, as torch's; ShardedGradScaler takes such a step as finite, as torch's (a
    rank holding no shard: ``_sharded_test.py`` runs it on 2 ranks beside torch's)."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    theirs = torch.amp.GradScaler("cpu")
    theirs.scale(torch.ones(()))  # torch's state is lazy
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        theirs.step(opt)
    scaler = GradScaler("cpu")
    scale = scaler.get_scale()
    with pytest.raises(RuntimeError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)
    assert scaler.get_scale() == scale and w.tolist() == [1.0, 1.0]
    assert scaler._per_optimizer_states[id(opt)]["stage"] == OptState.READY
    sharded = ShardedGradScaler("cpu", 4.0, growth_interval=1)
    sharded.step(opt)  # nothing to apply
    assert sharded._per_optimizer_states[id(opt)]["stage"] == OptState.STEPPED
    sharded.update()
    assert sharded.get_scale() == 8.0 and w.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("cls", FRONT_ENDS)
def test_sharded_takes_float16_gradients(cls: Any) -> None:
    """FSDP1 with float16 parameters: float16 gradients are unscaled (torch's GradScaler
    raises 'Attempting to unscale FP16 gradients'; its ShardedGradScaler accepts them)."""
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=0.5)
    scaler = cls("cpu", init_scale=1024.0)
    w.grad = torch.full((4,), 2048.0, dtype=torch.float16)
    scaler.step(opt)
    scaler.update()
    assert w.tolist() == [0.0] * 4


def _skipped_calls(monkeypatch: pytest.MonkeyPatch, make: Any) -> tuple[int, float]:
    """A simulated GPU (reading the flag would wait for the device): how many times a fused
    AdamW's ``step`` was called in two iterations, the second overflowing."""
    monkeypatch.setattr(_engine, "SYNCHRONOUS_DEVICES", frozenset())
    w = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.AdamW([w], lr=0.1, fused=True)
    calls = []
    inner.register_step_pre_hook(lambda *a: calls.append(1))
    front = make(inner)
    for bad in (False, True):
        inner.zero_grad()
        if isinstance(front, LossScaleOptimizer):
            front.get_scaled_loss((w**2).sum()).backward()
            if bad:
                w.grad[0] = math.inf
            front.step()
            scale = float(front.loss_scale)
        else:
            front.scale((w**2).sum()).backward()
            if bad:
                w.grad[0] = math.inf
            front.step(inner)
            front.update()
            scale = front.get_scale()
    return len(calls), scale


@pytest.mark.parametrize("front", ["scaler", "optimizer"])
def test_fused_skips_are_visible_by_default_and_on_the_device_when_asked(
    monkeypatch: pytest.MonkeyPatch, front: str
) -> None:
    def make(device_side_skip: bool) -> Any:
        if front == "scaler":
            return lambda inner: GradScaler(
                "cpu", init_scale=8.0, device_side_skip=device_side_skip
            )
        return lambda inner: LossScaleOptimizer(
            inner, initial_scale=8.0, device_side_skip=device_side_skip
        )

    assert _skipped_calls(monkeypatch, make(False)) == (1, 4.0)  # the skip: not called
    assert _skipped_calls(monkeypatch, make(True)) == (2, 4.0)  # the kernel skips


@pytest.mark.parametrize("cls", [*FRONT_ENDS, LossScaleOptimizer])
def test_device_side_skip_must_be_a_bool(cls: Any) -> None:
    with pytest.raises(TypeError, match="device_side_skip"):
        if cls is LossScaleOptimizer:
            cls(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), device_side_skip=1)
        else:
            cls("cpu", device_side_skip="yes")


class _ThirdPartyFused(torch.optim.SGD):
    """An optimizer of its own that declares torch's fused protocol (as apex's do): it reads
    ``grad_scale`` and ``found_inf`` and returns a value of its own."""

    _step_supports_amp_scaling = True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        found = getattr(self, "found_inf", None)
        scale = getattr(self, "grad_scale", None)
        self.seen = (
            None if found is None else float(found),
            None if scale is None else float(scale),
        )
        if not self.seen[0]:
            with torch.no_grad():
                for p in self.param_groups[0]["params"]:
                    p.add_(p.grad / (scale if scale is not None else 1.0), alpha=-0.5)
        return "mine"


@pytest.mark.parametrize("make", [torch.amp.GradScaler, GradScaler], ids=["torch", "lossscale"])
def test_a_third_party_fused_optimizer_gets_torchs_protocol_on_the_cpu(make: Any) -> None:
    """Called on every step with ``grad_scale`` and ``found_inf``, its return value returned,
    as under torch's GradScaler (on the CPU too, where torch's own fused classes are stepped as
    ordinary ones)."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = _ThirdPartyFused([w], lr=0.5)
    scaler = make("cpu", init_scale=4.0)
    seen = []
    for bad in (False, True):
        scaler.scale((w**2).sum()).backward()
        if bad:
            w.grad[0] = math.inf
        seen.append(scaler.step(opt))
        seen.append(opt.seen)
        scaler.update()
        opt.zero_grad()
    assert seen == ["mine", (0.0, 4.0), "mine", (1.0, 4.0)]
    assert w.tolist() == [0.0, 0.0] and scaler.get_scale() == 2.0


def test_backoff_factor_none_is_rejected_and_nothing_changes() -> None:
    with pytest.raises(TypeError, match="backoff_factor"):
        GradScaler("cpu", backoff_factor=None)  # type: ignore[arg-type]
    scaler = GradScaler("cpu")
    with pytest.raises(TypeError, match="new_factor"):
        scaler.set_backoff_factor(None)  # type: ignore[arg-type]
    assert scaler.get_backoff_factor() == 0.5
    assert torch.amp.GradScaler("cpu").load_state_dict(scaler.state_dict()) is None


def test_grad_scaler_loads_a_loss_scale_optimizers_state() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    lso = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), initial_scale=64.0)
    w.grad = torch.tensor([math.inf, 1.0])
    with pytest.warns(UserWarning, match="no scaled loss"):
        lso.step()  # skipped: 32
    for state in (lso.state_dict(), lso.state_dict()["loss_scale"]):
        scaler = GradScaler("cpu", init_scale=8.0, growth_factor=4.0)
        scaler.load_state_dict(state)
        assert scaler.get_scale() == 32.0 and scaler.get_growth_factor() == 4.0
