"""A flax (nnx) MLP trained in float16 with ``lossscale.jax.loss_scale_optimizer`` over optax.

What it shows, on a synthetic regression task (no download):

* an ``nnx`` MLP that computes in float16 (``dtype=float16``) with float32 parameters
  (``param_dtype=float32``), the loss computed in float32;
* ``nnx.Optimizer(model, loss_scale_optimizer(optax.adam(...)), wrt=nnx.Param)``: the optax
  transformation takes the gradients of the *scaled* loss (``scale_loss``), unscales them,
  skips the step when one is not finite and adjusts the scale, all inside ``nnx.jit``;
* the scale starts deliberately high (2**24): the float16 backward pass overflows, those steps
  are skipped and the scale backs off until the gradients fit; later it grows again;
* one injected overflow (the scaled loss multiplied by inf at one step): skipped, the
  parameters do not move and the scale halves;
* reading the state outside ``jit``: ``current_scale``, ``skipped_steps`` and ``last_step_applied``
  of ``nnx.as_pure(optimizer.opt_state)`` (nnx wraps the state's arrays in ``OptArray``
  variables; ``as_pure`` gives plain arrays back).

The same transformation works with ``flax.training.train_state.TrainState``
(``tx=loss_scale_optimizer(...)``, ``state.apply_gradients(grads=scaled_grads)``), and the
state checkpoints with orbax: see "flax TrainState and orbax checkpoints" in
``docs/getting-started.md`` (run by CI) and ``src/lossscale/jax/_flax_test.py``.

Run it::

    python examples/flax_optax_mlp.py            # 300 steps
    python examples/flax_optax_mlp.py --quick    # 100 steps, ~10 s on 2 CPU cores (CI)
    python examples/flax_optax_mlp.py --dtype bfloat16

Most of the quick run's time is XLA compilation. It exits with status 1 if training did not
work (the final loss is not below half the initial loss, or the injected overflow was not
skipped).
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.typing import ArrayLike

from lossscale.jax import current_scale, last_step_applied, loss_scale_optimizer, scale_loss
from lossscale.jax import skipped_steps as get_skipped_steps

N_IN, N_HIDDEN, N_OUT, BATCH = 8, 64, 4, 128
INITIAL_SCALE = 2.0**24


class MLP(nnx.Module):
    """Two hidden tanh layers; float16 (or bfloat16) compute, float32 parameters."""

    def __init__(self, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        def linear(n_in: int, n_out: int) -> nnx.Linear:
            return nnx.Linear(n_in, n_out, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

        self.layers = nnx.List([linear(N_IN, N_HIDDEN), linear(N_HIDDEN, N_HIDDEN)])
        self.out = linear(N_HIDDEN, N_OUT)

    def __call__(self, x: ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.out(x)


def make_data(
    teacher: np.ndarray, rng: np.random.Generator, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Random inputs and the targets of the teacher function ``3 sin(x @ teacher)`` (NumPy:
    host data, sliced on the host)."""
    x = rng.standard_normal((n, N_IN), dtype=np.float32)
    return x, 3.0 * np.sin(x @ teacher)


def loss_fn(model: MLP, x: ArrayLike, y: ArrayLike) -> jax.Array:
    """Mean squared error, computed in float32 from the float16 predictions."""
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


eval_loss = nnx.jit(loss_fn)


