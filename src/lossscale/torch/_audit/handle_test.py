"""The audit's plan on a model (``Float16Audit.apply``, ``PlanHandle``), the model ``audit``
leaves as it found it, and its errors on bad input."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lossscale._testing import one_torch_thread
from lossscale.torch import PlanHandle, audit
from lossscale.torch._audit.handle import keep_float32

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, *, gain: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.inner(x) * gain))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.block = Block()
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.head(self.block(h, gain=torch.ones((), device=x.device, dtype=h.dtype)))


def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The mean squared output, the batch cast to the model's dtype (a ``.half()`` model's)."""
    return model(x.to(model.first.weight.dtype)).float().pow(2).mean()


def _snapshot(model: torch.nn.Module) -> dict[str, Any]:
    return {
        "params": {n: (p.detach().clone(), p.dtype, p.device) for n, p in model.named_parameters()},
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        },
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "training": {n: m.training for n, m in model.named_modules()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "hooks": {
            n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for n, m in model.named_modules()
        },
        "forward": {n: "forward" in vars(m) for n, m in model.named_modules()},
        "rng": torch.get_rng_state(),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("training", "requires_grad", "hooks", "forward"):
        assert a[key] == b[key], key
    for n, (value, dtype, device) in a["params"].items():
        assert torch.equal(value, b["params"][n][0]) and (dtype, device) == b["params"][n][1:]
    for n, g in a["grads"].items():
        assert (g is None) == (b["grads"][n] is None) and (
            g is None or torch.equal(g, b["grads"][n])
        )
    for n, value in a["buffers"].items():
        assert torch.equal(value, b["buffers"][n]), n
    assert torch.equal(a["rng"], b["rng"])


def _user_model() -> Net:
    torch.manual_seed(0)
    model = Net()
    model.train()
    model.block.drop.eval()  # a flag the audit must leave as it is
    model.first.bias.requires_grad_(False)
    loss_fn(model, torch.randn(4, 8)).backward()  # .grad the audit must leave as it is
    model.head.register_forward_hook(lambda m, a, out: None)
    return model


@pytest.mark.parametrize("mode", ["autocast", "half"])
def test_the_model_is_left_as_it_was(mode: str) -> None:
    model = _user_model()
    batches = [torch.randn(4, 8), torch.randn(4, 8)]
    before = _snapshot(model)
    result = audit(model, loss_fn, batches, mode=mode)
    assert result.verified is True
    _same(before, _snapshot(model))


@pytest.mark.parametrize("mode", ["autocast", "half"])
def test_a_loss_fn_that_raises_propagates_and_leaves_the_model(mode: str) -> None:
    model = _user_model()
    before = _snapshot(model)
    calls = {"n": 0}

    def failing(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyError("the user's bug")
        return loss_fn(m, x)

    batch = torch.randn(4, 8)
    before = _snapshot(model)
    with pytest.raises(KeyError, match="the user's bug"):
        audit(model, failing, [batch], mode=mode)
    assert not torch.is_autocast_enabled("cpu")
    _same(before, _snapshot(model))


def _integer_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.table = torch.nn.Parameter(torch.arange(4), requires_grad=False)
    return model


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"batches": []}, ValueError, "batches"),
        ({"batches": 3}, TypeError, "batches"),
        ({"mode": "bfloat16"}, ValueError, "mode"),
        ({"mode": None}, TypeError, "mode"),
        ({"underflow": 1.0}, ValueError, "underflow"),
        ({"underflow": "0.1"}, TypeError, "underflow"),
        ({"loss_fn": "mse"}, TypeError, "loss_fn"),
        ({"loss_fn": lambda m, x: m(x)}, ValueError, "loss_fn must return a scalar"),
        ({"loss_fn": lambda m, x: m(x).sum().long()}, TypeError, "floating"),
        ({"loss_fn": lambda m, x: float(m(x).detach().sum())}, TypeError, "torch.Tensor"),
        ({"model": "net"}, TypeError, "model"),
        ({"model": _integer_model()}, ValueError, "floating param"),
        ({"model": torch.nn.ReLU()}, ValueError, "floating param"),
        ({"device": "gpu0"}, ValueError, "device"),
        ({"verify": 1}, TypeError, "verify"),
        ({"report": "yes"}, TypeError, "report"),
    ],
)
def test_bad_input_is_named_and_changes_nothing(
    kwargs: dict[str, Any], error: type[Exception], names: str
) -> None:
    model = _user_model()
    args: dict[str, Any] = {"model": model, "loss_fn": loss_fn, "batches": [torch.randn(4, 8)]}
    before = _snapshot(model)
    args.update(kwargs)
    with pytest.raises(error, match=names):
        audit(args.pop("model"), args.pop("loss_fn"), args.pop("batches"), **args)
    _same(before, _snapshot(model))


