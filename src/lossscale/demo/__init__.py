"""The first-run demo: ``python -m lossscale demo`` (or the ``lossscale demo`` command).

It trains a small MLP in float16 with NumPy alone, once without loss scaling and once with
:class:`lossscale.DynamicLossScale`, on data whose float16 gradients underflow, and prints how
both runs ended. See :func:`lossscale.demo.run` for the training loop.
"""

from lossscale.demo._cli import main
from lossscale.demo._train import RunResult, run

__all__ = ["RunResult", "main", "run"]
