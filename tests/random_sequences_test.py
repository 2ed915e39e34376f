"""Every front end against its oracle, at the top of float32's range and over random sequences.

Oracles: ``torch.amp.GradScaler`` for lossscale's ``GradScaler`` (its factors, including ones
float32 cannot hold), TensorFlow's ``DynamicLossScale`` for the TensorFlow-named front ends
(the multiplier in float32), and the core rule on NumPy where TensorFlow is absent. The Keras
optimizer's sequences are in ``src/lossscale/keras`` (one backend per process).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from lossscale.core import FLOAT32_MAX

torch = pytest.importorskip("torch")

from lossscale.torch import GradScaler  # noqa: E402

#: scale * 1.1 exceeds the float32 maximum in float64 but rounds to it; likewise * 1.03 in float32
TOP_TORCH = 3.0934759522862973e38
TOP_TF = 3.3037122549124685e38


def _device_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the skip decision on the device, as on a GPU: the rule then runs on tensors."""
    from lossscale.torch import _engine

    monkeypatch.setattr(_engine, "SYNCHRONOUS_DEVICES", frozenset())


def _scaler_scales(scaler: Any, infs: list[bool], fused: bool) -> list[float]:
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0, fused=fused or None)
    out = []
    for bad in infs:
        opt.zero_grad()
        scaler.scale(w.sum()).backward()
        if bad:
            w.grad[0] = float("inf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scaler.step(opt)
        scaler.update()
        out.append(scaler.get_scale())
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["host", "device"])
@pytest.mark.parametrize(
    ("init", "growth", "backoff"),
    [
        (TOP_TORCH, 1.1, 0.5),
        (TOP_TORCH, 1.1, 0.3),
        (TOP_TF, 1.03, 0.5),
        (FLOAT32_MAX / 2, 2.0, 0.5),
    ],
)
def test_gradscaler_growth_at_the_top_of_the_range_is_torchs(
    monkeypatch: pytest.MonkeyPatch, init: float, growth: float, backoff: float, fused: bool
) -> None:
    if fused:
        _device_home(monkeypatch)
    kw = {"init_scale": init, "growth_factor": growth, "backoff_factor": backoff}
    infs = [False, False, True, False, False]
    theirs = _scaler_scales(torch.amp.GradScaler("cpu", growth_interval=1, **kw), infs, fused)
    ours = _scaler_scales(GradScaler("cpu", growth_interval=1, **kw), infs, fused)
    assert ours == theirs


# -- random sequences ------------------------------------------------------------------------
#
# Each case: a gradient dtype, an initial scale (log-uniform over float32's range, or within a
# few growths of its maximum), a growth period, a factor (TensorFlow's multiplier, or
# GradScaler's growth and back-off factors, float32-exact or not) and a sequence of "true"
# gradients (magnitudes 1e-40..1e4, some inf/NaN). Every front end and its oracle see the
# gradients scaled by their own current scale, computed in float64 and rounded to the dtype
# (which overflows, in float16 and bfloat16 especially, as real scaled gradients do); the
# scales must agree bit for bit after every step.

DTYPES = ("float16", "bfloat16", "float32", "float64")
STEPS = 24


class Case:
    def __init__(
        self, rng: np.random.Generator, dtype: str, multiplier: float, backoff: float | None
    ) -> None:
        self.dtype, self.multiplier, self.backoff = dtype, multiplier, backoff
        if rng.random() < 0.5:  # within a few growths of the maximum
            self.initial = float(np.float32(FLOAT32_MAX / multiplier ** rng.uniform(0, 3)))
        else:
            self.initial = float(np.float32(2.0 ** rng.uniform(0, 127)))
        self.period = int(rng.integers(1, 4))
        self.grads = []
        for _ in range(STEPS):
            g = np.sign(rng.normal(size=3)) * 10.0 ** rng.uniform(-40, 4, size=3)
            if rng.random() < 0.15:
                g[rng.integers(3)] = [np.inf, -np.inf, np.nan][rng.integers(3)]
            self.grads.append(g)

    def __repr__(self) -> str:
        return (
            f"Case({self.dtype}, initial={self.initial!r}, period={self.period}, "
            f"multiplier={self.multiplier}, backoff={self.backoff})"
        )


def _cases(
    seed: int, n: int, multipliers: tuple[float, ...], backoffs: tuple[float | None, ...] = (None,)
) -> list[Case]:
    rng = np.random.default_rng(seed)
    return [
        Case(
            rng,
            DTYPES[i % len(DTYPES)],
            multipliers[int(rng.integers(len(multipliers)))],
            backoffs[int(rng.integers(len(backoffs)))],
        )
        for i in range(n)
    ]


def _scaled_numpy(g: np.ndarray, scale: float, dtype: str) -> np.ndarray:
    """``g * scale`` in float64, rounded to ``dtype`` (to inf where it overflows)."""
    with np.errstate(over="ignore", invalid="ignore"):
        wide = g * np.float64(scale)
        if dtype == "bfloat16":
            import ml_dtypes

            return wide.astype(np.float32).astype(ml_dtypes.bfloat16)
        return wide.astype(dtype)