def test_a_kept_module_runs_in_float32_under_autocast_and_comes_back() -> None:
    torch.manual_seed(0)
    model = Net().eval()  # no running statistics move: the state dict must not either
    x = torch.randn(4, 8)
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    seen: list[torch.dtype] = []
    model.block.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(args[0].dtype), with_kwargs=True
    )
    model.block.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    handle = keep_float32(model, ("block",), "autocast")
    assert isinstance(handle, PlanHandle) and "live" in repr(handle)
    with torch.autocast("cpu", dtype=torch.float16):
        inner: list[torch.dtype] = []
        h = model.block.inner.register_forward_hook(lambda m, a, out: inner.append(out.dtype))
        model(x).sum().backward()
        h.remove()
    # the user's hooks see what the caller gives and gets; inside, float32
    assert seen == [torch.float16, torch.float32] and inner == [torch.float32]
    assert [n for n, _ in model.named_parameters()] == names
    assert all(torch.equal(keys[k], v) for k, v in model.state_dict().items())
    assert keys.keys() == model.state_dict().keys()
    assert torch.is_autocast_enabled("cpu") is False
    with pytest.raises(ValueError, match="already kept"):
        keep_float32(model, ("block",), "autocast")
    handle.remove()
    handle.remove()  # a second call does nothing
    assert "removed" in repr(handle)
    with torch.autocast("cpu", dtype=torch.float16):
        inner = []
        h = model.block.inner.register_forward_hook(lambda m, a, out: inner.append(out.dtype))
        model(x)
        h.remove()
    assert inner == [torch.float16]  # the plan is off


def test_a_kept_module_that_raises_leaves_autocast_on() -> None:
    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Boom())
    with keep_float32(model, ("1",), "autocast"), torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(1, 2))
        assert torch.is_autocast_enabled("cpu")


def test_half_mode_keeps_float32_parameters_and_hands_back_the_callers_dtype() -> None:
    torch.manual_seed(0)
    model = Net().half()
    x = torch.randn(4, 8).half()
    before = {n: p.clone() for n, p in model.named_parameters()}
    weight = model.block.inner.weight
    with keep_float32(model, ("block",), "half"):
        assert model.block.inner.weight is weight and weight.dtype == torch.float32
        assert model.first.weight.dtype == torch.float16
        out = model.block(model.first(x), gain=torch.ones((), dtype=torch.float16))
        assert out.dtype == torch.float16
        assert torch.equal(weight.half(), before["block.inner.weight"])
        model(x).float().sum().backward()
        assert weight.grad is not None and weight.grad.dtype == torch.float32
    assert weight.dtype == torch.float16 and weight.grad is not None
    assert weight.grad.dtype == torch.float16
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_unknown_modules_are_refused_and_nothing_changes() -> None:
    model = Net()
    with pytest.raises(ValueError, match=r"'block\.missing'"):
        keep_float32(model, ("block", "block.missing"), "autocast")
    assert not model.block._forward_pre_hooks and not model.block._forward_hooks
    # the same module can be kept again once the refusal left nothing behind
    keep_float32(model, ("block",), "autocast").remove()


def test_apply_checks_its_argument_and_a_copy_of_the_model_runs_the_plan() -> None:
    model = _user_model()
    result = audit(model, loss_fn, [torch.randn(4, 8)], verify=False)
    assert result.verified is None and "not run" in str(result)
    with pytest.raises(TypeError, match="model"):
        result.apply("net")  # type: ignore[arg-type]
    with keep_float32(model, ("block",), "autocast"):
        twin = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.float16):
        inner: list[torch.dtype] = []
        twin.block.inner.register_forward_hook(lambda m, a, out: inner.append(out.dtype))
        twin(torch.randn(4, 8))
    assert inner == [torch.float32]


def test_every_run_of_a_batch_draws_the_same_dropout_masks() -> None:
    """The float32 and float16 runs of a batch start from one RNG state: with dropout on,
    an entry zeroed by another mask would count as underflow and no scale would fit."""
    torch.manual_seed(0)
    model = Net().train()  # dropout 0.5 on
    model.block.norm.eval()  # (batch norm over 2 rows would zero the biases' gradients)
    result = audit(model, loss_fn, [torch.randn(2, 8) for _ in range(4)], report=False)
    assert result.scale_range is not None and result.scale_range[0] == 1.0
    assert result.verified is True
