"""lossscale.jax vs a plain optax step, jmp and optax.apply_if_finite (CPU, jit).

Run: ``python -m benchmarks.jax_bench [--quick] [--rounds N] [--inner sgd,adam] [--json F]``

The anchors' setup (shared/reference/jax_keras_anchors.md §3): 200 float32 leaves,
10,035,200 elements (100 x (256, 320) + 100 x (64, 288)); loss sum_i mean((x_i @ p_i) ** 2) with
batch 4; every step jitted with donated buffers. Variants, interleaved round by round, per
inner optimizer (``--inner``: optax.sgd by default, optax.adam):

  plain        the inner optimizer, no loss scaling
  ls-select    lossscale.jax.loss_scale_optimizer(inner), skip_strategy='select' (default)
  ls-cond      the same, skip_strategy='cond'
  jmp          jmp's documented recipe (jmp.DynamicLossScale: scale the loss, unscale,
               all_finite, adjust, select_tree over params and opt_state). When jmp is not
               installed, the same recipe written inline with jnp (the JSON says which).
  apply-if-finite  optax.apply_if_finite(inner, 5) (skips non-finite steps, no scaling)

Reported per variant: median step time, interquartile spread, minimum; the median step time
*back to back* (blocks of consecutive calls of the same step, as a training loop makes them,
blocks alternating over the variants: the caches then hold what the same step left, where
the interleaved rounds run each step after the other variants'); two build times, each
the median of ``--compile-reps`` builds interleaved across the variants (fewer once a variant's
builds exceed ``COMPILE_BUDGET_S`` in all), every build from a fresh wrapper with JAX's caches
cleared: ``compile`` is XLA's compilation alone (``Lowered.compile``) and ``build`` is trace +
lower + compile, what the first call of a jitted step waits for (the anchors' "compile" column
is this one: their jmp and apply_if_finite ratios are reproduced by it, not by XLA's part
alone); and in the compiled HLO the number of conditionals and copies. Ratios are against
``plain`` (targets: step <= 1.15x, compile <= 2x). Speed is
never asserted.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from lossscale.jax import loss_scale_optimizer, scale_loss

if not __package__:  # run as a file (python benchmarks/NAME.py): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _cli, _report
from benchmarks._timing import NOISY_SPREAD, back_to_back, interleaved

try:
    import jmp
except ImportError:  # not a dependency of lossscale: its recipe is then written inline
    jmp = None

LR = 1e-3
SCALE = 2.0**15
JMP_PERIOD = 2000
#: Compilations of one variant stop repeating once they took this long in all (the jmp recipe
#: compiles for minutes on 200 leaves on a 2-core CPU; one such compile is timed well enough).
COMPILE_BUDGET_S = 10.0
INNER: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(LR),
    "adam": lambda: optax.adam(LR),
}

MakeInner = Callable[[], optax.GradientTransformation]
Variant = tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]  # (init(params), step(state, xs))


def make_problem(quick: bool) -> tuple[list[jax.Array], list[jax.Array]]:
    """Parameters and inputs: the anchors' 200 leaves, or 20 tiny ones when ``quick``."""
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


# -- the variants -------------------------------------------------------------------------------


def optax_variant(opt: optax.GradientTransformation) -> Variant:
    """A step that differentiates the loss and applies ``opt`` (no loss scaling)."""

    def step(state: Any, xs: Any) -> Any:
        params, opt_state = state
        grads = jax.grad(loss_fn)(params, xs)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return lambda p: (p, opt.init(p)), step


def plain(make_inner: MakeInner) -> Variant:
    return optax_variant(make_inner())


def apply_if_finite(make_inner: MakeInner) -> Variant:
    return optax_variant(optax.apply_if_finite(make_inner(), max_consecutive_errors=5))


def lossscale_variant(make_inner: MakeInner, strategy: str) -> Variant:
    """lossscale's optax transformation: scaled loss in, unscale + check + skip inside."""
    opt = loss_scale_optimizer(make_inner(), skip_strategy=strategy)

    def step(state: Any, xs: Any) -> Any:
        params, opt_state = state
        grads = jax.grad(lambda p: scale_loss(loss_fn(p, xs), opt_state))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return lambda p: (p, opt.init(p)), step


