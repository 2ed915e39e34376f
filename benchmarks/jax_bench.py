"""lossscale.jax vs a plain optax step, a jmp-style step and optax.apply_if_finite (CPU, jit).

Run: ``.venv/bin/python benchmarks/jax_bench.py [--quick] [--rounds N] [--json out.json]``

The anchors' setup (shared/reference/jax_keras_anchors.md §3): 200 float32 leaves,
10,035,200 elements (100 x (256, 320) + 100 x (64, 288)); loss sum_i mean((x_i @ p_i) ** 2) with
batch 4; every step jitted with donated buffers. Variants, interleaved round by round:

  plain        optax.sgd (or --inner adam), no loss scaling
  ls-select    lossscale.jax.loss_scale_optimizer(sgd), skip_strategy='select' (default)
  ls-cond      the same, skip_strategy='cond'
  jmp-style    jmp's recipe written inline with jnp (jmp itself is not a dependency): scale the
               loss, unscale, all_finite, adjust, select_tree over params and opt_state
  apply-if-finite  optax.apply_if_finite(sgd, 5) (skips non-finite steps, no scaling)

Reported per variant: median step time, interquartile spread, minimum, compile time (median
of ``--compile-reps`` fresh compilations), and in the compiled HLO the number of conditionals
and copies. Ratios are against ``plain`` (targets: step <= 1.15x, compile <= 2x). Speed is
never asserted: CI runs ``--quick`` only to keep the script working.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved

from lossscale.jax import loss_scale_optimizer, scale_loss

LR = 1e-3
JMP_PERIOD = 2000
INNER: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(LR),
    "adam": lambda: optax.adam(LR),
}
inner_name = "sgd"  # set by --inner


def inner() -> optax.GradientTransformation:
    return INNER[inner_name]()


def make_problem(quick: bool) -> tuple[list[jax.Array], list[jax.Array]]:
    shapes = [(16, 20)] * 10 + [(8, 12)] * 10 if quick else [(256, 320)] * 100 + [(64, 288)] * 100
    key = jax.random.PRNGKey(0)
    params, xs = [], []
    for shape in shapes:
        key, k1, k2 = jax.random.split(key, 3)
        params.append(jax.random.normal(k1, shape, jnp.float32) * 0.01)
        xs.append(jax.random.normal(k2, (4, shape[0]), jnp.float32))
    return params, xs


def loss_fn(params: list[jax.Array], xs: list[jax.Array]) -> jax.Array:
    return sum((jnp.mean((x @ p) ** 2) for x, p in zip(xs, params, strict=True)), jnp.float32(0))


# -- the variants: (init(params) -> state, step(state, xs) -> state) ------------------------------


def _optax_variant(
    opt: optax.GradientTransformation,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A step that differentiates the loss and applies ``opt`` (no loss scaling)."""

    def step(state: Any, xs: Any) -> Any:
        params, opt_state = state
        grads = jax.grad(loss_fn)(params, xs)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return lambda p: (p, opt.init(p)), step


def lossscale_variant(strategy: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    opt = loss_scale_optimizer(inner(), skip_strategy=strategy)

    def step(state: Any, xs: Any) -> Any:
        params, opt_state = state
        grads = jax.grad(lambda p: scale_loss(loss_fn(p, xs), opt_state))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return lambda p: (p, opt.init(p)), step


def jmp_style() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """jmp 0.0.4's documented recipe (loss_scale.py), inline: the comparison baseline."""
    opt = inner()

    def init(params: Any) -> Any:
        return params, opt.init(params), (jnp.float32(2**15), jnp.int32(0))

    def step(state: Any, xs: Any) -> Any:
        params, opt_state, (scale, counter) = state
        grads = jax.grad(lambda p: loss_fn(p, xs) * scale)(params)
        inv = 1 / scale
        grads = jax.tree_util.tree_map(lambda g: g * inv, grads)
        finite = jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)])
        finite = finite.all()
        grown = scale * 2
        grown = lax.select(jnp.isfinite(grown).all(), grown, scale)
        new_scale = lax.select(
            finite,
            lax.select(counter == JMP_PERIOD - 1, grown, scale),
            jnp.maximum(jnp.float32(1), scale / 2),
        )
        new_counter = ((counter + 1) % JMP_PERIOD) * finite
        updates, new_opt_state = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)

        def select_tree(a: Any, b: Any) -> Any:
            return jax.tree_util.tree_map(lambda x, y: lax.select(finite, x, y), a, b)

        return (
            select_tree(new_params, params),
            select_tree(new_opt_state, opt_state),
            (new_scale, new_counter),
        )

    return init, step


def plain() -> tuple[Callable[..., Any], Callable[..., Any]]:
    return _optax_variant(inner())


