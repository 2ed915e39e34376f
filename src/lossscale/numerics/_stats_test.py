"""tensor_stats against the real casts: ml_dtypes' and NumPy's, torch's and JAX's, for every
format, over random and adversarial tensors (every boundary and its neighbours, signed zeros,
inf, NaN, the source dtype's subnormals)."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale.numerics import FloatFormat, float_format, register_format, tensor_stats
from lossscale.numerics._counts import check_scale

TARGETS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
SCALES = (1.0, 2.0**-10, 2.0**15, 1000.0, 3.1e-3)
NP_TYPES: dict[str, Any] = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float64": np.float64,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}


def to_float32_odd(x64: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd: truncate, then set the last bit when inexact. A
    second rounding to a format of at most 22 significant bits is then correct (ml_dtypes and
    torch cast float64 to bfloat16 through a float32 rounded to nearest: twice rounded)."""
    with np.errstate(over="ignore"):
        f = x64.astype(np.float32)
    f = np.where(np.abs(f.astype(np.float64)) > np.abs(x64), np.nextafter(f, np.float32(0)), f)
    inexact = f.astype(np.float64) != x64
    bits = f.view(np.uint32) | inexact.astype(np.uint32)
    return bits.view(np.float32)


def reference(x64: np.ndarray, scale: float, target: str) -> dict[str, int]:
    """Counts from the real cast of the float64 product: NumPy's (float16), ml_dtypes' from a
    float32 rounded to odd (the others: one correct rounding)."""
    fmt = float_format(target)
    finite = np.isfinite(x64)
    with np.errstate(over="ignore", invalid="ignore"):
        product = x64[finite] * scale
        if target == "float16":
            y = product.astype(np.float16).astype(np.float64)
        else:
            y = to_float32_odd(product).astype(NP_TYPES[target]).astype(np.float64)
    xf = x64[finite]
    big = ~np.isfinite(y) | (np.abs(y) > fmt.max)  # inf, NaN (e4m3fn) or beyond max
    return {
        "underflow": int(np.sum((xf != 0) & (y == 0))),
        "subnormal": int(np.sum((y != 0) & (np.abs(y) < fmt.min_normal))),
        "overflow": int(np.sum(big)),
        "zeros": int(np.sum(xf == 0)),
        "nonfinite": int(np.sum(~finite)),
    }


def adversarial(source: str, scale: float) -> np.ndarray:
    """Every threshold of every target divided by the scale, rounded into the source dtype,
    with its two neighbours and both signs; signed zeros, inf, NaN, the source's extremes."""
    src = float_format(source)
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, src.max, src.min_subnormal]
    values += [src.min_subnormal * 3, src.min_normal, src.min_normal - src.min_subnormal]
    for target in TARGETS:
        fmt = float_format(target)
        edges = [fmt.min_subnormal / 2, fmt.min_normal - fmt.min_subnormal / 2]
        edges += [fmt.overflow_threshold, fmt.max, fmt.min_subnormal]
        for edge in edges:
            values.append(min(edge / scale, src.max))
    typed = np.array(values, np.float64).astype(NP_TYPES[source])
    bits = typed.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[typed.itemsize])
    finite = np.isfinite(typed.astype(np.float64))
    up = (bits[finite] + 1).view(typed.dtype)
    down = (bits[finite & (bits > 0)] - 1).view(typed.dtype)
    out = np.concatenate([typed, up, down])
    return np.concatenate([out, -out])


def random_values(source: str, rng: np.random.Generator, n: int = 400) -> np.ndarray:
    src = float_format(source)
    low = max(math.log2(src.min_subnormal), -150)
    high = min(math.log2(src.max), 40)
    magnitude = np.exp2(rng.uniform(low, high, n))
    return (magnitude * rng.choice([-1.0, 1.0], n)).astype(NP_TYPES[source])


def check(x: Any, x64: np.ndarray, scale: float) -> None:
    stats = tensor_stats(x, scale=scale, formats=TARGETS)
    assert list(stats) == list(TARGETS)
    for target, s in stats.items():
        want = reference(x64, scale, target)
        got = {k: round(getattr(s, k) * s.size) for k in want}
        assert got == want, (target, scale)
        finite = x64[np.isfinite(x64)]
        assert s.amax == (float(np.max(np.abs(finite))) if finite.size else 0.0)