def jmp_variant(make_inner: MakeInner) -> Variant:
    """jmp 0.0.4's documented recipe with jmp itself.

    The jitted state holds jmp's scale and counter as arrays and the step rebuilds the
    ``jmp.DynamicLossScale`` from them: jmp's pytree re-validates its leaves on unflattening,
    which fails on the placeholders of ``jax.jit(...).lower`` (jax >= 0.5).
    """
    opt = make_inner()

    def init(params: Any) -> Any:
        return params, opt.init(params), (jnp.float32(SCALE), jnp.int32(0))

    def step(state: Any, xs: Any) -> Any:
        params, opt_state, (scale, counter) = state
        ls = jmp.DynamicLossScale(scale, counter, period=JMP_PERIOD)
        grads = ls.unscale(jax.grad(lambda p: ls.scale(loss_fn(p, xs)))(params))
        finite = jmp.all_finite(grads)
        updates, new_opt_state = opt.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), new_opt_state)
        ls = ls.adjust(finite)
        return (*jmp.select_tree(finite, new, (params, opt_state)), (ls.loss_scale, ls.counter))

    return init, step


def jmp_inline_variant(make_inner: MakeInner) -> Variant:
    """jmp 0.0.4's recipe (loss_scale.py) written inline, for when jmp is not installed."""
    opt = make_inner()

    def init(params: Any) -> Any:
        return params, opt.init(params), (jnp.float32(SCALE), jnp.int32(0))

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


VARIANTS: dict[str, Callable[[MakeInner], Variant]] = {
    "plain": plain,
    "ls-select": lambda m: lossscale_variant(m, "select"),
    "ls-cond": lambda m: lossscale_variant(m, "cond"),
    "jmp": jmp_variant if jmp is not None else jmp_inline_variant,
    "apply-if-finite": apply_if_finite,
}


def jmp_description() -> str:
    if jmp is None:
        return "not installed; its recipe written inline with jnp"
    return f"jmp {getattr(jmp, '__version__', '?')}"


# -- measuring -----------------------------------------------------------------------------------


