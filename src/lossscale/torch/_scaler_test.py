"""``lossscale.torch.GradScaler`` side by side with ``torch.amp.GradScaler`` (issue 16)."""

from __future__ import annotations

import inspect
import warnings
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from lossscale._testing import require_fused
from lossscale.core import LossScaleStalledError, LossScaleStalledWarning
from lossscale.torch import GradScaler, LossScaleOptimizer
from lossscale.torch._state import DisabledScale

# fused optimizers: both the CPU's host decision and a GPU's device decision (conftest)
pytestmark = pytest.mark.usefixtures("fused_decision")

INF = float("inf")


# -- the interface ------------------------------------------------------------------------------


def _public_methods(cls: type) -> dict[str, Any]:
    return {
        name: member
        for name, member in vars(cls).items()
        if not name.startswith("_") and callable(member)
    }


def test_every_public_method_of_torch_grad_scaler_exists_with_torch_parameters() -> None:
    theirs = _public_methods(torch.amp.GradScaler)
    assert len(theirs) >= 14  # scale, unscale_, step, update, get_scale, getters/setters, ...
    for name, method in theirs.items():
        ours = getattr(GradScaler, name, None)
        assert ours is not None, f"GradScaler lacks {name}"
        want = list(inspect.signature(method).parameters.values())
        have = list(inspect.signature(ours).parameters.values())
        assert [(p.name, p.kind, p.default) for p in have] == [
            (p.name, p.kind, p.default) for p in want
        ], name


def test_constructor_has_torch_parameters_then_keyword_only_extensions() -> None:
    want = list(inspect.signature(torch.amp.GradScaler).parameters.values())
    have = list(inspect.signature(GradScaler).parameters.values())
    assert [(p.name, p.default) for p in have[: len(want)]] == [(p.name, p.default) for p in want]
    extra = have[len(want) :]
    assert {p.name for p in extra} >= {"min_loss_scale", "max_loss_scale", "hysteresis"}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)
    assert {p.name: p.default for p in extra}["min_loss_scale"] == 1.0


# -- side by side with torch.amp.GradScaler -------------------------------------------------------


