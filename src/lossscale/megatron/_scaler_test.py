"""``DynamicGradScaler`` and ``ConstantGradScaler`` against a port of Megatron-core's, on torch.

:class:`MegatronDynamicPort` is Megatron-core 0.19.2's ``megatron/core/optimizer/grad_scaler.py``
(``MegatronGradScaler.__init__`` / ``scale`` / ``inv_scale`` L17-28, ``DynamicGradScaler``
L84-165), rewritten here with torch ops on one-element float32 tensors exactly as Megatron keeps
them, with one change: ``device=`` where Megatron hard-codes ``'cuda'`` (L20, L111, L114, L117,
L163), so that it runs on the CPU. megatron-core itself is not installed (it needs Python >= 3.12
and triton). ``core/_hysteresis_test.py`` checks the rule against a NumPy port of the same code;
here the oracle is torch's float32 arithmetic, for any factors Megatron accepts.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

from lossscale._testing import torch_devices
from lossscale.core import FLOAT32_MAX, LossScaleStalledError, LossScaleStalledWarning
from lossscale.megatron import ConstantGradScaler, DynamicGradScaler
from lossscale.megatron._scale import default_device
from lossscale.megatron._testing import MegatronDynamicPort

DEVICES = torch_devices()


#: (growth_factor, backoff_factor): Megatron's, exact in float32, and ones float32 cannot hold
#: (where a float64 product rounded to float32, torch GradScaler's arithmetic, would differ).
FACTORS = [(2.0, 0.5), (1.5, 0.75), (4.0, 0.25), (1.1, 0.3), (1.7, 0.9), (3.3, 0.61)]


def random_case(seed: int) -> tuple[dict[str, Any], list[bool]]:
    """Megatron's constructor arguments and a sequence of found_inf flags, with overflow bursts
    (floor hits) and long finite stretches (growths)."""
    rng = np.random.default_rng(seed)
    growth, backoff = FACTORS[seed % len(FACTORS)]
    kwargs = {
        "initial_scale": float(rng.choice([1.0, 3.0, 2.0**10, 12345.678, 2.0**24])),
        "min_scale": float(rng.choice([1.0, 0.5, 0.37])),
        "growth_factor": growth,
        "backoff_factor": backoff,
        "growth_interval": int(rng.integers(1, 6)),
        "hysteresis": int(rng.integers(1, 5)),
    }
    p_overflow = float(rng.choice([0.05, 0.3, 0.6, 0.9]))
    return kwargs, [bool(x) for x in rng.random(400) < p_overflow]


def assert_same(ours: DynamicGradScaler, port: MegatronDynamicPort) -> None:
    """The same scale and reciprocal, bit for bit, and the same trackers (Megatron's hysteresis
    tracker at or below 0 is lossscale's 1: both back off on the next non-finite step)."""
    assert torch.equal(ours.scale, port.scale), (ours.scale, port.scale)
    assert ours.scale.dtype == torch.float32 and ours.scale.shape == (1,)
    assert torch.equal(ours.inv_scale, port.inv_scale)
    state, theirs = ours.state_dict(), port.state_dict()
    assert state["growth_tracker"] == theirs["growth_tracker"]
    assert state["hysteresis_tracker"] == max(theirs["hysteresis_tracker"], 1)


# -- the rule, bit for bit --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(18))
def test_bit_identical_to_megatron(seed: int, device: str) -> None:
    kwargs, flags = random_case(seed)
    ours = DynamicGradScaler(**kwargs, device=device)
    port = MegatronDynamicPort(**kwargs, device=device)
    assert ours.scale.device.type == device and port.scale.device.type == device
    assert_same(ours, port)
    for found_inf in flags:
        ours.update(found_inf)
        port.update(found_inf)
        if not port.scale.isfinite().all() or port.scale.item() > FLOAT32_MAX:
            break  # Megatron's scale overflowed float32 (no ceiling): lossscale refuses that
        assert_same(ours, port)
    else:
        return
    assert ours.scale.item() <= FLOAT32_MAX


def test_factors_float32_cannot_hold_use_float32_products() -> None:
    """A float64 product rounded to float32 (torch GradScaler's arithmetic) would differ here:
    the test above can tell the two apart."""
    scale, factor = np.float32(3.0), 0.3
    assert np.float32(np.float64(scale) * factor) != scale * np.float32(factor)
    ours = DynamicGradScaler(float(scale), 0.1, 1.1, factor, 5, 1, device="cpu")
    port = MegatronDynamicPort(float(scale), 0.1, 1.1, factor, 5, 1)
    ours.update(True)
    port.update(True)
    assert torch.equal(ours.scale, port.scale)
    assert ours.scale.item() == float(scale * np.float32(factor))


def test_ceiling_refuses_growth_where_megatron_grows() -> None:
    ours = DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 1, 2, max_scale=16.0, device="cpu")
    port = MegatronDynamicPort(8.0, 1.0, 2.0, 0.5, 1, 2)
    for _ in range(3):
        ours.update(False)
        port.update(False)
    assert ours.scale.item() == 16.0 and port.scale.item() == 64.0
    assert ours.state_dict()["growth_tracker"] == 0  # the refused growth still resets


