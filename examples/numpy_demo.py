"""The library's NumPy demo: float16 training with and without ``lossscale.DynamicLossScale``.

A small MLP is trained in float16 with NumPy alone (no torch, no JAX), on data whose float16
gradients underflow: once without loss scaling, once with ``lossscale.DynamicLossScale``. The
demo prints the final loss, skipped steps and final scale of both runs, and a verdict. It is
``python -m lossscale demo`` (``lossscale.demo.main``); the training loop is
``lossscale.demo.run``.

Run it::

    python examples/numpy_demo.py               # exactly `python -m lossscale demo` (400 steps)
    python examples/numpy_demo.py --quick       # 100 steps (CI)
    python examples/numpy_demo.py --steps 1000 --seed 3 --plot curves.png   # needs matplotlib

After the demo's own output, the script checks the result with ``lossscale.demo.run`` (the
demo is deterministic, so it trains the same two runs again, silently) and exits with status 1
if loss scaling did not work: the scaled run must end below half the unscaled run's final loss
and below its own initial loss.
"""

from __future__ import annotations

import argparse
import sys

import lossscale.demo

QUICK_STEPS = 100


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps (for CI)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 400)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="OUT.png", help="save the curves (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cli = ["demo"]  # the arguments of `python -m lossscale demo`; none by default
    steps = args.steps if args.steps is not None else QUICK_STEPS if args.quick else None
    if steps is not None:
        cli += ["--steps", str(steps)]
    if args.seed != 0:
        cli += ["--seed", str(args.seed)]
    if args.plot is not None:
        cli += ["--plot", args.plot]
    if args.no_progress:
        cli += ["--no-progress"]
    code = lossscale.demo.main(cli)
    if code != 0:
        sys.exit(code)

    same = {"seed": args.seed} if steps is None else {"seed": args.seed, "steps": steps}
    unscaled = lossscale.demo.run(scaled=False, **same)  # the demo's default steps if None
    scaled = lossscale.demo.run(scaled=True, **same)
    print(
        f"\ncheck: final loss {scaled.final_loss:.3g} with loss scaling, "
        f"{unscaled.final_loss:.3g} without; {scaled.skipped} skipped steps"
    )
    if not scaled.final_loss < min(0.5 * unscaled.final_loss, scaled.initial_loss):
        sys.exit("FAILED: loss scaling did not beat float16 training without it")
    print("OK")


if __name__ == "__main__":
    main()
