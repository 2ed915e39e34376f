"""Issue 20 item 2: the device ops and host syncs of one step, beside torch.amp.GradScaler's.

Counted with a ``TorchDispatchMode`` around the second iteration (scale, backward, step,
update), minus what the bare inner optimizer step, the forward/backward and the loss multiply
make by themselves. Every dispatched aten op is a kernel launch on a GPU, and every
``aten._local_scalar_dense`` a host sync (on the CPU ``.item()`` dispatches it too, so syncs are
counted here exactly as on CUDA). Each test runs on the CPU and on CUDA where present
(``device``); on CUDA every host sync is also counted as the device sees it, with
``torch.cuda.set_sync_debug_mode("warn")`` (any wait for the device, not only ``.item()``):
0 for a fused step decided on the device, 1 otherwise, never more than torch's. The
profiler's range markers (``_record_function_*``, which ``torch.optim.Optimizer.step``
wrappers add: host-only bookkeeping, no device work) are left out.
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


SYNC_WARNING = "called a synchronizing CUDA operation"


class _Count(TorchDispatchMode):
    """The aten ops dispatched inside, and the host syncs: on CUDA those that
    ``torch.cuda.set_sync_debug_mode("warn")`` reports; on the CPU, where nothing waits for a
    device, the dispatched ``_local_scalar_dense``."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.device = device
        self.sync_warnings = 0
        self._recorders: list[tuple[Any, list[warnings.WarningMessage]]] = []

    def __enter__(self) -> Any:
        if self.device == "cuda":
            recorder = warnings.catch_warnings(record=True)
            log = recorder.__enter__()
            assert log is not None
            warnings.simplefilter("always")
            self._recorders.append((recorder, log))
            torch.cuda.set_sync_debug_mode("warn")
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            recorder, log = self._recorders.pop()
            self.sync_warnings += sum(SYNC_WARNING in str(w.message) for w in log)
            recorder.__exit__(*exc)

    @property
    def syncs(self) -> int:
        return self.sync_warnings if self.device == "cuda" else self.ops[SYNC]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Extra(collections.Counter[str]):
    """The extra aten ops of a step (a Counter), with ``syncs``: its extra host syncs as the
    device counts them (:attr:`_Count.syncs`)."""

    syncs = 0


def _model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(device)


def _inner(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.1, foreach=kind == "foreach")


def _extra(kind: str, front_end: str, device: str = "cpu", **kw: Any) -> _Extra:
    """Aten ops of the second iteration's loss-scaling calls (``scale`` / ``get_scaled_loss``,
    ``step``, ``update``; not the backward pass) beyond the bare inner step's (``kw``: the
    front end's keyword arguments), on ``device``."""
    x = torch.randn(4, 8).to(device)
    model = _model(device)
    bare = _inner(model, kind)
    for _ in range(2):
        model(x).sum().backward()
        with _Count(device) as base:
            bare.step()
    model = _model(device)
    opt = _inner(model, kind)
    lso = LossScaleOptimizer(opt, **kw) if front_end == "optimizer" else None
    scaler = {"grad_scaler": GradScaler, "torch": torch.amp.GradScaler}.get(front_end)
    s: Any = scaler(device, **kw) if scaler is not None else None
    for _ in range(2):
        opt.zero_grad()
        loss = model(x).sum()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _Count(device) as count:
                scaled = lso.get_scaled_loss(loss) if lso is not None else s.scale(loss)
            scaled.backward()
            with count:
                if lso is not None:
                    lso.step()
                else:
                    s.step(opt)
                    s.update()
    extra = _Extra(count.ops)
    extra.subtract(base.ops)  # signed: an op of the bare step may be missing from ours
    for marker in MARKERS:
        del extra[marker]
    extra.syncs = count.syncs - base.syncs
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
def test_counts_of_one_step_beside_grad_scaler(kind: str, front_end: str, device: str) -> None:
    their_extra, our_extra = _extra(kind, "torch", device), _extra(kind, front_end, device)
    theirs, ours = _totals(their_extra), _totals(our_extra)
    assert theirs == TORCH[kind]
    assert ours == EXPECTED[kind, front_end]
    assert ours[0] <= theirs[0] and ours[1] == theirs[1]
    # every host sync, as the device counts them: 0 decided on the device, else 1; <= torch's
    assert our_extra.syncs == EXPECTED[kind, front_end][1] <= their_extra.syncs


