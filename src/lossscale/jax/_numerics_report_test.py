"""The JAX numerics report: exact under jit at host and traced scales, the optax state's scale,
and an unsampled step that compiles to the program without the report."""

from __future__ import annotations

import collections
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lossscale.jax import (
    grad_stats,
    gradient_counts,
    loss_scale_optimizer,
    record,
    scale_loss,
)
from lossscale.numerics import Report, tensor_stats
from lossscale.numerics._stats_test import adversarial

#: An HLO instruction's opcode: ``%name = f32[32]{0} multiply(...)``.
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = \S+ ([\w-]+)\(", re.MULTILINE)
FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _grads() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "f32": jnp.asarray(adversarial("float32", 1000.0)),
        "bf16": jnp.asarray(adversarial("bfloat16", 1.0)),
        "f16": {"w": jnp.asarray((rng.standard_normal(64) * 1e-3).astype(np.float16))},
        "step": jnp.asarray(3),  # not floating: no stats
    }


@pytest.mark.parametrize("scale", [1.0, 1000.0, 2.0**15])
def test_grad_stats_under_jit_is_exact_at_host_and_traced_scales(scale: float) -> None:
    grads = _grads()
    host = jax.jit(lambda g: grad_stats(g, scale=scale, formats=FORMATS))(grads)
    traced = jax.jit(lambda g, s: grad_stats(g, scale=s, formats=FORMATS))(
        grads, jnp.float32(scale)
    )
    assert host["step"] is None and traced["step"] is None
    for path in (("f32",), ("bf16",), ("f16", "w")):
        leaf = functools.reduce(lambda t, k: t[k], path, grads)
        want = tensor_stats(np.asarray(leaf), scale=scale, formats=FORMATS)
        for got in (
            functools.reduce(lambda t, k: t[k], path, host),
            functools.reduce(lambda t, k: t[k], path, traced),
        ):
            for fmt in FORMATS:
                g, w = got[fmt], want[fmt]
                for field in ("underflow", "subnormal", "overflow", "zeros", "nonfinite"):
                    assert round(float(getattr(g, field)) * w.size) == round(
                        getattr(w, field) * w.size
                    )
                assert float(g.amax) == w.amax


def _loss(params: Any, x: Any) -> Any:
    return jnp.sum((params["w"] * x) ** 2) * 1e-9


OPT = loss_scale_optimizer(optax.sgd(1e-3))


@functools.partial(jax.jit, static_argnames="sample")
def _step(params: Any, state: Any, x: Any, sample: bool = False) -> Any:
    grads = jax.grad(lambda p: scale_loss(_loss(p, x), state))(params)
    counts = gradient_counts(grads, state, formats=FORMATS) if sample else None
    updates, state = OPT.update(grads, state, params)
    return optax.apply_updates(params, updates), state, counts, grads


@jax.jit
def _plain_step(params: Any, state: Any, x: Any) -> Any:
    grads = jax.grad(lambda p: scale_loss(_loss(p, x), state))(params)
    updates, state = OPT.update(grads, state, params)
    return optax.apply_updates(params, updates), state, None, grads


def test_record_reports_the_scaled_gradients_at_the_scale_in_use() -> None:
    params = {"w": jnp.linspace(-1.0, 1.0, 32), "b": jnp.ones(3, jnp.bfloat16)}
    state = OPT.init(params)
    x = jnp.linspace(1e-3, 1.0, 32)
    report = Report(FORMATS, every=2)
    for step in range(3):
        sample = report.due(step)
        params, new_state, counts, grads = _step(params, state, x, sample=sample)
        if sample:
            record(report, step, counts)
            for r in (r for r in report.rows if r.step == step):
                assert r.loss_scale == float(state.loss_scale.loss_scale)
                want = tensor_stats(np.asarray(grads[r.tensor]), formats=r.format)[r.format]
                assert tuple(r[4:]) == tuple(want)
        state = new_state
    assert report.steps == [0, 2]
    assert {r.tensor for r in report.rows} == {"w", "b"}


def test_an_unsampled_step_compiles_to_the_program_without_the_report() -> None:
    params = {"w": jnp.ones(32), "b": jnp.ones(3)}
    state = OPT.init(params)
    x = jnp.ones(32)

    def ops(f: Any, **kw: Any) -> collections.Counter[str]:
        text = f.lower(params, state, x, **kw).compile().as_text()
        return collections.Counter(_OP.findall(text))

    plain = ops(_plain_step)
    assert ops(_step, sample=False) == plain
    assert sum(ops(_step, sample=True).values()) > sum(plain.values())


def test_record_rejects_mismatches() -> None:
    counts = gradient_counts({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="counts are of formats"):
        record(Report(("float8_e5m2",)), 0, counts)
    with pytest.raises(TypeError, match="counts must be a GradientCounts, got dict"):
        record(Report(), 0, {})  # type: ignore[arg-type]