@nnx.jit
def train_step(
    model: MLP, optimizer: nnx.Optimizer[MLP], x: ArrayLike, y: ArrayLike, poison: ArrayLike
) -> tuple[jax.Array, jax.Array]:
    """One step; ``poison`` multiplies the scaled loss by inf (an injected overflow)."""

    def scaled_loss(model: MLP) -> tuple[jax.Array, jax.Array]:
        loss = loss_fn(model, x, y)
        scaled = scale_loss(loss, optimizer.opt_state)  # float32, loss * current scale
        return jnp.where(poison, jnp.inf, 1.0) * scaled, loss

    (_, loss), scaled_grads = nnx.value_and_grad(scaled_loss, has_aux=True)(model)
    optimizer.update(model, scaled_grads)  # unscale, check, apply or skip, adjust the scale
    # [...]: the value of nnx's OptArray variable that wraps the state's array
    return loss, last_step_applied(optimizer.opt_state)[...]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps (for CI)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 300)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--overflow-step", type=int, default=40, help="step with an injected inf")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 100 if args.quick else 300
    if args.steps <= args.overflow_step:
        parser.error(f"--steps must be greater than --overflow-step ({args.overflow_step})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    teacher = rng.standard_normal((N_IN, N_OUT), dtype=np.float32) / np.sqrt(N_IN)
    x_train, y_train = make_data(teacher, rng, BATCH * 8)  # 8 batches, cycled
    x_eval, y_eval = make_data(teacher, rng, 512)

    model = MLP(dtype, nnx.Rngs(args.seed))
    tx = loss_scale_optimizer(
        optax.adam(3e-3), initial_scale=INITIAL_SCALE, dynamic_growth_steps=20
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, {args.dtype} compute, "
        f"{args.steps} steps, initial scale 2**{math.log2(INITIAL_SCALE):.0f}"
    )
    initial_loss = float(eval_loss(model, x_eval, y_eval))
    print(f"initial loss {initial_loss:.4f}")

    first_applied = None
    for step in range(args.steps):
        lo = (step % 8) * BATCH
        x, y = x_train[lo : lo + BATCH], y_train[lo : lo + BATCH]
        poisoned = step == args.overflow_step
        if poisoned:
            scale_before = float(current_scale(nnx.as_pure(optimizer.opt_state)))
            params_before = jax.tree.map(np.array, nnx.as_pure(nnx.state(model, nnx.Param)))
        loss, applied_flag = train_step(model, optimizer, x, y, np.bool_(poisoned))
        applied = bool(applied_flag)
        state = nnx.as_pure(optimizer.opt_state)  # plain arrays, for reading
        if applied and first_applied is None:
            first_applied = step
            if step > 0:
                print(
                    f"{args.dtype} overflows backed the scale off from "
                    f"2**{math.log2(INITIAL_SCALE):.0f} to "
                    f"2**{math.log2(float(current_scale(state))):.0f} in the first {step} steps"
                )
        if not applied or step % 25 == 0 or step == args.steps - 1:
            scale = float(current_scale(state))
            print(
                f"step {step:3d}  loss {float(loss):8.4f}  scale {scale:10.0f}"
                f"  {'applied' if applied else 'SKIPPED'}{'  (injected inf)' if poisoned else ''}"
            )
        if poisoned:
            params_after = nnx.as_pure(nnx.state(model, nnx.Param))
            unchanged = all(
                np.array_equal(a, b)
                for a, b in zip(
                    jax.tree.leaves(params_before), jax.tree.leaves(params_after), strict=True
                )
            )
            halved = float(current_scale(state)) == scale_before / 2
            print(
                f"injected overflow at step {step}: skipped={not applied}, "
                f"parameters unchanged={unchanged}, scale halved={halved}"
            )
            if applied or not unchanged or not halved:
                sys.exit("FAILED: the injected overflow was not skipped")

    state = nnx.as_pure(optimizer.opt_state)
    final_loss = float(eval_loss(model, x_eval, y_eval))
    skipped = int(get_skipped_steps(state))
    print(f"skipped steps {skipped}")
    print(f"loss scale {float(current_scale(state)):.0f}")
    print(f"final loss {final_loss:.4f} (initial {initial_loss:.4f})")
    if skipped < 1:
        sys.exit("FAILED: no step was skipped")
    if not final_loss < 0.5 * initial_loss:
        sys.exit(f"FAILED: the loss did not go down ({initial_loss:.4f} -> {final_loss:.4f})")
    print("OK")


if __name__ == "__main__":
    main()
