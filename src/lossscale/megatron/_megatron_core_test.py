"""lossscale's scalers inside megatron-core's own optimizers: runs only where megatron-core and a
CUDA device are both present (megatron-core needs Python >= 3.12 and builds its optimizers on
CUDA only), skipped with the reason everywhere else, CI included.

Written against megatron-core 0.19.2's source (``megatron/core/optimizer/optimizer.py``,
``grad_scaler.py``); the CPU tests beside it (``_scaler_test.py``, ``_chained_test.py``) port
the same calls. What this adds where it runs: the real ``DynamicGradScaler`` as the oracle, on
CUDA, and the real ``Float16OptimizerWithFloat16Params`` / ``ChainedOptimizer`` calling
lossscale's scaler (``prepare_grads`` L741-772 and L1627-1633, ``step_with_ready_grads``,
``state_dict`` L1127-1136 and ``load_state_dict`` L1191-1213), on one rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
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

grad_scaler_module = pytest.importorskip("megatron.core.optimizer.grad_scaler")
MegatronDynamicGradScaler: Any = grad_scaler_module.DynamicGradScaler
OptimizerConfig: Any = optimizer_module.OptimizerConfig
ChainedOptimizer: Any = optimizer_module.ChainedOptimizer
Float16Optimizer: Any = optimizer_module.Float16OptimizerWithFloat16Params

INF = float("inf")


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    """A one-rank NCCL group: Megatron all-reduces found_inf over the group (L729-733)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("seed", range(6))
def test_bit_identical_to_megatrons_own_scaler_on_cuda(seed: int) -> None:
    rng = np.random.default_rng(seed)
    growth, backoff = [(2.0, 0.5), (1.5, 0.75), (1.1, 0.3)][seed % 3]
    args = (2.0**12, 1.0, growth, backoff, int(rng.integers(1, 5)), int(rng.integers(1, 4)))
    theirs = MegatronDynamicGradScaler(*args)
    ours = DynamicGradScaler(*args)
    assert ours.scale.device == theirs.scale.device
    for found_inf in (bool(x) for x in rng.random(300) < 0.3):
        theirs.update(found_inf)
        ours.update(found_inf)
        assert torch.equal(ours.scale, theirs.scale)
        assert torch.equal(ours.inv_scale, theirs.inv_scale)
    # state dicts both ways (Megatron's hysteresis tracker may be below zero)
    ours.load_state_dict(theirs.state_dict())
    again = MegatronDynamicGradScaler(*args)
    again.load_state_dict(ours.state_dict())
    for found_inf in (True, False, True, True, False, False, False, False):
        for s in (theirs, ours, again):
            s.update(found_inf)
        assert torch.equal(ours.scale, theirs.scale) and torch.equal(again.scale, theirs.scale)


class Model:
    """Dense and expert float16 parameters, one ``Float16OptimizerWithFloat16Params`` each
    (SGD, lr 1), chained as ``get_megatron_optimizer`` chains dense and MoE optimizers."""

    def __init__(self, make_scaler: Any) -> None:
        config = OptimizerConfig(optimizer="sgd", lr=1.0, fp16=True, clip_grad=0.0)
        self.dense = torch.nn.Parameter(torch.zeros(3, device="cuda", dtype=torch.float16))
        self.expert = torch.nn.Parameter(torch.zeros(2, device="cuda", dtype=torch.float16))
        subs = []
        for p in (self.dense, self.expert):
            sub = Float16Optimizer(
                torch.optim.SGD([p], lr=1.0), config, make_scaler(), lambda *_: None
            )
            sub.grad_stats_parallel_group = dist.group.WORLD
            subs.append(sub)
        self.optimizer = ChainedOptimizer(subs)

    def train_step(self, x_dense: list[float], x_expert: list[float]) -> tuple[bool, list[Any]]:
        """Megatron-LM's order: the loss scaled by ``optimizer.scale_loss``, backward, the
        chained ``prepare_grads`` (every sub-optimizer's, OR-ed) and, when no gradient
        overflowed, ``step_with_ready_grads``. Returns whether the step applied and the main
        (float32) gradients as unscaled by each sub-optimizer."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = (self.dense.float() * torch.tensor(x_dense, device="cuda")).sum() + (
            self.expert.float() * torch.tensor(x_expert, device="cuda")
        ).sum()
        self.optimizer.scale_loss(loss).sum().backward()
        found_inf = self.optimizer.prepare_grads()
        unscaled = [
            o.fp32_from_float16_groups[0][0].grad.clone() for o in self.optimizer.chained_optimizers
        ]
        if found_inf:
            return False, unscaled
        return bool(self.optimizer.step_with_ready_grads()), unscaled

    def scales(self) -> list[float]:
        return [o.grad_scaler.scale.item() for o in self.optimizer.chained_optimizers]


def test_megatron_optimizers_diverge_and_lossscales_shared_scaler_agrees() -> None:
    x_dense, x_expert = [1.0, 2.0, 3.0], [0.5, -4.0]

    def megatrons() -> Any:
        return MegatronDynamicGradScaler(8.0, 1.0, 2.0, 0.5, 1000, 1)

    theirs = Model(megatrons)
    assert not theirs.train_step([INF, 2.0, 3.0], x_expert)[0]
    assert theirs.scales() == [4.0, 8.0]
    applied, unscaled = theirs.train_step(x_dense, x_expert)
    assert applied and unscaled[1].tolist() == [x / 2 for x in x_expert]

    ours = Model(megatrons)
    shared = share_grad_scaler(ours.optimizer)  # converts Megatron's scaler
    assert isinstance(shared, DynamicGradScaler) and shared.scale.is_cuda
    assert not ours.train_step([INF, 2.0, 3.0], x_expert)[0]
    assert ours.scales() == [4.0, 4.0]
    applied, unscaled = ours.train_step(x_dense, x_expert)
    assert applied and unscaled[0].tolist() == x_dense and unscaled[1].tolist() == x_expert
    assert ours.expert.tolist() == [-x for x in x_expert]

    saved = ours.optimizer.state_dict()  # one entry per sub-optimizer, each with the scaler
    assert [s["grad_scaler"]["scale"].item() for s in saved] == [4.0, 4.0]
    resumed = Model(megatrons)
    resumed.optimizer.load_state_dict(saved)  # lossscale's state into Megatron's scalers
    assert resumed.scales() == [4.0, 4.0]