def test_fused_optimizers_are_decided_on_the_host_by_default(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """Without ``device_side_skip`` (and always on the CPU, where reading the flag waits for
    nothing) a fused step costs what an ordinary one does: the multiply, the flag, the check
    and its read; no step-count correction and no rule on the device. torch's GradScaler does
    the device's work there too (10 ops)."""
    monkeypatch.setattr(_engine, "device_decides", _DEVICE_DECIDES)
    assert _totals(_extra("fused", "torch", device)) == TORCH["fused"]
    for front_end in ("optimizer", "grad_scaler"):
        extra = _extra("fused", front_end, device)
        assert _totals(extra) == EXPECTED["plain", front_end]
        assert extra.syncs == 1
        assert extra["_foreach_sub_"] == 0 and extra["_amp_update_scale_"] == 0


def test_device_side_skip_decides_fused_steps_on_the_device(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """The real decision (not forced), on a device where reading the flag costs a sync: CUDA,
    or the CPU made one (``SYNCHRONOUS_DEVICES`` emptied; no change on CUDA). Asked for with
    ``device_side_skip=True``: no sync at all; by default: the one read."""
    monkeypatch.setattr(_engine, "device_decides", _DEVICE_DECIDES)
    monkeypatch.setattr(_engine, "SYNCHRONOUS_DEVICES", frozenset())
    for front_end in ("optimizer", "grad_scaler"):
        on_device = _extra("fused", front_end, device, device_side_skip=True)
        assert _totals(on_device) == EXPECTED["fused", front_end]
        assert on_device.syncs == 0
        on_host = _extra("fused", front_end, device)
        assert _totals(on_host) == EXPECTED["plain", front_end]
        assert on_host.syncs == 1


def test_the_stall_alarm_costs_three_ops_on_the_device_and_none_on_the_host(device: str) -> None:
    off = {"stall_steps": None}
    for front_end in ("optimizer", "grad_scaler"):
        fused, plain = EXPECTED["fused", front_end], EXPECTED["plain", front_end]
        fused_extra = _extra("fused", front_end, device, **off)
        assert _totals(fused_extra) == (fused[0] - 3, 0) and fused_extra.syncs == 0
        assert _totals(_extra("plain", front_end, device, **off)) == plain


# Where torch's kernel does not compute the rule, the device home runs the rule on tensors
# (its where chain); the host home is unaffected. Reported in docs/performance.md.
RULE_ON_DEVICE = {"hysteresis": 26, "max_loss_scale": 26}


@pytest.mark.parametrize("variant", list(RULE_ON_DEVICE))
def test_the_rule_on_the_device_where_the_kernel_does_not_apply(variant: str, device: str) -> None:
    kw: dict[str, Any] = {variant: 2 if variant == "hysteresis" else 2.0**20}
    for front_end in ("optimizer", "grad_scaler"):
        fused_extra = _extra("fused", front_end, device, **kw)
        assert _totals(fused_extra) == (RULE_ON_DEVICE[variant], 0) and fused_extra.syncs == 0
        assert _totals(_extra("plain", front_end, device, **kw)) == EXPECTED["plain", front_end]


#: Ops a process group adds per step: LossScaleOptimizer the MAX all-reduce only; GradScaler
#: also a copy of the flag to all-reduce (each rank's own flag stays readable in
#: ``_found_inf_per_device``, as torch's) and the clamp that combines both at ``step``.
GROUP_OPS = {"optimizer": 1, "grad_scaler": 3}


def test_a_process_group_adds_exactly_one_all_reduce() -> None:
    """A one-rank gloo group on the loopback: the flag's MAX all-reduce is the only collective,
    and no host sync is added. CPU-only: gloo is the CPU's backend (NCCL's ranks are in
    ``_distributed_test.py``)."""
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
                ops = EXPECTED[kind, front_end][0] + GROUP_OPS[front_end]
                assert _totals(extra) == (ops, TORCH[kind][1])
    finally:
        dist.destroy_process_group()
