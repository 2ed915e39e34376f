"""``share_grad_scaler``: one decision per step for a chained optimizer, in Megatron's call order.

megatron-core builds its optimizers on CUDA only (engines.md §4), so the optimizers are
imitated here on the CPU: :class:`MiniMixedPrecisionOptimizer` and :class:`MiniChainedOptimizer`
port, from Megatron-core 0.19.2's ``megatron/core/optimizer/optimizer.py``, every call that
touches the grad scaler, in its order, and nothing else:

* ``MixedPrecisionOptimizer.__init__`` L679, L689-690 (``grad_scaler``, ``found_inf``),
  ``get_loss_scale`` L704-707, ``MegatronOptimizer.scale_loss`` L457-459;
* ``_unscale_main_grads_and_check_for_nan`` L713-738: reset ``found_inf``, unscale with
  ``grad_scaler.inv_scale`` (``torch._amp_foreach_non_finite_check_and_unscale_``), the MAX
  all-reduce over the gradient-statistics group, ``found_inf.item() > 0``;
* ``prepare_grads`` L741-772 (``grad_scaler.update(found_inf_flag)`` L770), ``step`` L816-848
  (skipped when the flag is set);
* ``Float16OptimizerWithFloat16Params.state_dict`` L1133-1134 and ``load_state_dict``
  L1208-1213 (the ``grad_scaler`` entry);
* ``ChainedOptimizer.get_loss_scale`` L1488-1492 (the first sub-optimizer's scale),
  ``state_dict`` L1535-1539, ``load_state_dict`` L1573-1589, ``prepare_grads`` L1627-1633
  (every sub-optimizer's, OR-ed), ``step`` L1855-1863 and ``_step`` L1635-1644.

and, from ``megatron/core/models/mimo/optimizer.py``, :class:`MiniMimoOptimizer`: the
``MimoOptimizer`` of modules on disjoint ranks (``__init__`` L42-51, ``prepare_grads`` L54-59,
``step`` L76-112, ``step_with_ready_grads`` L114-119, ``get_loss_scale`` L131-135).

Megatron's own per-sub-optimizer scalers are :class:`MegatronDynamicPort` (the torch port of
grad_scaler.py in ``_scaler_test.py``); ``get_megatron_optimizer`` builds one per sub-optimizer
(optimizer/__init__.py L646-662).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lossscale._testing import run_gloo_job
from lossscale.core import LossScaleStalledWarning
from lossscale.megatron import ConstantGradScaler, DynamicGradScaler, share_grad_scaler
from lossscale.megatron._testing import MegatronDynamicPort

INF = float("inf")


class MiniMixedPrecisionOptimizer:
    """The grad-scaler calls of Megatron's ``MixedPrecisionOptimizer`` (optimizer.py L654-848)
    over fp32 main parameters, with SGD (lr 1) as the inner optimizer."""

    def __init__(
        self, params: list[torch.Tensor], grad_scaler: Any, group: Any = None, reduce: bool = True
    ) -> None:
        self.params = params
        self.optimizer = torch.optim.SGD(params, lr=1.0)
        self.grad_scaler = grad_scaler  # L679
        self.group, self.reduce = group, reduce
        if self.grad_scaler:  # L689-690
            self.found_inf = torch.tensor([0.0], dtype=torch.float)
        self.unscaled: list[torch.Tensor] = []  # what prepare_grads left in the grads

    def get_loss_scale(self) -> torch.Tensor:  # L704-707
        return self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:  # L457-459
        return self.get_loss_scale() * loss

    def _unscale_main_grads_and_check_for_nan(self) -> bool:  # L713-738
        main_grads = [p.grad for p in self.params]
        self.found_inf.fill_(0.0)
        torch._amp_foreach_non_finite_check_and_unscale_(
            main_grads, self.found_inf, self.grad_scaler.inv_scale
        )
        if self.reduce and dist.is_initialized():  # L729-733
            dist.all_reduce(self.found_inf, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self.found_inf.item() > 0)  # L736

    @torch.no_grad()
    def prepare_grads(self) -> bool:  # L741-772
        if self.grad_scaler:
            found_inf_flag = self._unscale_main_grads_and_check_for_nan()
            self.unscaled = [p.grad.clone() for p in self.params]
            self.grad_scaler.update(found_inf_flag)  # L770
            return found_inf_flag
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:  # L777-814
        self.optimizer.step()
        return True

    @torch.no_grad()
    def step(self) -> tuple[bool, Any, Any]:  # L816-848 (no clipping, no zero counting)
        if self.prepare_grads():
            return False, None, None
        return self.step_with_ready_grads(), 0.0, 0

    def state_dict(self) -> dict[str, Any]:  # L1127-1136
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # L1191-1213
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if "grad_scaler" in state_dict and self.grad_scaler:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


class MiniChainedOptimizer:
    """Megatron's ``ChainedOptimizer`` (optimizer.py L1419-1938), its scaler-related calls."""

    def __init__(self, chained_optimizers: list[Any]) -> None:
        self.chained_optimizers = chained_optimizers

    def get_loss_scale(self) -> torch.Tensor:  # L1488-1492
        return self.chained_optimizers[0].get_loss_scale()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:  # L457-459
        return self.get_loss_scale() * loss

    def state_dict(self) -> list[dict[str, Any]]:  # L1535-1539
        return [optimizer.state_dict() for optimizer in self.chained_optimizers]

    def load_state_dict(self, state_dict: list[dict[str, Any]]) -> None:  # L1573-1589
        for optimizer, state in zip(self.chained_optimizers, state_dict, strict=True):
            optimizer.load_state_dict(state)

    @torch.no_grad()
    def prepare_grads(self) -> bool:  # L1627-1633
        found_inf_flag = False
        for optimizer in self.chained_optimizers:
            found_inf_flag |= optimizer.prepare_grads()
        return found_inf_flag

    def step(self) -> tuple[bool, Any, Any]:  # L1855-1863, then _step L1635-1644
        if self.prepare_grads():
            return False, None, None
        success = True
        for optimizer in self.chained_optimizers:
            success &= optimizer.step_with_ready_grads()
        return success, 0.0, None


