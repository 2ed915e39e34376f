"""NumericsMonitor: exact rows at the scale in use, and nothing at all on unsampled steps."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lossscale.numerics import tensor_stats
from lossscale.torch import GradScaler, LossScaleOptimizer, NumericsMonitor
from lossscale.torch._opcount_test import SYNC, _Count

FORMATS = ("float16", "float8_e4m3fn", "float8_e5m2", "bfloat16")


def _model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model.to(device)


def _batch(device: str = "cpu") -> torch.Tensor:
    return (torch.randn(32, 8) * 1e-4).to(device)


@pytest.mark.parametrize("front_end", ["grad_scaler", "optimizer", "torch", "disabled", "none"])
def test_rows_are_the_exact_stats_of_the_scaled_gradients(front_end: str, device: str) -> None:
    model = _model(device)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler: Any = {
        "grad_scaler": lambda: GradScaler(device, init_scale=2.0**12),
        "optimizer": lambda: LossScaleOptimizer(inner, initial_scale=2.0**12),
        "torch": lambda: torch.amp.GradScaler(device, init_scale=2.0**12),
        "disabled": lambda: GradScaler(device, init_scale=2.0**12, enabled=False),
        "none": lambda: None,
    }[front_end]()
    monitor = NumericsMonitor(model, scaler, every=2, formats=FORMATS)
    for step in range(3):
        loss = (model(_batch(device)) ** 2).mean() * 1e-6
        if front_end == "optimizer":
            scaler.get_scaled_loss(loss).backward()
        elif scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert monitor.record() == (step % 2 == 0)
        if step % 2 == 0:
            rows = [r for r in monitor.report.rows if r.step == step]
            assert len(rows) == 4 * len(FORMATS)
            want_scale = 1.0 if front_end in ("none", "disabled") else 2.0**12
            for r in rows:
                assert r.loss_scale == want_scale
                assert r == (
                    step,
                    r.tensor,
                    r.format,
                    want_scale,
                    *tensor_stats(grads[r.tensor], formats=r.format)[r.format],
                )
        inner.zero_grad()
    assert monitor.report.steps == [0, 2]


def test_module_gradients_are_caught_on_sampled_steps_only() -> None:
    model = _model()
    monitor = NumericsMonitor(model, every=2, modules=True, formats=FORMATS)
    seen: list[torch.Tensor] = []
    model[1].register_full_backward_hook(lambda m, gi, go: seen.append(go[0].clone()))
    for _ in range(2):
        (model(_batch()) * 2.0**-20).sum().backward()
        monitor.record()
    names = {r.tensor for r in monitor.report.rows}
    assert names == {"0.weight", "0.bias", "2.weight", "2.bias", "module:0", "module:1", "module:2"}
    assert monitor.report.steps == [0]
    want = tensor_stats(seen[0], formats=FORMATS)
    for r in monitor.report.rows:
        if r.tensor == "module:1":
            assert tuple(r[4:]) == tuple(want[r.format])
    monitor.close()
    assert not model[1]._forward_hooks


def _iteration(model: torch.nn.Module, scaler: GradScaler, opt: Any, monitor: Any) -> _Count:
    device = next(model.parameters()).device.type
    x = _batch(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _Count(device) as count:
            scaler.scale(model(x).sum()).backward()
            if monitor is not None:
                monitor.record()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return count


def test_an_unsampled_step_adds_no_op_and_no_sync(device: str) -> None:
    """Op counts of a whole iteration (forward, backward, step) on an unsampled step equal a
    run's without the monitor, module hooks included."""
    counts = []
    for with_monitor in (False, True):
        model = _model(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = GradScaler(device)
        monitor = NumericsMonitor(model, scaler, every=3, modules=True) if with_monitor else None
        _iteration(model, scaler, opt, monitor)  # step 0: sampled
        counts.append(_iteration(model, scaler, opt, monitor))  # step 1: not sampled
    plain, monitored = counts
    assert monitored.ops == plain.ops and monitored.syncs == plain.syncs


def test_a_sampled_step_reads_the_device_once(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One read of all counts and the scale: one ``tolist()`` (a host sync on a GPU; on the
    CPU nothing to wait for, and no ``_local_scalar_dense``)."""
    model = _model(device)
    scaler = GradScaler(device)
    monitor = NumericsMonitor(model, scaler, every=1, formats=FORMATS, modules=True)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    scaler.scale(model(_batch(device)).sum()).backward()
    with _Count(device) as count:
        monitor.record()
    assert len(reads) == 1 and count.ops[SYNC] == 0
    assert count.syncs == (1 if device == "cuda" else 0)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got str"):
        NumericsMonitor("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scaler must be a lossscale GradScaler"):
        NumericsMonitor(_model(), scaler=object())
    with pytest.raises(ValueError, match="every must be at least 1, got 0"):
        NumericsMonitor(_model(), every=0)
    with pytest.raises(ValueError, match="unknown format 'float4'"):
        NumericsMonitor(_model(), formats=("float4",))