def _scaled_torch(g: np.ndarray, scale: float, dtype: str) -> Any:
    """The same values as :func:`_scaled_numpy`, as a torch tensor."""
    with np.errstate(over="ignore", invalid="ignore"):
        wide = g * np.float64(scale)
        if dtype == "bfloat16":
            return torch.from_numpy(wide.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(wide.astype(dtype))


def _tf_oracle(case: Case) -> list[float]:
    """TensorFlow's ``DynamicLossScale`` (float32 multiplier, back-off by division)."""
    tf = pytest.importorskip("tensorflow", reason="TensorFlow is the oracle of TF's rule")
    pytest.importorskip("ml_dtypes", reason="bfloat16 gradients need ml_dtypes")
    ls = tf.compat.v1.mixed_precision.DynamicLossScale(case.initial, case.period, case.multiplier)
    out = []
    for g in case.grads:
        ls.update([tf.constant(_scaled_numpy(g, float(ls()), case.dtype))])
        out.append(float(ls()))
    return out


TF_CASES = _cases(0, 16, (2.0, 1.03, 1.1, 3.3))
TF2_CASES = _cases(1, 12, (2.0,))


@pytest.mark.parametrize("case", TF_CASES, ids=repr)
@pytest.mark.parametrize("home", ["numpy", "torch"])
def test_stateful_dynamic_loss_scale_follows_tensorflow(case: Case, home: str) -> None:
    import lossscale

    expected = _tf_oracle(case)
    ls = lossscale.DynamicLossScale(case.initial, case.period, case.multiplier)
    scaled = _scaled_numpy if home == "numpy" else _scaled_torch
    out = []
    for g in case.grads:
        ls.update([scaled(g, float(ls()), case.dtype)])
        out.append(float(ls()))
    assert out == expected


@pytest.mark.parametrize("case", TF2_CASES, ids=repr)
def test_torch_loss_scale_optimizer_follows_tensorflow(case: Case) -> None:
    from lossscale.torch import LossScaleOptimizer

    expected = _tf_oracle(case)
    w = torch.nn.Parameter(torch.zeros(3, dtype=getattr(torch, case.dtype)))
    opt = LossScaleOptimizer(
        torch.optim.SGD([w], lr=0.0), initial_scale=case.initial, dynamic_growth_steps=case.period
    )
    out = []
    for g in case.grads:
        scale = float(opt.loss_scale)  # reading the scale counts as scaling the loss
        w.grad = _scaled_torch(g, scale, case.dtype)
        opt.step()
        out.append(float(opt.loss_scale))
    assert out == expected


@pytest.mark.parametrize("case", TF2_CASES, ids=repr)
def test_gradscaler_in_tensorflows_mapping_follows_tensorflow(case: Case) -> None:
    """GradScaler(growth_factor=2, backoff_factor=0.5) with its default floor of 1 is
    TensorFlow's rule (halving is exactly TF's division by 2)."""
    expected = _tf_oracle(case)
    kw = {"init_scale": case.initial, "growth_interval": case.period}
    assert _gradscaler_scales(GradScaler("cpu", **kw), case, False) == expected


def _gradscaler_scales(scaler: Any, case: Case, fused: bool) -> list[float]:
    w = torch.nn.Parameter(torch.zeros(3, dtype=getattr(torch, case.dtype)))
    opt = torch.optim.SGD([w], lr=0.0, fused=fused or None)
    out = []
    for g in case.grads:
        scaler.scale(torch.zeros(()))  # creates the scale lazily, as a loss would
        w.grad = _scaled_torch(g, scaler.get_scale(), case.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scaler.step(opt)
        scaler.update()
        out.append(scaler.get_scale())
    return out


TORCH_CASES = [
    case
    for case in _cases(2, 16, (2.0, 1.03, 1.1, 3.3), (0.5, 0.3, 0.9))
    if case.dtype != "float16"  # torch's GradScaler refuses float16 gradients
]


@pytest.mark.parametrize("fused", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("case", TORCH_CASES, ids=repr)
def test_gradscaler_follows_torchs_gradscaler(
    monkeypatch: pytest.MonkeyPatch, case: Case, fused: bool
) -> None:
    if fused:
        _device_home(monkeypatch)
    kw = {
        "init_scale": case.initial,
        "growth_factor": case.multiplier,
        "backoff_factor": case.backoff,
        "growth_interval": case.period,
    }
    theirs = _gradscaler_scales(torch.amp.GradScaler("cpu", **kw), case, fused)
    floor = 2.0**-126  # torch has none; this one cannot bind from scales >= 1 in 24 steps
    assert min(theirs) > floor
    ours = _gradscaler_scales(GradScaler("cpu", min_loss_scale=floor, **kw), case, fused)
    assert ours == theirs


JAX_CASES = _cases(3, 8, (2.0, 1.03, 1.1, 3.3))


@pytest.mark.parametrize("case", JAX_CASES, ids=repr)
def test_optax_transform_follows_tensorflow(case: Case) -> None:
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    from lossscale.jax import current_scale, loss_scale_optimizer

    expected = _tf_oracle(case)
    opt = loss_scale_optimizer(
        optax.sgd(0.0),
        initial_scale=case.initial,
        dynamic_growth_steps=case.period,
        multiplier=case.multiplier,
    )
    with jax.enable_x64(case.dtype == "float64"):
        params = jax.numpy.zeros(3, case.dtype)
        state = opt.init(params)
        update = jax.jit(opt.update)
        out = []
        for g in case.grads:
            grads = jax.numpy.asarray(_scaled_numpy(g, float(current_scale(state)), case.dtype))
            assert grads.dtype == params.dtype
            _, state = update(grads, state, params)
            out.append(float(current_scale(state)))
    assert out == expected
