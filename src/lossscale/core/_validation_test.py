"""The step's finite flag is checked once, in core, for every front end (issue 18 item 7)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lossscale.core import dynamic_rule, dynamic_state, dynamic_update, stall_update
from lossscale.core._validation import finite_flag

RULE = dynamic_rule(increment_period=2)


def _flags(lib: str) -> tuple[Any, Any, Any]:
    """(a good 0-d flag, a (2,) bool flag, a 0-d int flag) of one library."""
    if lib == "numpy":
        return np.asarray(True), np.array([True, False]), np.asarray(1)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        return torch.tensor(True), torch.tensor([True, False]), torch.tensor(1)
    jnp = pytest.importorskip("jax.numpy")
    return jnp.asarray(True), jnp.asarray([True, False]), jnp.asarray(1)


@pytest.mark.parametrize("lib", ["numpy", "torch", "jax"])
def test_bad_flags_are_clear_errors_in_the_rule_and_the_stall_count(lib: str) -> None:
    good, vector, integer = _flags(lib)
    state = dynamic_state(8.0, RULE)
    assert float(dynamic_update(state, good, RULE, None).loss_scale) == 8.0
    with pytest.raises(ValueError, match=r"is_finite must be 0-d .*shape \(2,\)"):
        dynamic_update(state, vector, RULE)
    with pytest.raises(TypeError, match="is_finite must be a bool or a 0-d bool array, got dtype"):
        dynamic_update(state, integer, RULE)
    count = np.asarray(0, np.int32)
    with pytest.raises(ValueError, match="is_finite must be 0-d"):
        stall_update(count, vector, state.loss_scale, RULE)


@pytest.mark.parametrize("flag", [0.5, 1, "yes", None, [True]])
def test_non_bool_python_flags_are_type_errors(flag: Any) -> None:
    with pytest.raises(TypeError, match="must be a bool"):
        finite_flag("is_finite", flag)


@pytest.mark.parametrize("flag", [True, False, np.bool_(True), np.asarray(False)])
def test_bools_pass(flag: Any) -> None:
    finite_flag("is_finite", flag)
