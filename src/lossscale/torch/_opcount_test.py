"""Issue 20 item 2: the device ops and host syncs of one step, beside torch.amp.GradScaler's.

Counted with a ``TorchDispatchMode`` around the second iteration (scale, backward, step,
update), minus what the bare inner optimizer step, the forward/backward and the loss multiply
make by themselves. Every dispatched aten op is a kernel launch on a GPU, and every
``aten._local_scalar_dense`` a host sync (on the CPU ``.item()`` dispatches it too, so syncs are
counted here exactly as on CUDA). The profiler's range markers (``_record_function_*``, which
``torch.optim.Optimizer.step`` wrappers add: host-only bookkeeping, no device work) are left out.
The values of each path are tested against the core rule in ``_state_test.py``.
"""

from __future__ import annotations

import collections
import socket
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lossscale.torch import GradScaler, LossScaleOptimizer, _engine

MARKERS = {"_record_function_enter_new", "_record_function_exit"}
SYNC = "_local_scalar_dense"
_DEVICE_DECIDES = _engine.device_decides  # the real decision (the autouse fixture forces it)


@pytest.fixture(autouse=True)
def _gpu_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count a GPU's path: a fused optimizer's decision stays on the device. On the CPU it is
    read on the host (no sync there), counted in
    :func:`test_fused_optimizers_on_the_cpu_are_decided_on_the_host`."""
    monkeypatch.setattr(_engine, "device_decides", lambda device, device_side_skip: True)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


def _inner(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.1, foreach=kind == "foreach")


def _extra(kind: str, front_end: str, **kw: Any) -> collections.Counter[str]:
    """Aten ops of the second iteration's loss-scaling calls (``scale`` / ``get_scaled_loss``,
    ``step``, ``update``; not the backward pass) beyond the bare inner step's (``kw``: the
    front end's keyword arguments)."""
    x = torch.randn(4, 8)
    model = _model()
    bare = _inner(model, kind)
    for _ in range(2):
        model(x).sum().backward()
        with _Count() as base:
            bare.step()
    model = _model()
    opt = _inner(model, kind)
    lso = LossScaleOptimizer(opt, **kw) if front_end == "optimizer" else None
    scaler = {"grad_scaler": GradScaler, "torch": torch.amp.GradScaler}.get(front_end)
    s: Any = scaler("cpu", **kw) if scaler is not None else None
    for _ in range(2):
        opt.zero_grad()
        loss = model(x).sum()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _Count() as count:
                scaled = lso.get_scaled_loss(loss) if lso is not None else s.scale(loss)
            scaled.backward()
            with count:
                if lso is not None:
                    lso.step()
                else:
                    s.step(opt)
                    s.update()
    extra = collections.Counter(count.ops)
    extra.subtract(base.ops)  # signed: an op of the bare step may be missing from ours
    for marker in MARKERS:
        del extra[marker]
    return extra


def _totals(extra: collections.Counter[str]) -> tuple[int, int]:
    """(ops, host syncs)."""
    return sum(extra.values()), extra[SYNC]


# Exact (ops, host syncs) on torch 2.13 CPU, the loss multiply included. torch.amp.GradScaler:
# 10 ops on every path, one sync unless fused. lossscale with ordinary optimizers: the multiply,
# the flag's allocation, the check kernel and the one sync; the rule then runs on the host (no
# device work). Fused: the multiply and the flag, the check (inv_scale 1: the optimizer's
# kernel gets grad_scale), the fused optimizer's own step-count correction for a skip (in
# torch's count too), 2 ops for the scale (torch's fused update kernel where it computes the
# rule exactly, then the floor), 1 for the skipped steps, 3 for the stall alarm's count. (Before
# issue 20, counted the same way: 20 / 20 / 17 for LossScaleOptimizer, 18 / 18 / 16 for
# GradScaler.)
TORCH = {"plain": (10, 1), "foreach": (10, 1), "fused": (10, 0)}
EXPECTED = {
    ("plain", "optimizer"): (4, 1),
    ("foreach", "optimizer"): (4, 1),
    ("fused", "optimizer"): (10, 0),
    ("plain", "grad_scaler"): (4, 1),
    ("foreach", "grad_scaler"): (4, 1),
    ("fused", "grad_scaler"): (10, 0),
}


@pytest.mark.parametrize(("kind", "front_end"), list(EXPECTED))
def test_counts_of_one_step_beside_grad_scaler(kind: str, front_end: str) -> None:
    theirs = _totals(_extra(kind, "torch"))
    ours = _totals(_extra(kind, front_end))
    assert theirs == TORCH[kind]
    assert ours == EXPECTED[kind, front_end]
    assert ours[0] <= theirs[0] and ours[1] == theirs[1]


def test_fused_optimizers_on_the_cpu_are_decided_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU reading the flag waits for nothing, so a fused step costs what an ordinary
    one does: the multiply, the flag, the check and its read; no step-count correction and no
    rule on the device. torch's GradScaler does the device's work there too (10 ops)."""
    monkeypatch.setattr(_engine, "device_decides", _DEVICE_DECIDES)
    assert _totals(_extra("fused", "torch")) == TORCH["fused"]
    for front_end in ("optimizer", "grad_scaler"):
        extra = _extra("fused", front_end)
        assert _totals(extra) == EXPECTED["plain", front_end]
        assert extra["_foreach_sub_"] == 0 and extra["_amp_update_scale_"] == 0


def test_the_stall_alarm_costs_three_ops_on_the_device_and_none_on_the_host() -> None:
    off = {"stall_steps": None}
    for front_end in ("optimizer", "grad_scaler"):
        fused, plain = EXPECTED["fused", front_end], EXPECTED["plain", front_end]
        assert _totals(_extra("fused", front_end, **off)) == (fused[0] - 3, 0)
        assert _totals(_extra("plain", front_end, **off)) == plain


# Where torch's kernel does not compute the rule, the device home runs the rule on tensors
# (its where chain); the host home is unaffected. Reported in docs/performance.md.
RULE_ON_DEVICE = {"hysteresis": 26, "max_loss_scale": 26}


@pytest.mark.parametrize("variant", list(RULE_ON_DEVICE))
def test_the_rule_on_the_device_where_the_kernel_does_not_apply(variant: str) -> None:
    kw: dict[str, Any] = {variant: 2 if variant == "hysteresis" else 2.0**20}
    for front_end in ("optimizer", "grad_scaler"):
        assert _totals(_extra("fused", front_end, **kw)) == (RULE_ON_DEVICE[variant], 0)
        assert _totals(_extra("plain", front_end, **kw)) == EXPECTED["plain", front_end]


def test_a_process_group_adds_exactly_one_all_reduce() -> None:
    """A one-rank gloo group on the loopback: the flag's MAX all-reduce is the only addition."""
    assert not dist.is_initialized()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        for front_end in ("optimizer", "grad_scaler"):
            for kind in ("plain", "fused"):
                extra = _extra(kind, front_end)
                assert extra["allreduce_"] == 1
                assert _totals(extra) == (EXPECTED[kind, front_end][0] + 1, TORCH[kind][1])
    finally:
        dist.destroy_process_group()