@pytest.mark.parametrize("source", ["float16", "bfloat16", "float32", "float64", "float8_e5m2"])
@pytest.mark.parametrize("scale", SCALES)
def test_numpy_matches_the_casts(source: str, scale: float) -> None:
    rng = np.random.default_rng(hash((source, scale)) % 2**32)
    for x in (adversarial(source, scale), random_values(source, rng)):
        check(x, x.astype(np.float64), scale)


def test_a_tie_at_the_top_follows_the_format() -> None:
    """float16 65520 (max + half an ulp, max's last bit odd) goes to inf; float8_e4m3fn 464
    (max 448 has an even last bit) stays 448; one above 464 is NaN."""
    x = np.array([65520.0, 65519.0, 464.0, 465.0, 2.0**-25, 2.0**-25 * 1.0001])
    s16 = tensor_stats(x[:2], formats="float16")["float16"]
    assert s16.overflow == 0.5
    s8 = tensor_stats(x[2:4], formats="float8_e4m3fn")["float8_e4m3fn"]
    assert s8.overflow == 0.5
    assert tensor_stats(x[4:], formats="float16")["float16"].underflow == 0.5


def test_headroom_and_empty() -> None:
    s = tensor_stats(np.array([1024.0], np.float32), scale=2.0)["float16"]
    assert s.headroom_max == pytest.approx(math.log2(65504 / 2048))
    assert s.headroom_normal == pytest.approx(11 + 14)
    e = tensor_stats(np.zeros((0, 3), np.float32))["float16"]
    assert e.size == 0 and e.underflow == 0.0 and e.amax == 0.0 and e.headroom_max == math.inf


def test_bad_arguments_name_themselves() -> None:
    x = np.ones(2, np.float32)
    with pytest.raises(ValueError, match=r"scale must be finite and > 0, got 0\.0"):
        tensor_stats(x, scale=0.0)
    with pytest.raises(ValueError, match=r"scale must be finite and > 0, got inf"):
        tensor_stats(x, scale=math.inf)
    with pytest.raises(TypeError, match="scale must be a real number, got bool"):
        tensor_stats(x, scale=True)
    with pytest.raises(ValueError, match="unknown format 'float12'"):
        tensor_stats(x, formats=("float12",))
    with pytest.raises(ValueError, match="names a format twice"):
        tensor_stats(x, formats=("float16", "float16"))
    with pytest.raises(TypeError, match="got dtype 'int32'"):
        tensor_stats(np.ones(2, np.int32))
    with pytest.raises(TypeError, match="got list"):
        tensor_stats([1.0])
    assert check_scale(np.float32(2.0)) == 2.0


def test_the_table_is_extensible() -> None:
    """A format added to the table is counted like the built-in ones: float8_e4m3 (IEEE-like,
    with inf; max 240) against ml_dtypes' cast."""
    register_format(FloatFormat("float8_e4m3", 8, 3, 7, 240.0))
    x = adversarial("float32", 1.0)
    x = np.concatenate([x, np.array([240.0, 247.9, 248.0, 250.0, 2.0**-10, 2.0**-11])])
    got = tensor_stats(x, formats="float8_e4m3")["float8_e4m3"]
    x64 = x.astype(np.float64)[np.isfinite(x)]
    y = x64.astype(ml_dtypes.float8_e4m3).astype(np.float64)
    assert round(got.overflow * got.size) == int(np.sum(~np.isfinite(y)))
    assert round(got.underflow * got.size) == int(np.sum((x64 != 0) & (y == 0)))
    with pytest.raises(ValueError, match="is not a float8"):
        register_format(FloatFormat("float8_bad", 8, 3, 7, 241.0))
    with pytest.raises(TypeError, match="expects a FloatFormat"):
        register_format(("float8_bad", 8, 3, 7, 240.0))  # type: ignore[arg-type]


