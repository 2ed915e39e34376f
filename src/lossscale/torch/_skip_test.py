"""The skip matrix: a skipped step leaves params and every inner state tensor bit-identical.

For every gradient-based optimizer in torch.optim, in its for-loop, foreach and fused variants
(where the class has them on CPU), on the CPU and on CUDA where present (``device``): one
applied step first (so the state exists), a snapshot, then a step with an injected inf/nan
gradient: params and all inner state unchanged bit for bit (values and dtypes), the scale
halved; then a finite step applies.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lossscale._testing import require_fused  # noqa: E402
from lossscale.torch import LossScaleOptimizer  # noqa: E402

# fused optimizers: both the CPU's host decision and a GPU's device decision (conftest)
pytestmark = pytest.mark.usefixtures("fused_decision")

INITIAL = 2.0**10
OPT = torch.optim

# The classes with a ``fused`` implementation on CPU in the torch this suite was written for
# (torch 2.13: on CUDA too, Adagrad included).
FUSED_CLASSES = {"SGD", "Adam", "AdamW", "Adagrad"}
DENSE_CLASSES = {
    "SGD": {"lr": 0.1},
    "SGD-momentum": {"lr": 0.1, "momentum": 0.9},
    "SGD-nesterov": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    "Adam": {"lr": 0.01},
    "Adam-amsgrad": {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01},
    "AdamW": {"lr": 0.01},
    "Adamax": {"lr": 0.01},
    "NAdam": {"lr": 0.01},
    "RAdam": {"lr": 0.01},
    "RMSprop": {"lr": 0.01},
    "RMSprop-centered-momentum": {"lr": 0.01, "momentum": 0.9, "centered": True},
    "Adagrad": {"lr": 0.1},
    "Adadelta": {"lr": 1.0},
    "ASGD": {"lr": 0.01, "t0": 0.0},
    "Rprop": {"lr": 0.01},
    "Adafactor": {"lr": 0.01},
}


def _dense_cases() -> list[Any]:
    cases = []
    for name, kwargs in DENSE_CLASSES.items():
        cls_name = name.split("-")[0]
        variants: list[tuple[str, dict[str, Any]]] = [
            ("for-loop", {"foreach": False}),
            ("foreach", {"foreach": True}),
        ]
        if cls_name in FUSED_CLASSES:
            variants.append(("fused", {"fused": True}))
        for variant, flag in variants:
            cases.append(pytest.param(cls_name, {**kwargs, **flag}, id=f"{name}-{variant}"))
    return cases


DENSE_CASES = _dense_cases()
BAD = [pytest.param(float("inf"), id="inf"), pytest.param(float("nan"), id="nan")]


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list | tuple):
        return type(value)(_snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def _assert_identical(before: Any, after: Any, where: str) -> None:
    """Bit-identical: same types, dtypes, shapes and values (NaN-free inputs)."""
    if isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor), where
        assert before.dtype == after.dtype, where
        assert before.device == after.device, where
        assert torch.equal(before, after), where
    elif isinstance(before, list | tuple):
        assert type(before) is type(after) and len(before) == len(after), where
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            _assert_identical(b, a, f"{where}[{i}]")
    elif isinstance(before, dict):
        assert set(before) == set(after), where
        for key in before:
            _assert_identical(before[key], after[key], f"{where}[{key!r}]")
    else:
        assert type(before) is type(after) and before == after, where


def _inner_state(lso: Any) -> dict[int, Any]:
    params = [p for g in lso.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    return {index[id(p)]: _snapshot(s) for p, s in lso.inner_optimizer.state.items()}


def _live_state(lso: Any) -> dict[int, Any]:
    params = [p for g in lso.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    return {index[id(p)]: dict(s) for p, s in lso.inner_optimizer.state.items()}


def _check_skip_then_apply(
    lso: Any,
    params: list[Any],
    backward: Callable[[float | None], Any],
    fused: bool,
    bad: float,
    expect_state: bool = True,
) -> None:
    """backward(bad): a scaled backward, with ``bad`` injected into one gradient if given."""
    initial = [p.detach().clone() for p in params]
    backward(None)
    lso.step()
    lso.zero_grad()
    assert lso.last_step_applied.item() is True
    assert not all(torch.equal(a, p) for a, p in zip(initial, params, strict=True))
    assert lso._step.fused() is fused  # the fused path (grad_scale/found_inf) is the one tested

    param_snap = [p.detach().clone() for p in params]
    state_snap = _inner_state(lso)
    # (plain SGD keeps no state: then it must stay empty)
    assert bool(state_snap) is expect_state
    backward(bad)
    lso.step()
    assert lso.last_step_applied.item() is False
    assert lso.skipped_steps.item() == 1
    assert lso.loss_scale.item() == INITIAL / 2
    assert lso.dynamic_counter == 0
    for i, (b, p) in enumerate(zip(param_snap, params, strict=True)):
        _assert_identical(b, p.detach(), f"param {i}")
    _assert_identical(state_snap, _live_state(lso), "state")
    lso.zero_grad()

    backward(None)
    lso.step()
    assert lso.last_step_applied.item() is True
    assert lso.loss_scale.item() == INITIAL / 2
    assert lso.dynamic_counter == 1
    assert not all(torch.equal(b, p) for b, p in zip(param_snap, params, strict=True))
    after = _live_state(lso)
    for i, s in state_snap.items():
        if "step" in s:  # the skipped step was not counted
            step = after[i]["step"]
            assert float(step) == float(s["step"]) + 1, f"state[{i}]['step']"


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize(("cls_name", "kwargs"), DENSE_CASES)
def test_skipped_step_is_bit_identical(
    cls_name: str, kwargs: dict[str, Any], bad: float, device: str
) -> None:
    if kwargs.get("fused"):
        require_fused(cls_name, device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    params = list(model.to(device).parameters())
    inner = getattr(OPT, cls_name)(params, **kwargs)
    lso = LossScaleOptimizer(inner, initial_scale=INITIAL, dynamic_growth_steps=1000)
    x = torch.randn(8, 4).to(device)

    def backward(inject: float | None) -> None:
        lso.get_scaled_loss(model(x).pow(2).mean()).backward()
        if inject is not None:
            params[2].grad[1, 0] = inject

    expect_state = not (cls_name == "SGD" and not kwargs.get("momentum"))
    _check_skip_then_apply(lso, params, backward, bool(kwargs.get("fused")), bad, expect_state)


@pytest.mark.parametrize("bad", BAD)
def test_muon_skipped_step_is_bit_identical(bad: float, device: str) -> None:
    # Muon takes 2-d parameters only and has no foreach/fused variants.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(3, 2, bias=False)
    )
    params = list(model.to(device).parameters())
    lso = LossScaleOptimizer(
        OPT.Muon(params, lr=0.01), initial_scale=INITIAL, dynamic_growth_steps=1000
    )
    x = torch.randn(8, 4).to(device)

    def backward(inject: float | None) -> None:
        lso.get_scaled_loss(model(x).pow(2).mean()).backward()
        if inject is not None:
            params[1].grad[1, 0] = inject

    _check_skip_then_apply(lso, params, backward, False, bad)


@pytest.mark.parametrize("bad", BAD)
def test_sparse_adam_skipped_step_is_bit_identical(bad: float, device: str) -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 3, sparse=True).to(device)
    lso = LossScaleOptimizer(
        OPT.SparseAdam(emb.parameters(), lr=0.01), initial_scale=INITIAL, dynamic_growth_steps=1000
    )
    idx = torch.tensor([0, 2, 2, 5], device=device)

    def backward(inject: float | None) -> None:
        lso.get_scaled_loss(emb(idx).pow(2).sum()).backward()
        assert emb.weight.grad.is_sparse
        if inject is not None:
            emb.weight.grad._values()[1, 2] = inject

    _check_skip_then_apply(lso, [emb.weight], backward, False, bad)


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
@pytest.mark.parametrize("bad", BAD)
def test_lbfgs_skipped_step_is_bit_identical(
    bad: float, line_search: str | None, device: str
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).to(device)
    params = list(model.parameters())
    inner = OPT.LBFGS(params, lr=0.5, max_iter=4, line_search_fn=line_search)
    lso = LossScaleOptimizer(inner, initial_scale=INITIAL, dynamic_growth_steps=1000)
    x, y = torch.randn(16, 3).to(device), torch.randn(16, 1).to(device)
    inject: list[float | None] = [None]

    def closure() -> Any:
        lso.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        lso.get_scaled_loss(loss).backward()
        if inject[0] is not None:
            params[0].grad[0, 1] = inject[0]
        return loss

    initial = [p.detach().clone() for p in params]
    lso.step(closure)
    assert lso.last_step_applied.item() is True
    assert not all(torch.equal(a, p) for a, p in zip(initial, params, strict=True))
    param_snap = [p.detach().clone() for p in params]
    state_snap = _inner_state(lso)
    assert state_snap[0]["old_dirs"], "LBFGS kept no history to compare"

    inject[0] = bad
    loss = lso.step(closure)
    assert isinstance(loss, torch.Tensor)  # the closure's value, as torch's LBFGS returns
    assert lso.last_step_applied.item() is False
    assert lso.loss_scale.item() == INITIAL / 2
    for i, (b, p) in enumerate(zip(param_snap, params, strict=True)):
        _assert_identical(b, p.detach(), f"param {i}")
    _assert_identical(state_snap, _live_state(lso), "state")

    inject[0] = None
    lso.step(closure)
    assert lso.last_step_applied.item() is True
    assert not all(torch.equal(b, p) for b, p in zip(param_snap, params, strict=True))


@pytest.mark.parametrize("bad_evaluation", [2, 3])
def test_lbfgs_overflow_during_the_line_search_restores_everything(
    bad_evaluation: int, device: str
) -> None:
    # The first closure evaluation is finite, so the inner LBFGS step runs; a later evaluation
    # inside it overflows: params and the whole state (incl. LBFGS's history lists, which it
    # mutates in place) must come back bit-identical.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).to(device)
    params = list(model.parameters())
    inner = OPT.LBFGS(params, lr=0.5, max_iter=4)
    lso = LossScaleOptimizer(inner, initial_scale=INITIAL, dynamic_growth_steps=1000)
    x, y = torch.randn(16, 3).to(device), torch.randn(16, 1).to(device)
    evaluations = [0]
    bad_at = [0]

    def closure() -> Any:
        lso.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        lso.get_scaled_loss(loss).backward()
        evaluations[0] += 1
        if evaluations[0] == bad_at[0]:
            params[0].grad[0, 0] = float("inf")
        return loss

    lso.step(closure)
    assert lso.last_step_applied.item() is True
    param_snap = [p.detach().clone() for p in params]
    state_snap = _inner_state(lso)
    evaluations[0], bad_at[0] = 0, bad_evaluation
    lso.step(closure)
    assert evaluations[0] >= bad_evaluation  # the inner step did run into the overflow
    assert lso.last_step_applied.item() is False
    assert lso.loss_scale.item() == INITIAL / 2
    for i, (b, p) in enumerate(zip(param_snap, params, strict=True)):
        _assert_identical(b, p.detach(), f"param {i}")
    _assert_identical(state_snap, _live_state(lso), "state")


ALL_GRADIENT_OPTIMIZERS = [
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "ASGD",
    "Rprop",
    "SparseAdam",
    "LBFGS",
    "Adafactor",
    "Muon",
]


def test_the_matrix_covers_every_torch_optim_optimizer() -> None:
    names = {
        name
        for name, obj in vars(OPT).items()
        if isinstance(obj, type) and issubclass(obj, OPT.Optimizer) and obj is not OPT.Optimizer
    }
    # a new optimizer in torch.optim fails this test until it joins the matrix
    assert names == set(ALL_GRADIENT_OPTIMIZERS)


@pytest.mark.parametrize("cls_name", ALL_GRADIENT_OPTIMIZERS)
def test_variant_flags_match_the_matrix(cls_name: str) -> None:
    parameters = inspect.signature(getattr(OPT, cls_name).__init__).parameters
    assert ("fused" in parameters) is (cls_name in FUSED_CLASSES)
    expect_foreach = cls_name not in {"SparseAdam", "LBFGS", "Muon"}
    assert ("foreach" in parameters) is expect_foreach
    if cls_name in FUSED_CLASSES:
        p = torch.nn.Parameter(torch.ones(2))
        inner = getattr(OPT, cls_name)([p], fused=True)  # accepted on CPU
        assert LossScaleOptimizer(inner)._step.fused()
