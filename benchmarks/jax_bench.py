"""lossscale.jax vs a plain optax step, jmp and optax.apply_if_finite (CPU, jit).

Run: ``python -m benchmarks.jax_bench [--quick] [--rounds N] [--inner sgd,adam]
[--model anchors,mlp] [--donate yes,no] [--json F]``

Two models (``--model``):

  anchors  the anchors' setup (shared/reference/jax_keras_anchors.md §3): 200 float32 leaves,
           10,035,200 elements (100 x (256, 320) + 100 x (64, 288)); loss
           sum_i mean((x_i @ p_i) ** 2) with batch 4 (XLA fuses most of the gradient work
           into the update: it hides what a real backward pass shows)
  mlp      a real multi-layer perceptron: 11 dense layers of 960 x 960 with biases (22 leaves,
           10,147,200 elements), ReLU, mean squared error against a random target, batch 64;
           forward and backward pass

Inner optimizers (``--inner``, all by default): optax.sgd, optax.sgd with momentum 0.9,
optax.adam, optax.adamw and optax.chain(optax.clip_by_global_norm(1.0), optax.adamw). Every
step is jitted with its state donated (``--donate yes``) and without (``--donate no``); the
peers (jmp, apply-if-finite) run in the donated rows only. Variants, interleaved round by
round, per model, inner optimizer and donation:

  plain        the inner optimizer, no loss scaling
  floor        what any exact skip costs at least: the inner update executed as ls-select
               executes it (each new state value selected where it is defined), behind a
               flag that waits for every gradient but reads one element of each (no
               scaling, no full check). What remains is the barrier: no update may start
               before the last gradient exists. ls-select minus floor is the finite check's
               own read of the gradients
  read         the plain step plus one more read of every gradient, a bare sum of each leaf
               returned beside the state and gating nothing (not a check: a sum of finite
               values can overflow): what one more pass over the gradients costs, with no
               barrier. An exact check makes such a pass; ls-select minus floor against
               read minus plain compares the check's read with a bare one
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
alone); in the compiled HLO the number of conditionals and copies; and the minor page faults
per step (XLA:CPU's temporary buffers are allocated on every call). Ratios are against
``plain`` (targets, issue 20: sgd <= 1.10x back to back and compile <= 2x, adam <= 1.15x).
Speed is never asserted.
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
from lossscale.jax._skip import select_at_definition  # ls-select's execution, for `floor`

if not __package__:  # run as a file (python benchmarks/NAME.py): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _cli, _report
from benchmarks._timing import NOISY_SPREAD, back_to_back, interleaved

try:
    import resource
except ImportError:  # not on Windows: page faults are then not counted
    resource = None  # type: ignore[assignment]

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
    "momentum": lambda: optax.sgd(LR, momentum=0.9),
    "adam": lambda: optax.adam(LR),
    "adamw": lambda: optax.adamw(LR),
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR)),
}
#: Steps over which page faults are counted, per variant (after the timed ones).
FAULT_STEPS = 5
#: The MLP: layers, width, batch (full size; ``--quick`` shrinks the width).
MLP_LAYERS, MLP_WIDTH, MLP_BATCH = 11, 960, 64

MakeInner = Callable[[], optax.GradientTransformation]
Variant = tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]  # (init(params), step(state, xs))
Loss = Callable[[Any, Any], jax.Array]  # loss(params, batch)


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


def make_mlp(quick: bool) -> tuple[list[dict[str, jax.Array]], tuple[jax.Array, jax.Array]]:
    """The MLP's parameters (He-scaled weights, zero biases) and one batch (inputs, targets)."""
    width = 32 if quick else MLP_WIDTH
    key = jax.random.PRNGKey(1)
    params = []
    for _ in range(MLP_LAYERS):
        key, k = jax.random.split(key)
        w = jax.random.normal(k, (width, width), jnp.float32) * (2 / width) ** 0.5
        params.append({"w": w, "b": jnp.zeros((width,), jnp.float32)})
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (MLP_BATCH, width), jnp.float32)
    y = jax.random.normal(ky, (MLP_BATCH, width), jnp.float32)
    return params, (x, y)