def test_megatron_defaults_and_argument_order() -> None:
    scaler = DynamicGradScaler(device="cpu")  # get_megatron_optimizer's, default OptimizerConfig
    assert scaler.scale.item() == 2.0**32
    assert (scaler.min_scale.item(), scaler.growth_factor.item()) == (1.0, 2.0)
    assert (scaler.backoff_factor.item(), scaler.growth_interval, scaler.hysteresis) == (
        0.5,
        1000,
        2,
    )
    positional = DynamicGradScaler(64.0, 2.0, 1.5, 0.75, 7, 3, device="cpu")
    assert positional.min_scale.item() == 2.0 and positional.growth_interval == 7
    assert positional.growth_factor.item() == 1.5 and positional.backoff_factor.item() == 0.75
    assert positional.hysteresis == 3 and positional.min_scale.dtype == torch.float32
    assert positional.max_scale == FLOAT32_MAX and positional.stall_steps == 1000
    assert positional.rule.hysteresis_refill == "on_growth"
    with pytest.raises(TypeError):
        DynamicGradScaler(64.0, 2.0, 1.5, 0.75, 7, 3, 1e6)  # type: ignore[misc]
    # Megatron-LM parses --loss-scale-window as a float and passes it on
    assert DynamicGradScaler(8.0, growth_interval=1000.0, device="cpu").growth_interval == 1000
    assert "growth_interval=7" in repr(positional)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"initial_scale": 0.0}, ValueError, "initial_scale must be finite and > 0, got 0.0"),
        ({"initial_scale": float("inf")}, ValueError, "initial_scale"),
        ({"initial_scale": "8"}, TypeError, "initial_scale"),
        ({"initial_scale": 0.5}, ValueError, "initial_scale=0.5 must not be below min_scale=1.0"),
        ({"min_scale": -1.0}, ValueError, "min_scale must be finite and > 0, got -1.0"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor must be finite and > 1, got 1.0"),
        ({"growth_factor": 1.00000001}, ValueError, "growth_factor=1.00000001 rounds to 1"),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor must be > 0 and < 1, got 1.0"),
        ({"backoff_factor": None}, TypeError, "backoff_factor must be a real number"),
        ({"growth_interval": 0}, ValueError, "growth_interval must be an integer >= 1, got 0"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval must be an integer"),
        ({"hysteresis": True}, TypeError, "hysteresis must be an integer"),
        ({"hysteresis": 0}, ValueError, "hysteresis must be an integer >= 1, got 0"),
        ({"max_scale": 4.0}, ValueError, "initial_scale=8.0 exceeds max_scale=4.0"),
        ({"stall_steps": 0}, ValueError, "stall_steps must be an integer >= 1, got 0"),
        ({"on_stall": "log"}, ValueError, "on_stall must be 'warn' or 'raise', got 'log'"),
        ({"device": "nowhere"}, ValueError, "device='nowhere' is not a device"),
        ({"device": 1.5}, TypeError, "device must be a torch.device"),
    ],
)
def test_bad_arguments_name_the_argument(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match.replace("(", r"\(").replace("[", r"\[")):
        DynamicGradScaler(**{"initial_scale": 8.0, "device": "cpu", **kwargs})


def test_default_device_is_cuda_current_device_else_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device(None) == torch.device("cpu")
    assert DynamicGradScaler(8.0).scale.device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert default_device(None) == torch.device("cuda", 3)
    assert default_device("cpu") == torch.device("cpu")
    assert default_device(torch.device("meta")) == torch.device("meta")


