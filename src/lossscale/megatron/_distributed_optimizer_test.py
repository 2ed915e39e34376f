"""lossscale's grad scaler in megatron-core's ``DistributedOptimizer`` (the optimizer state
sharded over the data-parallel group, the gradients in Megatron's ``DistributedDataParallel``
buffers), on CUDA: runs only where megatron-core and a CUDA device are both present
(``bash scripts/gpu_check.sh`` runs it), skipped with the reason everywhere else, CI included.

Built as Megatron's own unit tests build it (``tests/unit_tests/test_optimizer.py``): one rank
over NCCL, ``parallel_state.initialize_model_parallel()``, a float16 ``Linear`` wrapped in
``DistributedDataParallel(use_distributed_optimizer=True)`` and ``get_megatron_optimizer`` with
``fp16=True`` and ``optimizer="adam"`` (the ``DistributedOptimizer`` accepts Adam, not SGD:
megatron-core 0.19 asserts it; without Transformer Engine or Apex, Megatron builds torch's
``AdamW``). Each step scales the loss by ``optimizer.get_loss_scale()`` (Megatron's
``grad_scale_func``), syncs the gradient buffers and calls ``optimizer.step()``; an overflow is
an inf written into a parameter's ``main_grad`` after the sync. Megatron's own
``DynamicGradScaler`` is the oracle: with lossscale's shared in its place (``share_grad_scaler``)
the scales, the applied steps and the weights are the same, bit for bit; at the floor lossscale
adds its stall alarm.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("megatron-core's optimizers need a CUDA device", allow_module_level=True)
optimizer_module = pytest.importorskip(
    "megatron.core.optimizer", reason="megatron-core is not installed (it needs Python >= 3.12)"
)

import torch.distributed as dist  # noqa: E402

from lossscale._testing import free_port  # noqa: E402
from lossscale.megatron import DynamicGradScaler, share_grad_scaler  # noqa: E402

INF = float("inf")
#: W=2, H=2 from 2**8, as the DeepSpeed tests: growth, absorbed overflows and back-offs.
SETTINGS = {"initial_loss_scale": 2.0**8, "loss_scale_window": 2, "hysteresis": 2}
FLAGS = "..L.LL...."


@pytest.fixture(scope="module", autouse=True)
def model_parallel() -> Iterator[None]:
    """One rank over NCCL and Megatron's parallel state (tensor, pipeline: 1)."""
    from megatron.core import parallel_state

    own = not dist.is_initialized()
    if own:
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if own:
            dist.destroy_process_group()


def _build(lossscale: Any, **settings: Any) -> tuple[Any, Any]:
    """A float16 ``Linear(8, 4)`` in Megatron's DDP and its ``DistributedOptimizer`` (Adam,
    lr 0.1); ``lossscale``: None (Megatron's own scaler), True (lossscale's, converted from
    Megatron's) or a lossscale scaler to share."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=False, dtype=torch.float16, device="cuda")
    model.requires_grad_(True)
    ddp = DistributedDataParallel(
        TransformerConfig(num_attention_heads=1, num_layers=1),
        DistributedDataParallelConfig(use_distributed_optimizer=True),
        model,
    )
    config = optimizer_module.OptimizerConfig(
        optimizer="adam",
        lr=0.1,
        fp16=True,
        use_distributed_optimizer=True,
        clip_grad=0.0,
        **{**SETTINGS, **settings},
    )
    optimizer = optimizer_module.get_megatron_optimizer(config, [ddp])
    if lossscale is True:
        share_grad_scaler(optimizer)
    elif lossscale is not None:
        share_grad_scaler(optimizer, lossscale)
    return ddp, optimizer


def _distributed(optimizer: Any) -> list[Any]:
    """The optimizer's sub-optimizers (a ChainedOptimizer's, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _train(ddp: Any, optimizer: Any, flags: str) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 8, device="cuda", generator=g).half()
    out: dict[str, Any] = {"scale": [], "applied": [], "weights": [], "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for flag in flags:
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            loss = ddp(x).float().pow(2).mean()
            (loss * optimizer.get_loss_scale()).backward()
            ddp.finish_grad_sync()
            if flag == "L":
                for p in ddp.parameters():
                    p.main_grad.view(-1)[0] = INF
            applied, _, _ = optimizer.step()
            out["applied"].append(bool(applied))
            out["scale"].append(float(optimizer.get_loss_scale()))
            out["weights"].append([p.detach().float().cpu().clone() for p in ddp.parameters()])
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return out


def test_lossscale_in_the_distributed_optimizer_is_megatrons_rule_bit_for_bit() -> None:
    theirs_ddp, theirs = _build(None)
    ours_ddp, ours = _build(True)
    assert any(type(o).__name__ == "DistributedOptimizer" for o in _distributed(ours)), (
        _distributed(ours)
    )
    assert all(isinstance(o.grad_scaler, DynamicGradScaler) for o in _distributed(ours))
    a, b = _train(theirs_ddp, theirs, FLAGS), _train(ours_ddp, ours, FLAGS)
    assert a["applied"] == b["applied"] == [flag == "." for flag in FLAGS]
    assert a["scale"] == b["scale"]  # Megatron's hysteresis (refilled on growth) and growth
    assert b["scale"][0] == 2.0**8 and min(b["scale"]) < 2.0**8 and max(b["scale"]) > 2.0**8
    for wa, wb in zip(a["weights"], b["weights"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True))


def test_at_the_floor_lossscale_warns_once() -> None:
    floor = {"initial_loss_scale": 2.0, "hysteresis": 1, "min_loss_scale": 1.0}
    scaler = DynamicGradScaler(2.0, 1.0, 2.0, 0.5, 1000, 1, stall_steps=3, device="cuda")
    theirs_ddp, theirs = _build(None, **floor)
    ours_ddp, ours = _build(scaler, **floor)
    a, b = _train(theirs_ddp, theirs, "LLLLLL"), _train(ours_ddp, ours, "LLLLLL")
    assert a["scale"] == b["scale"] == [1.0] * 6 and not any(b["applied"])
    stalls = [w for w in b["warnings"] if w.startswith("LossScaleStalledWarning")]
    assert len(stalls) == 1 and not any("LossScaleStalled" in w for w in a["warnings"])