def mlp_loss(params: list[dict[str, jax.Array]], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean squared error of the MLP (ReLU between layers) against the batch's targets."""
    h, y = batch
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return jnp.mean((h - y) ** 2)


MODELS: dict[str, tuple[Callable[[bool], tuple[Any, Any]], Loss]] = {
    "anchors": (make_problem, loss_fn),
    "mlp": (make_mlp, mlp_loss),
}


# -- the variants -------------------------------------------------------------------------------


def optax_variant(opt: optax.GradientTransformation, loss_fn: Loss) -> Variant:
    """A step that differentiates the loss and applies ``opt`` (no loss scaling)."""

    def step(state: Any, xs: Any) -> Any:
        params, opt_state = state
        grads = jax.grad(loss_fn)(params, xs)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return lambda p: (p, opt.init(p)), step


def plain(make_inner: MakeInner, loss_fn: Loss) -> Variant:
    return optax_variant(make_inner(), loss_fn)


def apply_if_finite(make_inner: MakeInner, loss_fn: Loss) -> Variant:
    return optax_variant(optax.apply_if_finite(make_inner(), max_consecutive_errors=5), loss_fn)


def floor_variant(make_inner: MakeInner, loss_fn: Loss) -> Variant:
    """The barrier alone: ``skip_strategy='select'``'s execution of the inner update behind a
    flag that depends on every gradient through one element of each (all of them finite).
    On finite gradients the same step as ``plain``, bit for bit."""
    opt = optax.with_extra_args_support(make_inner())

    def step(state: Any, xs: Any) -> Any:
        params, opt_state = state
        grads = jax.grad(loss_fn)(params, xs)
        # one concatenation of the first elements: a chain of scalar adds instead compiled
        # for 76 s on the anchors' 200 leaves (XLA:CPU) and ran slower than ls-select
        firsts = [
            lax.slice(lax.reshape(g, (g.size,)), (0,), (1,))
            for g in jax.tree_util.tree_leaves(grads)
        ]
        finite = lax.reduce_and(lax.is_finite(lax.concatenate(firsts, 0)), (0,))
        updates, opt_state = select_at_definition(opt.update, finite, grads, opt_state, params, {})
        return optax.apply_updates(params, updates), opt_state

    return lambda p: (p, opt.init(p)), step


def read_variant(make_inner: MakeInner, loss_fn: Loss) -> Variant:
    """The plain step, plus a bare sum of every gradient returned beside the state: one more
    read of the gradients with nothing waiting for it. The parameters and the inner state are
    the plain step's, bit for bit."""
    opt = make_inner()

    def step(state: Any, xs: Any) -> Any:
        params, opt_state, _ = state
        grads = jax.grad(loss_fn)(params, xs)
        total = sum((jnp.sum(g) for g in jax.tree_util.tree_leaves(grads)), jnp.float32(0))
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, total

    return lambda p: (p, opt.init(p), jnp.float32(0)), step


def lossscale_variant(make_inner: MakeInner, loss_fn: Loss, strategy: str) -> Variant:
    """lossscale's optax transformation: scaled loss in, unscale + check + skip inside."""
    opt = loss_scale_optimizer(make_inner(), skip_strategy=strategy)

    def step(state: Any, xs: Any) -> Any:
        params, opt_state = state
        grads = jax.grad(lambda p: scale_loss(loss_fn(p, xs), opt_state))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return lambda p: (p, opt.init(p)), step


def jmp_variant(make_inner: MakeInner, loss_fn: Loss) -> Variant:
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


def jmp_inline_variant(make_inner: MakeInner, loss_fn: Loss) -> Variant:
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


VARIANTS: dict[str, Callable[[MakeInner, Loss], Variant]] = {
    "plain": plain,
    "floor": floor_variant,
    "read": read_variant,
    "ls-select": lambda m, f: lossscale_variant(m, f, "select"),
    "ls-cond": lambda m, f: lossscale_variant(m, f, "cond"),
    "jmp": jmp_variant if jmp is not None else jmp_inline_variant,
    "apply-if-finite": apply_if_finite,
}
#: The variants of the rows without donation (the peers' recipes are timed donated only).
UNDONATED = ("plain", "floor", "read", "ls-select", "ls-cond")


def jmp_description() -> str:
    if jmp is None:
        return "not installed; its recipe written inline with jnp"
    return f"jmp {getattr(jmp, '__version__', '?')}"


# -- measuring -----------------------------------------------------------------------------------


def build_once(
    step: Callable[..., Any], state: Any, xs: Any, donate: bool
) -> tuple[Any, float, float]:
    """Trace, lower and compile ``step`` from a fresh wrapper with JAX's caches cleared (no
    trace or compile cache hit); return the executable, the build time (trace + lower +
    compile: what the first call of a jitted step waits for) and the XLA compile time."""
    jax.clear_caches()
    t0 = time.perf_counter()
    donated = (0,) if donate else ()
    lowered = jax.jit(lambda s, x: step(s, x), donate_argnums=donated).lower(state, xs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, t2 - t0, t2 - t1


def build_variants(
    variants: dict[str, tuple[Callable[..., Any], Any]], xs: Any, reps: int, donate: bool
) -> dict[str, tuple[Any, list[float], list[float]]]:
    """Build every variant ``reps`` times, interleaved round by round (the machine's drift hits
    all variants alike); a variant stops repeating once its builds took ``COMPILE_BUDGET_S``
    in all. Returns per variant: the last executable, build times and compile times."""
    out: dict[str, tuple[Any, list[float], list[float]]] = {}
    for _ in range(reps):
        for name, (step, state) in variants.items():
            if name in out and sum(out[name][1]) >= COMPILE_BUDGET_S:
                continue
            compiled, build, xla = build_once(step, state, xs, donate)
            _, builds, compiles = out.get(name, (None, [], []))
            out[name] = (compiled, [*builds, build], [*compiles, xla])
    return out


def minor_faults(run: Callable[[], None], steps: int) -> float | None:
    """Minor page faults of this process per call of ``run`` (None where ``resource`` is
    missing). XLA:CPU allocates a step's temporary buffers anew on every call; past glibc's
    mmap threshold (32 MiB at most) each call maps fresh pages and touches every one."""
    if resource is None:
        return None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        run()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def bench_group(
    model: str,
    inner: str,
    donate: bool,
    problem: tuple[Any, Any],
    rounds: int,
    reps: int,
    warmup: int,
    b2b: tuple[int, int],
) -> list[dict[str, Any]]:
    """Compile every variant of one (model, inner, donation), then time their steps in one
    interleaved run and in back-to-back blocks."""
    params, xs = problem
    loss = MODELS[model][1]
    names = list(VARIANTS) if donate else list(UNDONATED)
    steps: dict[str, tuple[Callable[..., Any], Any]] = {}
    states: dict[str, Any] = {}
    for name in names:
        init, step = VARIANTS[name](INNER[inner], loss)
        states[name] = init(jax.tree_util.tree_map(jnp.copy, params))
        steps[name] = (step, states[name])
    built = build_variants(steps, xs, reps, donate)
    compiled = {name: b[0] for name, b in built.items()}
    build_s = {name: statistics.median(b[1]) for name, b in built.items()}
    compile_s = {name: statistics.median(b[2]) for name, b in built.items()}
    texts = {name: c.as_text() or "" for name, c in compiled.items()}
    hlo = {name: (t.count(" conditional("), t.count(" copy(")) for name, t in texts.items()}

    def runner(name: str) -> Callable[[], None]:
        def run() -> None:
            states[name] = jax.block_until_ready(compiled[name](states[name], xs))

        return run

    timing = interleaved({n: (None, runner(n)) for n in names}, rounds=rounds, warmup=warmup)
    blocks = back_to_back({n: runner(n) for n in names}, *b2b)
    faults = {n: minor_faults(runner(n), FAULT_STEPS) for n in names}
    base = timing.median("plain")
    rows = []
    for name in names:
        samples = timing.samples[name]
        rows.append(
            {
                "model": model,
                "inner": inner,
                "donated": donate,
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
                "faults_per_step": faults[name],
                "noisy": timing.noisy(NOISY_SPREAD, [name, "plain"]),
            }
        )
    return rows


def run(
    quick: bool = False,
    rounds: int | None = None,
    compile_reps: int | None = None,
    inners: list[str] | None = None,
    models: list[str] | None = None,
    donation: list[bool] | None = None,
) -> dict[str, Any]:
    """The JAX section of the report."""
    rounds = rounds or (5 if quick else 40)
    reps = compile_reps or (1 if quick else 3)
    warmup = 2 if quick else 3
    b2b = (2, 3) if quick else (8, 10)  # back-to-back: blocks, steps per block
    inners = inners or (["sgd", "adam"] if quick else list(INNER))
    models = models or list(MODELS)
    donation = donation or ([True] if quick else [True, False])
    # Warm up the compiler once, so the first variant does not pay its start-up cost.
    jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(3)).compile()
    rows = []
    sizes = {}
    for model in models:
        problem = MODELS[model][0](quick)
        leaves = jax.tree_util.tree_leaves(problem[0])
        sizes[model] = {"leaves": len(leaves), "elements": int(sum(p.size for p in leaves))}
        for inner in inners:
            for donate in donation:
                group = bench_group(model, inner, donate, problem, rounds, reps, warmup, b2b)
                for r in group:
                    _cli.progress(
                        f"jax {model}/{inner}/{'donated' if donate else 'not donated'}/"
                        f"{r['variant']}: step x{r['step_ratio']:.2f}, "
                        f"b2b x{r['b2b_ratio']:.2f}, compile x{r['compile_ratio']:.2f}"
                    )
                rows += group
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
            "models": models,
            "donation": donation,
            "model_sizes": sizes,
            "platform": jax.devices()[0].platform,
            "leaves": sizes[models[0]]["leaves"],
            "elements": sizes[models[0]]["elements"],
            "jax": jax.__version__,
            "optax": optax.__version__,
            "jmp": jmp_description(),
        },
        "rows": rows,
    }


def _choices(ap: Any, flag: str, value: str | None, allowed: list[str]) -> list[str] | None:
    if not value:
        return None
    chosen = value.split(",")
    if not set(chosen) <= set(allowed):
        ap.error(f"{flag}: choose from {', '.join(allowed)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    ap = _cli.parser(__doc__)
    ap.add_argument("--compile-reps", type=int, default=None, help="compilations per variant")
    ap.add_argument("--inner", default=None, help="comma-separated of: " + ", ".join(INNER))
    ap.add_argument("--model", default=None, help="comma-separated of: " + ", ".join(MODELS))
    ap.add_argument("--donate", default=None, help="comma-separated of: yes, no")
    args = ap.parse_args(argv)
    inners = _choices(ap, "--inner", args.inner, list(INNER))
    models = _choices(ap, "--model", args.model, list(MODELS))
    donate = _choices(ap, "--donate", args.donate, ["yes", "no"])
    donation = [d == "yes" for d in donate] if donate else None
    section = run(args.quick, args.rounds, args.compile_reps, inners, models, donation)
    return _cli.finish(section, args.json, _report.render_jax)


if __name__ == "__main__":
    raise SystemExit(main())