def build_once(step: Callable[..., Any], state: Any, xs: Any) -> tuple[Any, float, float]:
    """Trace, lower and compile ``step`` from a fresh wrapper with JAX's caches cleared (no
    trace or compile cache hit); return the executable, the build time (trace + lower +
    compile: what the first call of a jitted step waits for) and the XLA compile time."""
    jax.clear_caches()
    t0 = time.perf_counter()
    lowered = jax.jit(lambda s, x: step(s, x), donate_argnums=(0,)).lower(state, xs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, t2 - t0, t2 - t1


def build_variants(
    variants: dict[str, tuple[Callable[..., Any], Any]], xs: Any, reps: int
) -> dict[str, tuple[Any, list[float], list[float]]]:
    """Build every variant ``reps`` times, interleaved round by round (the machine's drift hits
    all variants alike); a variant stops repeating once its builds took ``COMPILE_BUDGET_S``
    in all. Returns per variant: the last executable, build times and compile times."""
    out: dict[str, tuple[Any, list[float], list[float]]] = {}
    for _ in range(reps):
        for name, (step, state) in variants.items():
            if name in out and sum(out[name][1]) >= COMPILE_BUDGET_S:
                continue
            compiled, build, xla = build_once(step, state, xs)
            _, builds, compiles = out.get(name, (None, [], []))
            out[name] = (compiled, [*builds, build], [*compiles, xla])
    return out


def bench_inner(
    inner: str,
    params: list[jax.Array],
    xs: list[jax.Array],
    rounds: int,
    reps: int,
    warmup: int,
    b2b: tuple[int, int],
) -> list[dict[str, Any]]:
    """Compile every variant around ``inner``, then time their steps in one interleaved run."""
    steps: dict[str, tuple[Callable[..., Any], Any]] = {}
    states: dict[str, Any] = {}
    for name, make in VARIANTS.items():
        init, step = make(INNER[inner])
        states[name] = init(jax.tree_util.tree_map(jnp.copy, params))
        steps[name] = (step, states[name])
    built = build_variants(steps, xs, reps)
    compiled = {name: b[0] for name, b in built.items()}
    build_s = {name: statistics.median(b[1]) for name, b in built.items()}
    compile_s = {name: statistics.median(b[2]) for name, b in built.items()}
    texts = {name: c.as_text() or "" for name, c in compiled.items()}
    hlo = {name: (t.count(" conditional("), t.count(" copy(")) for name, t in texts.items()}

    def runner(name: str) -> Callable[[], None]:
        def run() -> None:
            states[name] = jax.block_until_ready(compiled[name](states[name], xs))

        return run

    timing = interleaved({n: (None, runner(n)) for n in VARIANTS}, rounds=rounds, warmup=warmup)
    blocks = back_to_back({n: runner(n) for n in VARIANTS}, *b2b)
    base = timing.median("plain")
    rows = []
    for name in VARIANTS:
        samples = timing.samples[name]
        rows.append(
            {
                "inner": inner,
                "variant": name,
                "median_ms": timing.median(name) * 1e3,
                "spread": timing.spread(name),
                "min_ms": min(samples) * 1e3,
                "b2b_ms": blocks.median(name) * 1e3,
                "b2b_ratio": blocks.median(name) / blocks.median("plain"),
                "b2b_noisy": blocks.noisy(NOISY_SPREAD, [name, "plain"]),
                "compile_s": compile_s[name],
                "step_ratio": timing.median(name) / base,
                "per_round_ratio": statistics.median(
                    a / b for a, b in zip(samples, timing.samples["plain"], strict=True)
                ),
                "compile_ratio": compile_s[name] / compile_s["plain"],
                "build_s": build_s[name],
                "build_ratio": build_s[name] / build_s["plain"],
                "compilations": len(built[name][1]),
                "conditionals": hlo[name][0],
                "copies": hlo[name][1],
                "noisy": timing.noisy(NOISY_SPREAD, [name, "plain"]),
            }
        )
    return rows


def run(
    quick: bool = False,
    rounds: int | None = None,
    compile_reps: int | None = None,
    inners: list[str] | None = None,
) -> dict[str, Any]:
    """The JAX section of the report."""
    rounds = rounds or (5 if quick else 40)
    reps = compile_reps or (1 if quick else 3)
    warmup = 2 if quick else 3
    b2b = (2, 3) if quick else (8, 10)  # back-to-back: blocks, steps per block
    inners = inners or ["sgd"]
    params, xs = make_problem(quick)
    # Warm up the compiler once, so the first variant does not pay its start-up cost.
    jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(3)).compile()
    rows = []
    for inner in inners:
        inner_rows = bench_inner(inner, params, xs, rounds, reps, warmup, b2b)
        for r in inner_rows:
            _cli.progress(
                f"jax {inner}/{r['variant']}: step x{r['step_ratio']:.2f}, "
                f"compile x{r['compile_ratio']:.2f}"
            )
        rows += inner_rows
    return {
        "framework": "jax",
        "config": {
            "quick": quick,
            "rounds": rounds,
            "warmup": warmup,
            "back_to_back": {"blocks": b2b[0], "steps": b2b[1]},
            "compile_reps": reps,
            "compile_budget_s": COMPILE_BUDGET_S,
            "inners": inners,
            "platform": jax.devices()[0].platform,
            "leaves": len(params),
            "elements": int(sum(p.size for p in params)),
            "jax": jax.__version__,
            "optax": optax.__version__,
            "jmp": jmp_description(),
        },
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = _cli.parser(__doc__)
    ap.add_argument("--compile-reps", type=int, default=None, help="compilations per variant")
    ap.add_argument("--inner", default=None, help="comma-separated of: " + ", ".join(INNER))
    args = ap.parse_args(argv)
    inners = args.inner.split(",") if args.inner else None
    if inners and not set(inners) <= set(INNER):
        ap.error(f"--inner: choose from {', '.join(INNER)}")
    section = run(args.quick, args.rounds, args.compile_reps, inners)
    return _cli.finish(section, args.json, _report.render_jax)


if __name__ == "__main__":
    raise SystemExit(main())