def apply_if_finite() -> tuple[Callable[..., Any], Callable[..., Any]]:
    return _optax_variant(optax.apply_if_finite(inner(), max_consecutive_errors=5))


VARIANTS: dict[str, Callable[[], tuple[Callable[..., Any], Callable[..., Any]]]] = {
    "plain": plain,
    "ls-select": lambda: lossscale_variant("select"),
    "ls-cond": lambda: lossscale_variant("cond"),
    "jmp-style": jmp_style,
    "apply-if-finite": apply_if_finite,
}


def compile_variant(
    step: Callable[..., Any], state: Any, xs: Any, reps: int
) -> tuple[Any, list[float], str]:
    """Compile ``reps`` times from fresh wrappers (no cache hit); return the last executable."""
    times = []
    compiled = None
    for _ in range(reps):
        jitted = jax.jit(lambda s, x: step(s, x), donate_argnums=(0,))
        lowered = jitted.lower(state, xs)
        t0 = time.perf_counter()
        compiled = lowered.compile()
        times.append(time.perf_counter() - t0)
    assert compiled is not None
    return compiled, times, compiled.as_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few rounds (CI)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--compile-reps", type=int, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--inner", choices=sorted(INNER), default="sgd", help="inner optimizer")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    global inner_name
    inner_name = args.inner
    rounds = args.rounds or (5 if args.quick else 40)
    reps = args.compile_reps or (1 if args.quick else 3)
    names = args.variants.split(",")
    if names[0] != "plain":
        names = ["plain", *[n for n in names if n != "plain"]]

    params, xs = make_problem(args.quick)
    n_elems = sum(p.size for p in params)
    print(
        f"jax {jax.__version__}, optax {optax.__version__}, {jax.devices()[0].platform}, "
        f"{os.cpu_count()} CPUs, {platform.python_version()}; {len(params)} leaves, "
        f"{n_elems:,} elements; inner optax.{args.inner}; {rounds} rounds, "
        f"{reps} compilation(s) per variant"
    )
    # Warm up the compiler once, so the first variant does not pay its start-up cost.
    jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(3)).compile()

    compiled: dict[str, Any] = {}
    compile_times: dict[str, list[float]] = {}
    hlo_counts: dict[str, tuple[int, int]] = {}
    states: dict[str, Any] = {}
    for name in names:
        init, step = VARIANTS[name]()
        state = init(jax.tree_util.tree_map(jnp.copy, params))
        exe, times, text = compile_variant(step, state, xs, reps)
        compiled[name], compile_times[name] = exe, times
        hlo_counts[name] = (text.count(" conditional("), text.count(" copy("))
        states[name] = state
        print(f"  compiled {name:16s} {statistics.median(times):6.2f} s", flush=True)

    def runner(name: str) -> Callable[[], None]:
        def run() -> None:
            states[name] = jax.block_until_ready(compiled[name](states[name], xs))

        return run

    timing = interleaved({n: (None, runner(n)) for n in names}, rounds=rounds, warmup=3)

    base = timing.median("plain")
    base_compile = statistics.median(compile_times["plain"])
    header = (
        f"{'variant':16s} {'median ms':>10s} {'spread':>7s} {'min ms':>8s} {'compile s':>10s}"
        f" {'step x':>7s} {'round x':>8s} {'compile x':>9s} {'conds':>6s} {'copies':>7s}"
    )
    print(header)
    print("-" * len(header))
    results = {}
    for name in names:
        samples = timing.samples[name]
        per_round = statistics.median(
            a / b for a, b in zip(samples, timing.samples["plain"], strict=True)
        )
        compile_s = statistics.median(compile_times[name])
        conds, copies = hlo_counts[name]
        row = {
            "median_ms": timing.median(name) * 1e3,
            "spread": timing.spread(name),
            "min_ms": min(samples) * 1e3,
            "compile_s": compile_s,
            "step_ratio": timing.median(name) / base,
            "per_round_ratio": per_round,
            "compile_ratio": compile_s / base_compile,
            "conditionals": conds,
            "copies": copies,
        }
        results[name] = row
        print(
            f"{name:16s} {row['median_ms']:10.2f} {row['spread']:7.2f} {row['min_ms']:8.2f}"
            f" {compile_s:10.2f} {row['step_ratio']:7.3f} {per_round:8.3f}"
            f" {row['compile_ratio']:9.2f} {conds:6d} {copies:7d}"
        )
    print("targets: ls step x <= 1.15, ls compile x <= 2")
    if timing.noisy():
        print("warning: noisy run (a spread above 0.25); rerun on a quiet machine")
    if args.json:
        with open(args.json, "w") as f:
            report = {"quick": args.quick, "inner": args.inner, "rounds": rounds}
            json.dump({**report, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