# -- update -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "found"),
    [
        (True, True),
        (np.bool_(False), False),
        (torch.tensor([1.0]), True),  # Megatron's found_inf tensor itself
        (torch.tensor([0.0]), False),
        (torch.tensor(True), True),
        (torch.tensor([float("nan")]), True),
        (torch.tensor([0], dtype=torch.int32), False),
    ],
)
def test_update_takes_a_bool_or_a_one_element_tensor(flag: Any, found: bool) -> None:
    scaler = DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 1, 1, device="cpu")
    scaler.update(flag)
    assert scaler.scale.item() == (4.0 if found else 16.0)


@pytest.mark.parametrize(
    ("flag", "error", "match"),
    [
        (1, TypeError, "found_inf must be a bool or a one-element tensor, got 1 of type int"),
        (None, TypeError, "found_inf must be a bool"),
        (torch.ones(2), ValueError, r"found_inf must be one flag for the step, got .* \(2,\)"),
    ],
)
def test_bad_flag_changes_nothing(flag: Any, error: type[Exception], match: str) -> None:
    for scaler in (
        DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 1, 1, device="cpu"),
        ConstantGradScaler(8.0, device="cpu"),
    ):
        before = scaler.state_dict()
        with pytest.raises(error, match=match):
            scaler.update(flag)
        assert str(scaler.state_dict()) == str(before) and scaler.scale.item() == 8.0


def test_scale_tensor_is_replaced_not_modified() -> None:
    scaler = DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 1000, 1, device="cpu")
    scale, inv = scaler.scale, scaler.inv_scale
    assert scaler.inv_scale is inv  # cached per scale
    state = scaler.state_dict()
    scaler.update(False)  # no change: the same tensors
    assert scaler.scale is scale and scaler.inv_scale is inv
    scaler.update(True)
    assert scale.item() == 8.0 and inv.item() == 0.125 and state["scale"].item() == 8.0
    assert scaler.scale.item() == 4.0 and scaler.inv_scale.item() == 0.25
    state["scale"].mul_(3)  # the state dict's scale is a copy
    assert scaler.scale.item() == 4.0


# -- state dicts, both ways -------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_state_dict_round_trips_with_megatron(seed: int) -> None:
    """Megatron's state (trackers below 0 included) loads here and continues as Megatron does;
    this class's state loads into Megatron's and continues as this class does."""
    kwargs, flags = random_case(100 + seed)
    cut = len(flags) // 3
    port = MegatronDynamicPort(**kwargs)
    for f in flags[:cut]:
        port.update(f)
    ours = DynamicGradScaler(**kwargs, device="cpu")
    ours.load_state_dict(port.state_dict())
    assert_same(ours, port)
    for f in flags[cut : 2 * cut]:
        ours.update(f)
        port.update(f)
    again = MegatronDynamicPort(**kwargs)
    again.load_state_dict(ours.state_dict())
    for f in flags[2 * cut :]:
        ours.update(f)
        port.update(f)
        again.update(f)
        if not port.scale.isfinite().all():
            break  # Megatron's scale overflowed float32 (no ceiling)
        assert torch.equal(again.scale, port.scale)
        assert_same(ours, port)


def test_megatron_trackers_below_zero_load_as_one() -> None:
    port = MegatronDynamicPort(2.0**10, 1.0, 2.0, 0.5, 1000, 2)
    for _ in range(12):
        port.update(True)
    assert port.state_dict()["hysteresis_tracker"] == -10
    ours = DynamicGradScaler(2.0**10, 1.0, 2.0, 0.5, 1000, 2, device="cpu")
    ours.load_state_dict(port.state_dict())
    assert ours.state_dict()["hysteresis_tracker"] == 1
    ours.update(True)
    port.update(True)
    assert_same(ours, port)