def _train(
    make_scaler: Callable[[], Any],
    overflow_at: set[int],
    steps: int = 40,
    make_opt: Callable[[Any], torch.optim.Optimizer] | None = None,
    clip: bool = True,
    device: str = "cpu",
) -> tuple[list[torch.Tensor], list[float], dict[str, Any]]:
    """A small float16-autocast run on ``device`` with infs injected at ``overflow_at``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model.to(device)
    opt = (make_opt or (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)))(model.parameters())
    scaler = make_scaler()
    scales = []
    for i in range(steps):
        x = torch.randn(16, 6).to(device)  # drawn on the CPU: the same data on every device
        with torch.autocast(device, dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if i in overflow_at:
            model[0].weight.grad[1, 2] = INF if i % 2 else float("nan")
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], scales, scaler.state_dict()


OVERFLOWS = {2, 3, 9, 17, 18, 19, 30}


@pytest.mark.parametrize(
    ("growth", "backoff", "interval"),
    [(2.0, 0.5, 3), (2.0, 0.5, 1), (1.5, 0.75, 2), (4.0, 0.125, 4)],
)
@pytest.mark.parametrize("clip", [True, False])
def test_same_weights_and_scales_as_torch(
    growth: float, backoff: float, interval: int, clip: bool, device: str
) -> None:
    kwargs = {
        "init_scale": 2.0**16,
        "growth_factor": growth,
        "backoff_factor": backoff,
        "growth_interval": interval,
    }
    theirs = _train(
        lambda: torch.amp.GradScaler(device, **kwargs), OVERFLOWS, clip=clip, device=device
    )
    ours = _train(lambda: GradScaler(device, **kwargs), OVERFLOWS, clip=clip, device=device)
    assert ours[1] == theirs[1]
    assert len(set(ours[1])) > 2  # the scale both grew and backed off
    for a, b in zip(ours[0], theirs[0], strict=True):
        assert torch.equal(a, b)
    torch_keys = {k: v for k, v in ours[2].items() if k != "lossscale"}
    assert torch_keys == theirs[2]


def test_scale_trajectory_matches_torch_over_random_sequences(device: str) -> None:
    rng = np.random.default_rng(1)
    for trial in range(5):
        overflow = {int(i) for i in np.flatnonzero(rng.random(120) < 0.3)}
        interval = int(rng.integers(1, 5))
        theirs = _train(
            lambda i=interval: torch.amp.GradScaler(device, 2.0**10, growth_interval=i),
            overflow,
            120,
            clip=False,
            device=device,
        )
        ours = _train(
            lambda i=interval: GradScaler(
                device, 2.0**10, growth_interval=i, min_loss_scale=2.0**-100
            ),
            overflow,
            120,
            clip=False,
            device=device,
        )
        assert ours[1] == theirs[1], trial


def test_fused_adam_same_weights_as_torch_and_skips_on_the_device(device: str) -> None:
    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-2, fused=True)

    def train(make_scaler: Callable[[], Any]) -> Any:
        return _train(make_scaler, OVERFLOWS, make_opt=adam, clip=False, device=device)

    theirs = train(lambda: torch.amp.GradScaler(device))
    ours = train(lambda: GradScaler(device))
    assert ours[1] == theirs[1]
    for a, b in zip(ours[0], theirs[0], strict=True):
        assert torch.equal(a, b)


FUSED = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("init_scale", [2.0**16, 1000.0])
@pytest.mark.parametrize("name", list(FUSED))
def test_every_fused_optimizer_trains_as_under_torch(
    name: str, init_scale: float, fused_decision: str, device: str
) -> None:
    """Decided on the device, the fused kernel unscales (``grad_scale``): torch's arithmetic,
    bit for bit. Stepped as unfused (the CPU; a GPU without ``device_side_skip``), the check
    kernel unscales, ``g * (1 / s)``: the same bits while the scale is a power of two;
    otherwise within the last bit of the update (what torch's GradScaler itself gives an
    unfused optimizer)."""
    require_fused(
        {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad"}[name], device
    )
    kw: dict[str, Any] = {"init_scale": init_scale, "growth_interval": 3}

    def train(make_scaler: Callable[[], Any]) -> Any:
        return _train(make_scaler, OVERFLOWS, 40, FUSED[name], False, device)

    theirs = train(lambda: torch.amp.GradScaler(device, **kw))
    ours = train(lambda: GradScaler(device, **kw))
    assert ours[1] == theirs[1]
    if fused_decision == "device" or init_scale == 2.0**16:
        assert all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0], strict=True))
    else:
        for a, b in zip(ours[0], theirs[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_fused_skipped_step_leaves_params_and_state_bit_identical(device: str) -> None:
    w = torch.nn.Parameter(torch.ones(3, device=device))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    scaler = GradScaler(device, init_scale=8.0)
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    scaler.update()
    before = (w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()})
    w.grad = torch.tensor([1.0, INF, 1.0], device=device)
    scaler.step(opt)
    scaler.update()
    assert torch.equal(w, before[0])
    for key, value in opt.state[w].items():
        assert torch.equal(value, before[1][key]), key
    assert scaler.get_scale() == 4.0 and not bool(scaler.last_step_applied)


def test_floor_where_torch_collapses_to_zero(device: str) -> None:
    theirs = torch.amp.GradScaler(device, init_scale=4.0)
    ours = GradScaler(device, init_scale=4.0)
    w = torch.nn.Parameter(torch.ones(1, device=device))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(200):
        for scaler in (theirs, ours):
            scaler.scale(w.sum())  # creates torch's lazy state
            w.grad = torch.tensor([INF], device=device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", LossScaleStalledWarning)
                scaler.step(opt)
                scaler.update()
    assert theirs.get_scale() == 0.0  # torch's scale is gone for good
    assert ours.get_scale() == 1.0


def test_growth_never_reaches_inf_and_respects_max(device: str) -> None:
    w = torch.nn.Parameter(torch.ones(1, device=device))
    opt = torch.optim.SGD([w], lr=0.0)
    capped = GradScaler(device, init_scale=2.0**120, growth_interval=1)
    bounded = GradScaler(device, init_scale=2.0**10, growth_interval=1, max_loss_scale=2.0**12)
    for _ in range(20):
        for scaler in (capped, bounded):
            scaler.scale(w.sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert capped.get_scale() == 2.0**127
    assert bounded.get_scale() == 2.0**12


def test_several_optimizers_follow_torch(device: str) -> None:
    # F6: each step(opt) skips on its own overflow; update() backs off once if any overflowed
    def run(make: Callable[[], Any]) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        a, b = torch.nn.Linear(3, 3).to(device), torch.nn.Linear(3, 1).to(device)
        opt_a, opt_b = (
            torch.optim.SGD(a.parameters(), lr=0.1),
            torch.optim.SGD(b.parameters(), lr=0.1),
        )
        scaler, scales = make(), []
        for i in range(12):
            loss = b(torch.tanh(a(torch.randn(4, 3).to(device)))).pow(2).mean()
            scaler.scale(loss).backward()
            if i in (2, 5):
                a.weight.grad[0, 0] = INF
            if i == 5:
                b.weight.grad[0, 0] = INF
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            opt_a.zero_grad()
            opt_b.zero_grad()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]

    theirs = run(lambda: torch.amp.GradScaler(device, init_scale=256.0, growth_interval=2))
    ours = run(lambda: GradScaler(device, init_scale=256.0, growth_interval=2))
    assert ours[0] == theirs[0]
    for x, y in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(x, y)


# -- methods ----------------------------------------------------------------------------------


def test_scale_nested_outputs_and_half_losses() -> None:
    scaler = GradScaler("cpu", init_scale=4.0)
    pair = namedtuple("pair", "a b")
    out = scaler.scale(
        {
            "x": [torch.ones(2), (torch.ones(1, dtype=torch.float64),)],
            "y": pair(torch.ones(1), torch.ones(1)),
        }
    )
    assert out["x"][0].tolist() == [4.0, 4.0] and out["x"][1][0].dtype == torch.float64
    assert isinstance(out["y"], pair) and out["y"].b.item() == 4.0
    half = scaler.scale(torch.tensor(60000.0, dtype=torch.float16))
    assert half.dtype == torch.float32 and half.item() == 240000.0  # torch's gives inf
    with pytest.raises(TypeError, match="outputs must be a tensor"):
        scaler.scale([torch.ones(1), 2.0])


def test_step_returns_the_inner_result_or_none_when_skipped() -> None:
    class Returning(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            super().step()
            return "stepped"

    w = torch.nn.Parameter(torch.ones(1))
    opt = Returning([w], lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(w.sum()).backward()
    assert scaler.step(opt) == "stepped"
    scaler.update()
    w.grad = torch.tensor([INF])
    assert scaler.step(opt) is None
    scaler.update()


def test_misuse_raises_as_torch_does() -> None:
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    grad = w.grad.clone()
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    assert torch.equal(w.grad, grad)  # never unscaled twice
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: 0.0)
    with pytest.raises(RuntimeError, match="found no checked gradients"):
        scaler.update()
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        scaler.unscale_("sgd")  # type: ignore[arg-type]


def test_update_with_new_scale_is_validated_and_keeps_the_tracker() -> None:
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=5, max_loss_scale=2.0**20)
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler._get_growth_tracker() == 1
    scaler.update(64.0)
    assert scaler.get_scale() == 64.0 and scaler._get_growth_tracker() == 1
    scaler.update(torch.tensor([32.0]))
    assert scaler.get_scale() == 32.0
    for bad, error in [
        (0.0, ValueError),
        (-1.0, ValueError),
        (float("nan"), ValueError),
        (INF, ValueError),
        (2.0**21, ValueError),
        ("8", TypeError),
        (torch.ones(2), TypeError),
        (torch.tensor(8), TypeError),
    ]:
        with pytest.raises(error, match="new_scale"):
            scaler.update(bad)
        assert scaler.get_scale() == 32.0


def test_factor_getters_and_validated_setters() -> None:
    scaler = GradScaler("cpu", growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (3.0, 0.25)
    assert scaler.get_growth_interval() == 7
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.5)
    scaler.set_growth_interval(2)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (4.0, 0.5)
    assert scaler.get_growth_interval() == 2
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.set_backoff_factor(1.5)
    with pytest.raises(TypeError, match="growth_interval"):
        scaler.set_growth_interval(2.5)  # type: ignore[arg-type]
    assert scaler.get_growth_factor() == 4.0 and scaler.get_growth_interval() == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"growth_factor": 1.0}, ValueError, "growth_factor"),
        ({"growth_factor": "2"}, TypeError, "growth_factor"),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
        ({"growth_interval": 0}, ValueError, "growth_interval"),
        ({"growth_interval": 2.0}, TypeError, "growth_interval"),
        ({"init_scale": 0.0}, ValueError, "init_scale"),
        ({"init_scale": INF}, ValueError, "init_scale"),
        ({"init_scale": 2.0**30, "max_loss_scale": 2.0**20}, ValueError, "init_scale"),
        ({"enabled": "yes"}, TypeError, "enabled"),
        ({"device": 3}, TypeError, "device"),
        ({"device": "not-a-device"}, ValueError, "device"),
        ({"hysteresis": 0}, ValueError, "hysteresis"),
        ({"min_loss_scale": 0.0}, ValueError, "min_loss_scale"),
        ({"stall_steps": 0}, ValueError, "stall_steps"),
        ({"process_group": "world"}, TypeError, "process_group"),
    ],
    ids=repr,
)
def test_bad_arguments_are_named(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(error, match=pattern):
        GradScaler(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_disables_itself_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="CUDA is not available.  ?Disabling"):
        theirs = torch.amp.GradScaler()
    with pytest.warns(UserWarning, match="CUDA is not available. Disabling"):
        ours = GradScaler()
    assert theirs.is_enabled() is ours.is_enabled() is False


def test_disabled_is_an_exact_pass_through() -> None:
    plain = _train(lambda: torch.amp.GradScaler("cpu", enabled=False), set())
    ours = _train(lambda: GradScaler("cpu", enabled=False), set())
    for a, b in zip(ours[0], plain[0], strict=True):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())
    scaler = GradScaler("cpu", enabled=False)
    loss = torch.ones(())
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    assert scaler.state_dict() == {} and not scaler.is_enabled()
    scaler.load_state_dict({"anything": 1})  # a no-op, as torch's
    assert isinstance(scaler._ls, DisabledScale)  # no tensors at all


# -- checkpoints ---------------------------------------------------------------------------------


def test_checkpoints_load_both_ways_and_resume_the_same_run() -> None:
    theirs = _train(lambda: torch.amp.GradScaler("cpu", growth_interval=3), OVERFLOWS)
    ours = _train(lambda: GradScaler("cpu", growth_interval=3), OVERFLOWS)
    into_torch = torch.amp.GradScaler("cpu")
    into_torch.load_state_dict(ours[2])
    assert into_torch.state_dict() == theirs[2]
    into_ours = GradScaler("cpu")
    into_ours.load_state_dict(theirs[2])
    assert {k: v for k, v in into_ours.state_dict().items() if k != "lossscale"} == theirs[2]
    # our own key restores the hysteresis counter and the skip count too
    again = GradScaler("cpu", growth_interval=3)
    again.load_state_dict(ours[2])
    assert again.state_dict() == ours[2] and int(again.skipped_steps) == len(OVERFLOWS)


def test_disabled_state_and_malformed_states_are_clear_errors() -> None:
    empty = torch.amp.GradScaler("cpu", enabled=False).state_dict()
    assert empty == {}
    scaler = GradScaler("cpu", init_scale=8.0)
    with pytest.raises(ValueError, match="saved from a disabled GradScaler"):
        scaler.load_state_dict(empty)
    lso = LossScaleOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    with pytest.raises(ValueError, match="saved from a disabled GradScaler"):
        lso.load_state_dict(empty)  # issue 18 item 8: never a KeyError
    good = GradScaler("cpu").state_dict()
    for key, value, pattern in [
        ("scale", -1.0, "state\\['scale'\\]"),
        ("scale", float("nan"), "state\\['scale'\\]"),
        ("_growth_tracker", -1, "_growth_tracker"),
        ("growth_interval", 0, "growth_interval"),
        ("growth_factor", 0.5, "growth_factor"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            scaler.load_state_dict({**good, key: value})
    missing = {k: v for k, v in good.items() if k != "scale"}
    with pytest.raises(ValueError, match="missing key 'scale'"):
        scaler.load_state_dict(missing)
    assert scaler.get_scale() == 8.0  # nothing changed


# -- lossscale's own -----------------------------------------------------------------------------


def test_last_step_applied_and_skipped_steps_without_sync() -> None:
    _, _, state = _train(lambda: GradScaler("cpu"), OVERFLOWS)
    assert state["lossscale"]["skipped_steps"] == len(OVERFLOWS)
    scaler = GradScaler("cpu")
    assert isinstance(scaler.last_step_applied, torch.Tensor)
    assert isinstance(scaler.skipped_steps, torch.Tensor) and int(scaler.skipped_steps) == 0


def _stall(scaler: GradScaler, steps: int) -> list[str]:
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            scaler.scale(w.sum()).backward()
            w.grad = torch.tensor([INF])
            scaler.step(opt)
            scaler.update()
    return [str(w.message) for w in caught if w.category is LossScaleStalledWarning]


def test_stall_alarm_warns_raises_or_stays_off() -> None:
    messages = _stall(GradScaler("cpu", init_scale=4.0, stall_steps=5), 30)
    assert len(messages) == 1 and "GradScaler" in messages[0] and "last 5 steps" in messages[0]
    with pytest.raises(LossScaleStalledError):
        _stall(GradScaler("cpu", init_scale=1.0, stall_steps=3, on_stall="raise"), 10)
    assert _stall(GradScaler("cpu", init_scale=1.0, stall_steps=None), 50) == []
    # the default fires within 1000 consecutive skipped steps at the floor (16 to reach it)
    assert len(_stall(GradScaler("cpu", init_scale=2.0**16), 16 + 1000)) == 1
    assert _stall(GradScaler("cpu", init_scale=2.0**16), 16 + 999) == []


def test_accelerates_private_initialiser_is_harmless() -> None:
    # accelerate's load_state under FSDP2 calls scaler._lazy_init_scale_growth_tracker(_device)
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.load_state_dict({**scaler.state_dict(), "scale": 32.0})
    scaler._lazy_init_scale_growth_tracker(scaler._device)
    assert scaler.get_scale() == 32.0


def test_pickles_between_iterations_as_torch_does() -> None:
    import copy
    import pickle

    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=1)
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="may only be pickled"):
        pickle.dumps(scaler)
    scaler.update()
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.get_scale() == 16.0 and clone.state_dict() == scaler.state_dict()
        clone.scale(w.sum()).backward()
        clone.step(opt)
        clone.update()
        assert clone.get_scale() == 32.0