class MiniMimoOptimizer:
    """Megatron's ``MimoOptimizer`` (mimo/optimizer.py L34-135): the optimizers of the modules
    active on this rank, and the world agreement on the flag, made after every module
    optimizer's ``prepare_grads`` (which updated its scaler) and before the step."""

    def __init__(self, active: list[Any]) -> None:  # L42-51
        self._active_optimizers = active

    def get_loss_scale(self) -> torch.Tensor:  # L131-135
        return self._active_optimizers[0].get_loss_scale()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:  # optimizer.py L457-459
        return self.get_loss_scale() * loss

    @torch.no_grad()
    def prepare_grads(self) -> bool:  # L54-59
        found_inf = False
        for opt in self._active_optimizers:
            found_inf |= opt.prepare_grads()
        return found_inf

    @torch.no_grad()
    def step(self) -> tuple[bool, Any, Any]:  # L76-112 (no clipping, no zero counting)
        found_inf = self.prepare_grads()
        found_inf_tensor = torch.tensor([found_inf], dtype=torch.float32)
        dist.all_reduce(found_inf_tensor, op=dist.ReduceOp.MAX)
        if found_inf_tensor.item() > 0:
            return False, None, None
        success = True
        for opt in self._active_optimizers:  # step_with_ready_grads, L114-119
            success &= opt.step_with_ready_grads()
        success_tensor = torch.tensor([1 if success else 0], dtype=torch.int)
        dist.all_reduce(success_tensor, op=dist.ReduceOp.MIN)
        return bool(success_tensor.item()), 0.0, None