GOOD = {"scale": torch.tensor([64.0]), "growth_tracker": 2, "hysteresis_tracker": 1}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"scale": None}, "missing key 'scale'"),
        ({"growth_tracker": None}, "missing key 'growth_tracker'"),
        ({"extra": 1}, r"unknown keys \['extra'\]"),
        ({"scale": torch.tensor([float("inf")])}, r"state_dict\['scale'\] must be finite"),
        ({"scale": torch.tensor([0.0])}, r"state_dict\['scale'\] must be finite and > 0"),
        ({"scale": torch.tensor([1e30])}, r"state_dict\['scale'\]=1.00.*e\+30 exceeds max_scale"),
        ({"scale": torch.ones(2)}, r"state_dict\['scale'\] must be a one-element"),
        ({"scale": "64"}, r"state_dict\['scale'\] must be a real number"),
        ({"growth_tracker": 5}, r"state_dict\['growth_tracker'\]=5 must lie in \[0, "),
        ({"growth_tracker": -1}, r"state_dict\['growth_tracker'\]=-1 must lie in"),
        ({"growth_tracker": 1.0}, r"state_dict\['growth_tracker'\] must be an integer"),
        ({"hysteresis_tracker": True}, r"state_dict\['hysteresis_tracker'\] must be an integer"),
        ({"hysteresis_tracker": 4}, r"state_dict\['hysteresis_tracker'\]=4 exceeds hysteresis=3"),
    ],
)
def test_bad_state_dict_names_the_key_and_changes_nothing(
    change: dict[str, Any], match: str
) -> None:
    scaler = DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 5, 3, max_scale=1e20, device="cpu")
    scaler.update(True)
    before = scaler.state_dict()
    state = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        scaler.load_state_dict(state)
    assert str(scaler.state_dict()) == str(before)


def test_state_dict_accepts_tensor_counters_and_a_scale_number() -> None:
    scaler = DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 5, 3, device="cpu")
    scaler.load_state_dict(
        {"scale": 0.25, "growth_tracker": torch.tensor(4), "hysteresis_tracker": np.int64(2)}
    )
    assert scaler.state_dict()["scale"].item() == 0.25  # below the floor: allowed
    scaler.update(False)
    assert scaler.scale.item() == 0.5
    with pytest.raises(TypeError, match="state_dict must be a dict, got list"):
        scaler.load_state_dict([])  # type: ignore[arg-type]


# -- the stall alarm --------------------------------------------------------------------------


def stall_warnings(scaler: DynamicGradScaler, flags: list[bool]) -> list[int]:
    """The steps (0-based) at which a stall warning came."""
    out = []
    for step, f in enumerate(flags):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.update(f)
        assert all(w.category is LossScaleStalledWarning for w in caught)
        out.extend([step] * len(caught))
    return out


def test_stall_alarm_warns_once_per_stall() -> None:
    scaler = DynamicGradScaler(2.0, 1.0, 2.0, 0.5, 1000, 1, stall_steps=3, device="cpu")
    # step 0 backs off to the floor (not counted); 1, 2, 3 are skipped at the floor; the
    # finite step 8 re-arms the alarm; 9, 10, 11 are the next stall
    flags = [True] * 8 + [False] + [True] * 4
    assert stall_warnings(scaler, flags) == [3, 11]


def test_stall_alarm_is_silent_in_a_healthy_run_and_when_off() -> None:
    rng = np.random.default_rng(0)
    flags = [bool(x) for x in rng.random(5000) < 0.01]
    scaler = DynamicGradScaler(2.0**16, 1.0, 2.0, 0.5, 200, 2, stall_steps=50, device="cpu")
    assert stall_warnings(scaler, flags) == []
    off = DynamicGradScaler(1.0, 1.0, 2.0, 0.5, 1000, 1, stall_steps=None, device="cpu")
    assert stall_warnings(off, [True] * 3000) == []


def test_stall_alarm_raises_when_asked() -> None:
    scaler = DynamicGradScaler(1.0, 1.0, 2.0, 0.5, 10, 1, stall_steps=2, on_stall="raise")
    scaler.update(True)
    with pytest.raises(LossScaleStalledError, match="the last 2 steps were all skipped"):
        scaler.update(True)


# -- ConstantGradScaler -----------------------------------------------------------------------


def test_constant_scaler_is_megatrons() -> None:
    scaler = ConstantGradScaler(3.0, device="cpu")
    port = MegatronDynamicPort(3.0, 1.0, 2.0, 0.5, 1, 1)  # its scale and inv_scale (L17-28)
    for f in (True, False, torch.tensor([1.0])):
        scaler.update(f)
    assert torch.equal(scaler.scale, port.scale) and torch.equal(scaler.inv_scale, port.inv_scale)
    assert scaler.state_dict() == {}
    scaler.load_state_dict({})
    with pytest.raises(ValueError, match=r"state_dict has keys \['growth_tracker', 'hysteresis"):
        scaler.load_state_dict(GOOD)
    with pytest.raises(ValueError, match="initial_scale must be finite and > 0, got -2"):
        ConstantGradScaler(-2)
    assert repr(scaler) == "ConstantGradScaler(3.0, device='cpu')"
