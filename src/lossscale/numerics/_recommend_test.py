""":func:`lossscale.numerics.recommend` against hand-worked cases.

Every tensor below holds powers of two, so each entry sits at the bottom of its binade and the
binade arithmetic of the module can be done by hand. For float16 (smallest subnormal 2**-24,
overflow threshold 65520, between 2**15 and 2**16) and an entry ``2**e`` (its binade's upper
edge ``2**(e + 1)``), at a loss scale ``2**k``:

* the binade counts as underflowing when ``e + 1 + k <= -25`` (upper edge at most half the
  smallest subnormal), i.e. ``k <= -26 - e``: the lowest scale kept is ``2**(-25 - e)``;
* the entry overflows when ``2**(e + k) >= 65520``, i.e. ``k >= 16 - e``: the highest scale
  kept is ``2**(15 - e)``.
"""

from __future__ import annotations

import numpy as np
import pytest

from lossscale.numerics import Report, recommend


def _report(tensors: dict[str, list[float]], formats: tuple[str, ...] = ("float16",)) -> Report:
    report = Report(formats)
    report.record(0, {k: np.asarray(v, np.float32) for k, v in tensors.items()}, loss_scale=1.0)
    return report


def test_one_tensor_range_by_hand() -> None:
    rec = recommend(_report({"a": [2.0**-20] * 4}))
    r = rec.ranges["a"]
    assert (r.low, r.high) == (2.0**-5, 2.0**35)  # -25 - (-20), 15 - (-20)
    assert r.underflow == 0.0 and not r.empty
    assert rec.covering == (2.0**-5, 2.0**35)
    assert rec.chosen == 1.0 and rec.uncovered == ()  # the scale in use is inside
    assert (rec.format, rec.step, rec.loss_scale) == ("float16", 0, 1.0)


def test_two_tensors_share_the_overlap() -> None:
    rec = recommend(_report({"a": [2.0**-20] * 4, "b": [2.0**10] * 4}))
    assert (rec.ranges["b"].low, rec.ranges["b"].high) == (2.0**-35, 2.0**5)
    assert rec.covering == (2.0**-5, 2.0**5)  # a's low, b's high
    assert rec.chosen == 1.0
    assert "one loss scale covers all 2 tensors: 2^-5 .. 2^5" in str(rec)
    assert "set by a below and b above" in str(rec)


def test_no_single_scale_and_the_one_nearest_in_use() -> None:
    # a: 2**-30 keeps 2**5 .. 2**45; b: 2**11 keeps 2**-36 .. 2**4: disjoint
    rec = recommend(_report({"a": [2.0**-30] * 4, "b": [2.0**11] * 4}))
    assert (rec.ranges["a"].low, rec.ranges["a"].high) == (2.0**5, 2.0**45)
    assert (rec.ranges["b"].low, rec.ranges["b"].high) == (2.0**-36, 2.0**4)
    assert rec.covering is None
    assert rec.chosen == 1.0  # covers one tensor, as every scale does; nearest to 2**0
    assert rec.uncovered == ("a",)
    assert rec.ranges["a"].underflow == 1.0  # 2**-30 is zero in float16 at scale 1
    assert "a: 2^5 .. 2^45 (underflow now 100.00%)" in str(rec)


def test_the_underflow_threshold_counts_entries() -> None:
    # 999 entries of 1.0 and one of 2**-40: the lone entry may underflow at 1e-3, not at 0
    tensor = {"m": [1.0] * 999 + [2.0**-40]}
    assert recommend(_report(tensor)).ranges["m"].low == 2.0**-25  # set by the 1.0 entries
    assert recommend(_report(tensor), underflow=0.0).ranges["m"].low == 2.0**15  # by 2**-40


def test_the_overflow_threshold_counts_entries() -> None:
    # 999 entries of 1.0 and one of 2**12: none may overflow at 0; ten may at 0.01
    tensor = {"o": [1.0] * 999 + [2.0**12]}
    assert recommend(_report(tensor)).ranges["o"].high == 2.0**3  # 15 - 12
    # 2**12 alone overflows from 2**4 on (one entry: within 1%); the binade of the 1.0 entries,
    # [1, 2), reaches past 65520 from 2**15 on and counts whole (conservative): 999 entries
    assert recommend(_report(tensor), overflow=0.01).ranges["o"].high == 2.0**14


def test_float8_per_tensor_scale_by_hand() -> None:
    # float8_e4m3fn: max 448, overflow threshold 464; smallest subnormal 2**-9
    rec = recommend(
        _report({"a": [2.0**-20] * 4, "b": [2.0**10] * 4}, ("float16", "float8_e4m3fn"))
    )
    per = rec.float8["float8_e4m3fn"]
    assert per["b"] == (2.0**-2, 0.0)  # 2**8 = 256 fits, 2**9 = 512 > 464 does not
    assert per["a"] == (2.0**28, 0.0)  # 2**-20 * 2**28 = 256
    zero = recommend(_report({"z": [0.0, 0.0]}, ("float16", "float8_e5m2")))
    assert zero.float8["float8_e5m2"]["z"] == (None, 0.0)
    assert "float8_e5m2: every tensor is zero" in str(zero)


def test_the_step_is_chosen_and_the_scale_in_use_read() -> None:
    report = Report()
    report.record(0, {"a": np.full(4, 2.0**-20, np.float32)}, loss_scale=1.0)
    report.record(5, {"a": np.full(4, 2.0**-20 * 2.0**8, np.float32)}, loss_scale=2.0**8)
    assert recommend(report).step == 5
    assert recommend(report).loss_scale == 2.0**8
    # the scaled gradients at 2**8 give the same range of scales as the unscaled ones
    assert recommend(report).ranges == recommend(report, step=0).ranges
    assert recommend(report).chosen == 2.0**8  # inside the covering range: the scale in use


def test_bad_arguments() -> None:
    report = _report({"a": [1.0]})
    with pytest.raises(ValueError, match="underflow must be in"):
        recommend(report, underflow=-0.1)
    with pytest.raises(ValueError, match="overflow must be in"):
        recommend(report, overflow=1.0)
    with pytest.raises(ValueError, match="no sampled step 3"):
        recommend(report, step=3)
    with pytest.raises(ValueError, match="no sampled step with exponent histograms"):
        recommend(Report())
