"""Copies and conditionals in the compiled step (XLA:CPU), counted exactly: a regression guard.

The step is ``opt.update`` + ``optax.apply_updates`` under ``jit`` over 20 float32[256, 256]
leaves, with and without donated buffers, for the inner transformations of issue 20. Counted in
``jax.jit(step).lower(...).compile().as_text()``: copies of arrays (``copy`` of a shape with
more than one element: a pass over a whole buffer) and of scalars (the loss-scale state's three
0-d values: XLA copies them because the new scale is written while the finite check and the
stall count still read the old one; a few bytes), and conditionals.

Before the skip was expressed as a select at each state value's definition (the
``select_outputs`` execution, kept as the fallback), the donated step copied every moment
buffer: momentum 20, adam/adamw/chain(clip, adamw) 40 array copies. Now: none, as the plain
optax step.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

from lossscale.jax import _skip, _transform, loss_scale_optimizer

LEAVES = 20
INNERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(1e-3),
    "momentum": lambda: optax.sgd(1e-3, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
    "chain(clip_by_global_norm, adamw)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
    ),
}
#: Array copies of the donated step before (select_outputs), per inner: what must not return.
ARRAY_COPIES_SELECTING_OUTPUTS = {
    "sgd": 0,
    "momentum": LEAVES,
    "adam": 2 * LEAVES,
    "adamw": 2 * LEAVES,
    "chain(clip_by_global_norm, adamw)": 2 * LEAVES,
}
#: The loss-scale state's 0-d values XLA copies (scale, good steps, non-finite steps).
SCALAR_COPIES = 3

COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* copy\(")


def counts(text: str) -> dict[str, int]:
    """Array copies, scalar copies and conditionals in a compiled HLO module's text."""
    shapes = [dims for _, dims in COPY.findall(text)]
    array = sum(1 for d in shapes if d and eval_size(d) > 1)
    return {
        "array_copies": array,
        "scalar_copies": len(shapes) - array,
        "conditionals": text.count(" conditional("),
    }


def eval_size(dims: str) -> int:
    size = 1
    for d in dims.split(","):
        size *= int(d)
    return size


def compiled_counts(opt: optax.GradientTransformation, donate: bool) -> dict[str, int]:
    params = [jnp.full((256, 256), 0.1, jnp.float32) for _ in range(LEAVES)]
    state = opt.init(params)

    def step(p: Any, s: Any, g: Any) -> Any:
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    return counts(jitted.lower(params, state, params).compile().as_text())


def test_counting_finds_copies_and_conditionals() -> None:
    text = (
        "  %copy.1 = f32[256,256]{1,0} copy(%p)\n  %copy.2 = s32[] copy(%c)\n"
        "  %c = (f32[]) conditional(%pred, %a, %b)\n"
    )
    assert counts(text) == {"array_copies": 1, "scalar_copies": 1, "conditionals": 1}


@pytest.mark.parametrize("donate", [False, True], ids=["no donation", "donated"])
@pytest.mark.parametrize("name", list(INNERS))
def test_select_copies_no_array_and_branches_nowhere(name: str, donate: bool) -> None:
    plain = compiled_counts(INNERS[name](), donate)
    scaled = compiled_counts(loss_scale_optimizer(INNERS[name]()), donate)
    assert plain == {"array_copies": 0, "scalar_copies": 0, "conditionals": 0}
    expected_scalars = SCALAR_COPIES if donate else 0
    assert scaled == {"array_copies": 0, "scalar_copies": expected_scalars, "conditionals": 0}


@pytest.mark.parametrize("name", list(INNERS))
def test_selecting_outputs_copied_the_moments(name: str, monkeypatch: Any) -> None:
    """What the count guards against: with the outputs selected (the previous execution), XLA
    copies each donated buffer the update reads after writing; selecting where each value is
    defined removed exactly these copies."""
    monkeypatch.setitem(_transform.SKIP_STRATEGIES, "select", _skip.select_outputs)
    got = compiled_counts(loss_scale_optimizer(INNERS[name]()), donate=True)
    assert got["array_copies"] == ARRAY_COPIES_SELECTING_OUTPUTS[name]
    assert got["conditionals"] == 0


@pytest.mark.parametrize("donate", [False, True], ids=["no donation", "donated"])
def test_cond_has_one_conditional(donate: bool) -> None:
    got = compiled_counts(loss_scale_optimizer(optax.adam(1e-3), skip_strategy="cond"), donate)
    assert got["conditionals"] == 1
