"""The check without unscale: read-only for big CPU tensors (issue 20 item 2).

A check-only pass is a fused optimizer's on a GPU (it gets the scale as ``grad_scale`` and
unscales inside its kernel) and, on the CPU, the second pass over unscaled gradients when the
scale may drop below 1. On the CPU, tensors of at least ``READ_ONLY_MIN`` elements are checked
with ``aminmax`` (read once, never written); the rest go through the fused check kernel with
``inv_scale`` 1. The flag must be the same as the kernel's for any placement
of NaN, +inf and -inf, and no op may take the big gradients as a mutable argument (the ops'
schemas say which arguments they write; recorded with a ``TorchDispatchMode``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lossscale.torch import GradScaler, LossScaleOptimizer
from lossscale.torch._engine import READ_ONLY_MIN, GradGroups, check_and_unscale

BAD = [float("nan"), float("inf"), -float("inf")]


class _Writes(TorchDispatchMode):
    """The data pointers of every tensor passed as a written (mutable) argument."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in value if isinstance(value, list | tuple) else [value]:
                if isinstance(t, torch.Tensor):
                    self.written.add(t.data_ptr())
        return func(*args, **kwargs)


def _check(groups: GradGroups, params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, set[int]]:
    with _Writes() as writes:
        found = check_and_unscale(groups, [{"params": params}], None, torch.device("cpu"))
    return found, writes.written


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def _params(rng: np.random.Generator, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    sizes = [READ_ONLY_MIN, 7, READ_ONLY_MIN + 3, 1000, 2 * READ_ONLY_MIN]
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]
    for p in params:
        p.grad = torch.from_numpy(rng.standard_normal(p.numel())).to(dtype)
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_flag_is_the_kernels_and_big_gradients_are_not_written(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    groups = GradGroups()
    params = _params(rng, dtype)
    for trial in range(24):
        for p in params:
            p.grad = torch.from_numpy(rng.standard_normal(p.numel())).to(dtype)
        if trial % 4:  # a quarter of the trials stay finite
            victim = params[int(rng.integers(len(params)))]
            cast = victim.grad  # type: ignore[union-attr]
            assert cast is not None
            cast[int(rng.integers(cast.numel()))] = BAD[trial % 3]
        want = float(not all(torch.isfinite(p.grad).all() for p in params))  # type: ignore[arg-type]
        before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
        found, written = _check(groups, params)
        assert found.dtype == torch.float32 and float(found) == want, trial
        for p, values in zip(params, before, strict=True):
            assert _bits(p.grad) == _bits(values)  # type: ignore[arg-type]  # NaN too
            big = p.numel() >= READ_ONLY_MIN
            assert (p.grad.data_ptr() in written) is not big  # type: ignore[union-attr]


def test_the_write_record_would_catch_a_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard: with the threshold out of reach, every gradient goes through the kernel,
    which the record sees writing the big ones too."""
    monkeypatch.setattr("lossscale.torch._engine.READ_ONLY_MIN", 2**62)
    params = _params(np.random.default_rng(1), torch.float32)
    _, written = _check(GradGroups(), params)
    assert all(p.grad.data_ptr() in written for p in params)  # type: ignore[union-attr]


@pytest.mark.usefixtures("fused_decision")  # both the CPU's host and a GPU's device decision
@pytest.mark.parametrize("front_end", ["optimizer", "grad_scaler"])
def test_fused_steps_on_big_tensors_match_torchs_grad_scaler(front_end: str) -> None:
    """Fused AdamW over big parameters: the same weights and scales as under torch's
    GradScaler, with overflows in big and small gradients."""
    rng = np.random.default_rng(2)
    init = [torch.from_numpy(rng.standard_normal(n)).float() for n in (READ_ONLY_MIN, 33)]

    def run(ours: bool) -> tuple[list[torch.Tensor], list[float]]:
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        lso = LossScaleOptimizer(opt, initial_scale=2.0**10) if front_end == "optimizer" else None
        scaler: GradScaler | torch.amp.GradScaler = (
            GradScaler("cpu", init_scale=2.0**10) if ours else torch.amp.GradScaler("cpu", 2.0**10)
        )
        scales = []
        gen = np.random.default_rng(3)
        for step in range(12):
            loss = sum((p * p).sum() for p in params)
            if ours and lso is not None:
                lso.get_scaled_loss(loss).backward()
            else:
                scaler.scale(loss).backward()
            if step % 3 == 1:
                p = params[step % 2]
                p.grad[int(gen.integers(p.numel()))] = BAD[step % 3]  # type: ignore[index]
            if ours and lso is not None:
                lso.step()
                scales.append(float(lso.loss_scale))
            else:
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            opt.zero_grad()
        return [p.detach() for p in params], scales

    ours, theirs = run(True), run(False)
    assert ours[1] == theirs[1] and min(ours[1]) < 2.0**10
    for a, b in zip(ours[0], theirs[0], strict=True):
        assert torch.equal(a, b)