class Model:
    """Two parameter groups, dense and expert, one sub-optimizer each (as
    ``get_megatron_optimizer`` splits dense and MoE parameters, __init__.py L1140-1224)."""

    def __init__(self, make_scaler: Any, **kw: Any) -> None:
        self.dense = torch.zeros(3, requires_grad=True)
        self.expert = torch.zeros(2, requires_grad=True)
        self.optimizer = MiniChainedOptimizer(
            [
                MiniMixedPrecisionOptimizer([self.dense], make_scaler(), **kw),
                MiniMixedPrecisionOptimizer([self.expert], make_scaler(), **kw),
            ]
        )

    def train_step(self, x_dense: list[float], x_expert: list[float]) -> bool:
        """Megatron-LM's order: scale the loss (``grad_scale_func = optimizer.scale_loss``),
        backward, ``optimizer.step()``. The gradients are ``x`` times the loss scale."""
        for p in (self.dense, self.expert):
            p.grad = None
        loss = (self.dense * torch.tensor(x_dense)).sum() + (
            self.expert * torch.tensor(x_expert)
        ).sum()
        self.optimizer.scale_loss(loss).sum().backward()
        return bool(self.optimizer.step()[0])

    def scales(self) -> list[float]:
        return [float(o.grad_scaler.scale.item()) for o in self.optimizer.chained_optimizers]


def megatron_scaler() -> MegatronDynamicPort:
    return MegatronDynamicPort(8.0, 1.0, 2.0, 0.5, 1000, 1)


def lossscale_scaler() -> DynamicGradScaler:
    return DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 1000, 1, device="cpu")


# -- the divergence, and one decision -----------------------------------------------------------


def test_megatron_scalers_diverge_and_the_shared_scaler_agrees() -> None:
    """The dense sub-optimizer overflows: Megatron's own scalers end at ``[4.0, 8.0]``
    (Megatron-Bridge#5591's observation), and on the next step the expert gradients are
    unscaled by 8 while the loss was scaled by 4 (the first sub-optimizer's). One shared scaler
    backs off once for the whole step and unscales every gradient by the loss's scale."""
    x_dense, x_expert = [1.0, 2.0, 3.0], [0.5, -4.0]
    theirs = Model(megatron_scaler)
    assert not theirs.train_step([INF, 2.0, 3.0], x_expert)  # the step is skipped (L1862-1863)
    assert theirs.scales() == [4.0, 8.0]
    assert theirs.train_step(x_dense, x_expert)
    dense, expert = (o.unscaled[0] for o in theirs.optimizer.chained_optimizers)
    assert dense.tolist() == x_dense
    assert expert.tolist() == [x / 2 for x in x_expert]  # wrongly unscaled: half the gradient

    ours = Model(lossscale_scaler)
    shared = share_grad_scaler(ours.optimizer)
    assert not ours.train_step([INF, 2.0, 3.0], x_expert)
    assert ours.optimizer.chained_optimizers[1].unscaled[0].tolist() == x_expert  # by 8 too
    assert ours.scales() == [4.0, 4.0] and shared.pending_reports == 0
    assert ours.train_step(x_dense, x_expert)
    dense, expert = (o.unscaled[0] for o in ours.optimizer.chained_optimizers)
    assert dense.tolist() == x_dense and expert.tolist() == x_expert
    assert ours.expert.tolist() == [-x for x in x_expert]  # SGD, lr 1: the right update


def test_one_update_per_step_and_no_half_updated_scale() -> None:
    """Growth on every finite step (``growth_interval=1``): one growth per step, and the second
    sub-optimizer unscales by the same scale as the first. A scaler merely assigned to both
    sub-optimizers (no share_grad_scaler) grows twice per step and hands the second one a
    scale the loss was never multiplied by."""

    def growing() -> DynamicGradScaler:
        return DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 1, 1, device="cpu")

    naive = Model(growing)
    one = naive.optimizer.chained_optimizers[0].grad_scaler
    for o in naive.optimizer.chained_optimizers:
        o.grad_scaler = one
    assert naive.train_step([1.0, 1.0, 1.0], [1.0, 1.0])
    assert naive.scales() == [32.0, 32.0]  # two growths in one step
    assert naive.optimizer.chained_optimizers[1].unscaled[0].tolist() == [0.5, 0.5]

    model = Model(growing)
    share_grad_scaler(model.optimizer)
    for step in range(3):
        assert model.train_step([1.0, 1.0, 1.0], [1.0, 1.0])
        assert model.scales() == [8.0 * 2 ** (step + 1)] * 2
        for o in model.optimizer.chained_optimizers:
            assert o.unscaled[0].eq(1.0).all()