def test_torch_matches_the_casts() -> None:
    torch = pytest.importorskip("torch")
    types = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    rng = np.random.default_rng(1)
    for source, dtype in types.items():
        for scale in (1.0, 2.0**15, 1000.0):
            x = np.concatenate([adversarial(source, scale), random_values(source, rng, 100)])
            x64 = x.astype(np.float64)
            check(torch.from_numpy(x64).to(dtype), x64, scale)
    # torch's own casts agree with the reference on the formats it has (by value: its CPU
    # float8_e4m3fn cast saturates at 448 instead of giving NaN; from float32, as torch casts
    # float64 to the narrow formats through a float32 rounded to nearest: twice rounded)
    x64 = adversarial("float32", 1.0).astype(np.float64)
    fin = x64[np.isfinite(x64)]
    casts = [("float8_e5m2", torch.float8_e5m2), ("float8_e4m3fn", torch.float8_e4m3fn)]
    casts += [("float16", torch.float16), ("bfloat16", torch.bfloat16)]
    for target, dtype in casts:
        y = torch.from_numpy(fin.astype(np.float32)).to(dtype).double().numpy()
        fmt = float_format(target)
        big = ~np.isfinite(y) | (np.abs(y) > fmt.max)
        if target == "float8_e4m3fn":  # saturated: 448 from above the rounding midpoint 464
            big = np.abs(fin) > fmt.overflow_threshold
        assert int(np.sum(big)) == reference(x64, 1.0, target)["overflow"]
        assert int(np.sum((fin != 0) & (y == 0))) == reference(x64, 1.0, target)["underflow"]


def test_jax_matches_the_casts_under_jit() -> None:
    """Exact under jit without x64, where XLA:CPU flushes float32 subnormals to zero in float
    comparisons: the kernel compares bits."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from lossscale.numerics._counts import count_row, decode_row

    rng = np.random.default_rng(2)
    for source in ("float16", "bfloat16", "float32"):
        for scale in (1.0, 2.0**15, 1000.0):
            x = np.concatenate([adversarial(source, scale), random_values(source, rng, 100)])
            x64 = x.astype(np.float64)
            arr = jnp.asarray(x)
            check(arr, x64, scale)  # eager
            row = jax.jit(lambda a, s=scale: count_row(a, TARGETS, s))(arr)
            stats = decode_row(row.tolist(), source, TARGETS, x.size, scale)
            for target, s in stats.items():
                want = reference(x64, scale, target)
                assert {k: round(getattr(s, k) * s.size) for k in want} == want


@settings(max_examples=25, deadline=None)
@given(
    bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64),
    scale=st.floats(2.0**-40, 2.0**40, allow_nan=False, allow_infinity=False),
)
def test_any_float32_bits_at_any_scale(bits: list[int], scale: float) -> None:
    """Arbitrary float32 bit patterns (every sign, subnormal, inf and NaN) at any scale."""
    x = np.array(bits, np.uint32).view(np.float32)
    check(x, x.astype(np.float64), scale)


@pytest.mark.parametrize("path", ["bound by bound", "broadcast"])
def test_both_torch_comparison_paths(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's count_below compares bound by bound on the CPU and for large tensors, and all
    bounds in one broadcast comparison elsewhere (a GPU): the same counts either way."""
    torch = pytest.importorskip("torch")
    from lossscale.core import _integers

    if path == "broadcast":
        monkeypatch.setattr(_integers, "_BOUND_BY_BOUND", frozenset())
    else:
        monkeypatch.setattr(_integers, "_BROADCAST_LIMIT", 0)
    x = adversarial("float32", 1000.0)
    check(torch.from_numpy(x), x.astype(np.float64), 1000.0)
    half = adversarial("float16", 1.0)
    check(torch.from_numpy(half), half.astype(np.float64), 1.0)


@pytest.mark.parametrize("path", ["direct", "laned"])
@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("size", [0, 1, 9_000, 70_001])
def test_both_torch_histogram_paths(
    path: str, dtype: str, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's count_values adds to the bins directly on the CPU and for small tensors, and
    over lanes of bins elsewhere (a GPU, whose atomic adds on one bin serialize), chunk by
    chunk: the same counts as NumPy's bincount either way, most entries in one bin."""
    torch = pytest.importorskip("torch")
    from lossscale.core import _integers
    from lossscale.core._backends import namespace_of

    if path == "laned":
        monkeypatch.setattr(_integers, "_DIRECT_COUNT", frozenset())
        monkeypatch.setattr(_integers, "_LANE_MIN", 1)
        monkeypatch.setattr(_integers, "_LANE_CHUNK", 4096)  # several chunks, a partial last
    rng = np.random.default_rng(size)
    for length in (32, 256, 2048):
        values = np.where(rng.random(size) < 0.9, 3, rng.integers(0, length, size))
        ints = torch.from_numpy(values.astype(dtype))
        xp = namespace_of(ints)
        assert xp is not None
        got = xp.count_values(ints, length)
        assert got.dtype == torch.int64 and got.shape == (length,)
        np.testing.assert_array_equal(got.numpy(), np.bincount(values, minlength=length))
