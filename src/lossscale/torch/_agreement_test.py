"""Cross-rank agreement of the non-finite flag, for every torch front end (issue 16).

One 2-rank gloo job on loopback runs every case: front end (LossScaleOptimizer, its experimental
form, GradScaler, step_together) x inner optimizer (plain foreach SGD with momentum, fused
AdamW decided on the host as on the CPU, and fused AdamW decided on the device as on a GPU)
x who overflows (one rank, both ranks). The flag must be combined with MAX: with a SUM, two
overflowing ranks give ``found_inf == 2.0``, which a fused optimizer given the flag does not
treat as a skip (its kernel skips only on 1.0, and it subtracts the flag from its step count),
so the weights take the inf and the step counts go back. Each case checks, on every rank, that the
overflowing step left the parameters and the optimizer state bit-identical, that the scale
backed off once, and that the ranks hold the same weights and scale.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from lossscale._testing import run_gloo_job  # noqa: E402
from lossscale.torch import (  # noqa: E402
    GradScaler,
    LossScaleOptimizer,
    _engine,
    experimental,
    step_together,
)

WORLD = 2
JOB_TIMEOUT_S = 180.0
FRONT_ENDS = ("optimizer", "experimental", "grad_scaler", "step_together")
INNERS = ("sgd_foreach", "adamw_fused", "adamw_fused_on_device")
_DEVICE_DECIDES = _engine.device_decides


def _forced(device: Any, device_side_skip: bool) -> bool:
    """A GPU's way with ``device_side_skip=True``, forced on the CPU."""
    return True


WHO = ("one_rank", "all_ranks")
OVERFLOW_AT = 2  # of 4 steps


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _inner(name: str, params: Any) -> Any:
    if name == "sgd_foreach":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def _state(opt: Any) -> list[Any]:
    return [
        (key, value.clone() if isinstance(value, torch.Tensor) else value)
        for s in opt.state.values()
        for key, value in sorted(s.items())
    ]


def _same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return bool(torch.equal(x, y))
        if isinstance(x, tuple):
            return all(eq(p, q) for p, q in zip(x, y, strict=True))
        return bool(x == y)

    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b, strict=True))


def _case(rank: int, front_end: str, inner_name: str, who: str) -> dict[str, Any]:
    on_device = inner_name.endswith("_on_device")  # a GPU's way: found_inf to the kernel
    _engine.device_decides = _forced if on_device else _DEVICE_DECIDES  # type: ignore[assignment]
    model = _model()
    inner = _inner(inner_name, model.parameters())
    scaler = None
    if front_end == "grad_scaler":
        opt: Any = inner
        scaler = GradScaler("cpu", init_scale=2.0**10)
    elif front_end == "experimental":
        opt = experimental.LossScaleOptimizer(
            inner, {"class_name": "DynamicLossScale", "config": {"initial_loss_scale": 2.0**10}}
        )
    else:
        opt = LossScaleOptimizer(inner, initial_scale=2.0**10)
    scales, skipped_unchanged, finite = [], None, True
    for step in range(4):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            opt.get_scaled_loss(loss).backward()
        for p in model.parameters():  # data parallel by hand: average the scaled gradients
            dist.all_reduce(p.grad)
            p.grad /= WORLD
        if step == OVERFLOW_AT and (who == "all_ranks" or rank == 0):
            model[0].weight.grad[0, 0] = math.inf  # after the gradient all-reduce
        before = ([p.detach().clone() for p in model.parameters()], _state(inner))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scale = scaler.get_scale()
        elif front_end == "step_together":
            step_together(opt)
            scale = float(opt.loss_scale)
        else:
            opt.step()
            scale = float(opt.loss_scale)
        if step == OVERFLOW_AT:
            after = ([p.detach().clone() for p in model.parameters()], _state(inner))
            skipped_unchanged = _same(before[0], after[0]) and _same(before[1], after[1])
        finite = finite and all(bool(torch.isfinite(p).all()) for p in model.parameters())
        opt.zero_grad()
        scales.append(scale)
    return {
        "scales": scales,
        "skipped_unchanged": skipped_unchanged,
        "finite": finite,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _suite(rank: int, world: int) -> dict[Any, Any]:
    return {(f, i, w): _case(rank, f, i, w) for f in FRONT_ENDS for i in INNERS for w in WHO}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_gloo_job(_suite, WORLD, JOB_TIMEOUT_S, tmp_path_factory.mktemp("agreement"))


@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_every_rank_skips_together_and_keeps_everything(
    ranks: list[dict[Any, Any]], front_end: str, inner: str, who: str
) -> None:
    results = [r[(front_end, inner, who)] for r in ranks]
    for result in results:
        assert result["skipped_unchanged"] is True  # params and optimizer state bit-identical
        assert result["finite"] is True
        # the overflow backed the scale off once, on every rank, then it grew back on schedule
        assert result["scales"][OVERFLOW_AT] == result["scales"][OVERFLOW_AT - 1] / 2
    assert results[0]["scales"] == results[1]["scales"]
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