@pytest.mark.parametrize("seed", range(6))
def test_shared_scaler_is_one_megatron_rule_on_the_or_of_the_flags(seed: int) -> None:
    """Over random per-sub-optimizer overflows, the shared scaler follows one Megatron scaler
    updated once per step with the OR of the flags, bit for bit."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 5))
    interval, hysteresis = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    subs = [
        SimpleNamespace(
            grad_scaler=DynamicGradScaler(
                2.0**12, 1.0, 1.5, 0.75, interval, hysteresis, device="cpu"
            )
        )
        for _ in range(n)
    ]
    shared = share_grad_scaler(SimpleNamespace(chained_optimizers=subs))
    oracle = MegatronDynamicPort(2.0**12, 1.0, 1.5, 0.75, interval, hysteresis)
    for _ in range(300):
        flags = [bool(f) for f in rng.random(n) < 0.1]
        before = shared.scale
        for sub, flag in zip(subs, flags, strict=True):
            assert sub.grad_scaler.scale is before  # unchanged until the last report
            sub.grad_scaler.update(flag)
        oracle.update(any(flags))
        assert torch.equal(shared.scale, oracle.scale)
        assert shared.state_dict()["growth_tracker"] == oracle._growth_tracker


# -- share_grad_scaler itself ---------------------------------------------------------------


def test_share_converts_megatrons_scaler_with_its_state() -> None:
    megatron = [MegatronDynamicPort(2.0**10, 2.0, 2.0, 0.5, 5.0, 3) for _ in range(2)]
    for f in (True, True, True, True, False, False):  # tracker below zero, 2 finite steps
        for m in megatron:
            m.update(f)
    model = SimpleNamespace(
        chained_optimizers=[SimpleNamespace(grad_scaler=m) for m in megatron]
        + [SimpleNamespace(grad_scaler=None), SimpleNamespace(zero_grad=None)]  # bf16, fp32
    )
    shared = share_grad_scaler(model)
    assert isinstance(shared, DynamicGradScaler) and shared.device == torch.device("cpu")
    assert [o.grad_scaler for o in model.chained_optimizers[:3]] == [shared, shared, None]
    assert (shared.growth_interval, shared.hysteresis, shared.min_scale.item()) == (5, 3, 2.0)
    assert shared.state_dict()["growth_tracker"] == 2
    assert torch.equal(shared.scale, megatron[0].scale)
    for f in (True, False, False, False, True, True, False):
        for _ in range(2):
            shared.update(f)
        megatron[0].update(f)
        assert torch.equal(shared.scale, megatron[0].scale)
    assert share_grad_scaler(model) is shared  # again: the same scaler


def test_share_accepts_nested_chains_a_single_optimizer_and_a_given_scaler() -> None:
    a, b, c = (SimpleNamespace(grad_scaler=megatron_scaler()) for _ in range(3))
    nested = SimpleNamespace(
        chained_optimizers=[a, SimpleNamespace(chained_optimizers=[b, a]), c]
    )  # Megatron nests a layer-wise optimizer's chain (__init__.py L982)
    mine = DynamicGradScaler(16.0, 1.0, 2.0, 0.5, 1000, 1, device="cpu")
    assert share_grad_scaler(nested, mine) is mine
    assert a.grad_scaler is b.grad_scaler is c.grad_scaler is mine
    for _ in range(2):
        mine.update(True)
    assert mine.scale.item() == 16.0 and mine.pending_reports == 2
    mine.update(False)
    assert mine.scale.item() == 8.0
    single = SimpleNamespace(grad_scaler=megatron_scaler())
    solo = share_grad_scaler(single)
    solo.update(True)  # one sub-optimizer: every update applies
    assert single.grad_scaler is solo and solo.scale.item() == 4.0
    constant = SimpleNamespace(grad_scaler=SimpleNamespace(scale=torch.tensor([4096.0])))
    as_constant = share_grad_scaler(SimpleNamespace(chained_optimizers=[constant]))
    assert isinstance(as_constant, ConstantGradScaler) and as_constant.scale.item() == 4096.0


def test_share_errors() -> None:
    with pytest.raises(TypeError, match=r"optimizer must be a Megatron optimizer .* got int"):
        share_grad_scaler(3)
    chain = SimpleNamespace(chained_optimizers=[SimpleNamespace(grad_scaler=megatron_scaler())])
    with pytest.raises(TypeError, match=r"scaler must be a lossscale\.megatron .* got Megatron"):
        share_grad_scaler(chain, megatron_scaler())  # type: ignore[arg-type]
    assert isinstance(chain.chained_optimizers[0].grad_scaler, MegatronDynamicPort)  # unchanged
    with pytest.raises(ValueError, match="no sub-optimizer of optimizer has a grad_scaler"):
        share_grad_scaler(SimpleNamespace(chained_optimizers=[SimpleNamespace(grad_scaler=None)]))


def test_share_walks_a_mimo_optimizer_and_checks_the_process_group() -> None:
    a, b = (SimpleNamespace(grad_scaler=megatron_scaler()) for _ in range(2))
    shared = share_grad_scaler(SimpleNamespace(_active_optimizers=[a, b], optimizer=None))
    assert a.grad_scaler is b.grad_scaler is shared
    with pytest.raises(TypeError, match=r"process_group must be a torch\.distributed process"):
        share_grad_scaler(SimpleNamespace(_active_optimizers=[a]), process_group="world")
    with pytest.raises(ValueError, match="this rank would never take part in the agreement"):
        share_grad_scaler(
            SimpleNamespace(_active_optimizers=[]),
            shared,
            process_group=dist.ProcessGroup(dist.HashStore(), 0, 1),  # never used
        )


def test_checkpoint_through_the_chained_state_dict() -> None:
    """Megatron saves the scaler in every sub-optimizer's state (L1133-1134) and loads it back
    through each (L1208-1213): a resume continues bit for bit, and a checkpoint written by
    Megatron's own diverged scalers loads (the last sub-optimizer's state wins)."""
    model = Model(lossscale_scaler)
    share_grad_scaler(model.optimizer)
    model.train_step([INF, 1.0, 1.0], [1.0, 1.0])
    model.train_step([1.0, 1.0, 1.0], [1.0, 1.0])
    saved = model.optimizer.state_dict()
    assert [s["grad_scaler"]["scale"].item() for s in saved] == [4.0, 4.0]
    resumed = Model(lossscale_scaler)
    share_grad_scaler(resumed.optimizer)
    resumed.optimizer.load_state_dict(saved)
    for x in ([1.0, INF, 1.0], [1.0, 1.0, 1.0], [2.0, 1.0, 1.0]):
        model.train_step(x, [1.0, 1.0])
        resumed.train_step(x, [1.0, 1.0])
        assert resumed.scales() == model.scales()
        assert resumed.optimizer.chained_optimizers[0].grad_scaler.state_dict().keys() == {
            "scale",
            "growth_tracker",
            "hysteresis_tracker",
        }
    theirs = Model(megatron_scaler)
    theirs.train_step([INF, 1.0, 1.0], [1.0, 1.0])
    assert theirs.scales() == [4.0, 8.0]
    from_megatron = Model(lossscale_scaler)
    share_grad_scaler(from_megatron.optimizer)
    from_megatron.optimizer.load_state_dict(theirs.optimizer.state_dict())
    assert from_megatron.scales() == [8.0, 8.0]


def test_stall_alarm_counts_steps_not_reports() -> None:
    def at_floor() -> DynamicGradScaler:
        return DynamicGradScaler(1.0, 1.0, 2.0, 0.5, 1000, 1, stall_steps=3, device="cpu")

    model = Model(at_floor)
    share_grad_scaler(model.optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.train_step([INF, 1.0, 1.0], [INF, 1.0])
        assert not caught  # 2 steps, 4 reports
        for _ in range(4):
            model.train_step([INF, 1.0, 1.0], [1.0, 1.0])
    assert [w.category for w in caught] == [LossScaleStalledWarning]


# -- two ranks ---------------------------------------------------------------------------------

STEPS = 6
#: (step, rank, sub-optimizer) that overflow: never both ranks, never both sub-optimizers.
OVERFLOWS = {(1, 0, 0), (3, 1, 1), (4, 1, 0)}
#: (step, rank) at which a MIMO module overflows (rank 0 holds the encoder, rank 1 the LLM).
MIMO_OVERFLOWS = {(0, 0), (2, 1), (3, 0)}


def _chained(rank: int, reduce: bool) -> list[list[float]]:
    """Data parallel: each rank overflows in its own steps and sub-optimizers. With Megatron's
    MAX all-reduce of found_inf over the group (optimizer.py L729-733; here the world) the
    shared scalers of both ranks take the same steps; without it they would not."""
    model = Model(lambda: DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 2, 1, device="cpu"), reduce=reduce)
    share_grad_scaler(model.optimizer)
    trace = []
    for step in range(STEPS):
        x_dense = [INF if (step, rank, 0) in OVERFLOWS else 1.0, 1.0, 1.0]
        x_expert = [INF if (step, rank, 1) in OVERFLOWS else 1.0, 1.0]
        model.train_step(x_dense, x_expert)
        trace.append(model.scales())
    return trace


def _mimo(rank: int, scaler: Any, process_group: Any) -> tuple[list[float], list[bool]]:
    """MIMO: one module per rank (its grid is this rank alone, so its own all-reduce is the
    identity: ``reduce=False``), the flag agreed over the world by ``MimoOptimizer.step``."""
    param = torch.zeros(2, requires_grad=True)
    sub = MiniMixedPrecisionOptimizer([param], scaler, reduce=False)
    mimo = MiniMimoOptimizer([sub])
    if process_group is not None:
        share_grad_scaler(mimo, process_group=process_group)
    scales, applied = [], []
    for step in range(5):
        param.grad = None
        x = torch.tensor([INF if (step, rank) in MIMO_OVERFLOWS else 1.0, 1.0])
        mimo.scale_loss((param * x).sum()).sum().backward()
        applied.append(bool(mimo.step()[0]))
        scales.append(float(sub.grad_scaler.scale.item()))
    return scales, applied


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "reduced": _chained(rank, reduce=True),
        "not_reduced": _chained(rank, reduce=False),
        "mimo_megatron": _mimo(rank, MegatronDynamicPort(8.0, 1.0, 2.0, 0.5, 2, 1), None),
        "mimo_shared": _mimo(
            rank, DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 2, 1, device="cpu"), dist.group.WORLD
        ),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_gloo_job(_two_ranks, 2, 240.0, tmp_path_factory.mktemp("megatron"))


def test_two_gloo_ranks_agree_through_megatrons_all_reduce(two_ranks: list[Any]) -> None:
    rank0, rank1 = two_ranks
    # steps 1, 3, 4 overflow somewhere: back off; growth after 2 finite steps in a row
    expected = [[s, s] for s in (8.0, 4.0, 4.0, 2.0, 1.0, 1.0)]
    assert rank0["reduced"] == rank1["reduced"] == expected
    assert rank0["not_reduced"] != rank1["not_reduced"]


def test_mimo_ranks_diverge_with_megatrons_scalers_and_agree_with_a_process_group(
    two_ranks: list[Any],
) -> None:
    """Megatron-Bridge#5591: a module on one rank overflows, its scaler backs off before
    ``MimoOptimizer`` agrees on the flag over the world, the other rank's does not: scales
    ``[4.0, 8.0]`` across the ranks, though both skip the step. With
    ``share_grad_scaler(..., process_group=WORLD)`` the flag is agreed before the one update."""
    (scales0, applied0), (scales1, applied1) = (r["mimo_megatron"] for r in two_ranks)
    assert applied0 == applied1 == [False, True, False, False, True]
    assert [scales0[0], scales1[0]] == [4.0, 8.0]
    assert scales0 == [4.0, 4.0, 8.0, 4.0, 4.0] and scales1 == [8.0, 16.0, 8.0, 8.0, 16.0]
    (scales0, applied0), (scales1, applied1) = (r["mimo_shared"] for r in two_ranks)
    assert applied0 == applied1 == [False, True, False, False, True]
    assert scales0 == scales1 == [4.0, 4.0, 2.0, 1.0, 1.0]
