"""Lightning: keep schedulers and EMA-style callbacks from advancing on skipped steps
(Lightning steps its schedulers after every optimizer step, skipped or not): the mixin
:class:`SkipAwareSchedulers` for automatic optimization, :func:`last_step_applied` for manual
optimization and callbacks. Imports no Lightning; ``import lossscale.torch`` does not import
this module. Outside Lightning, every torch front end has ``step_scheduler(scheduler)`` and
``read_last_step_applied()`` itself."""

from __future__ import annotations

from typing import Any, cast

from lossscale.torch._reader import ScaleReader

__all__ = ["SkipAwareSchedulers", "last_step_applied"]


def _scaler_of(source: Any) -> ScaleReader | None:
    """The loss scaler behind ``source`` (None: Lightning runs without one)."""
    if isinstance(source, ScaleReader):  # a GradScaler, LossScaleOptimizer, ...
        return source
    # a LightningModule reaches its Trainer (raising when it is not attached to one)
    trainer = source if hasattr(source, "precision_plugin") else source.trainer
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and not isinstance(scaler, ScaleReader):
        raise TypeError(
            f"Lightning's precision plugin holds {type(scaler).__module__}."
            f"{type(scaler).__qualname__}, which does not report skipped steps: pass "
            "lossscale's, e.g. Trainer(plugins=[MixedPrecision('16-mixed', 'cuda', "
            "scaler=lossscale.torch.GradScaler('cuda'))])"
        )
    return scaler


def last_step_applied(source: Any) -> bool:
    """Whether the last optimizer step was applied (False: the loss scaler skipped it, for
    non-finite gradients), as a Python bool.

    ``source``: a Lightning ``Trainer`` or ``LightningModule`` (its ``MixedPrecision``
    plugin's scaler), or any :class:`lossscale.torch.ScaleReader` (lossscale's ``GradScaler``,
    ``LossScaleOptimizer``, the DeepSpeed and Megatron scalers). True when
    Lightning runs without a scaler. Call it after the optimizer step (and ``update()``).

    >>> import torch
    >>> from lossscale.torch import GradScaler
    >>> from lossscale.torch.lightning import last_step_applied
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt, scaler = torch.optim.SGD([w], lr=0.1), GradScaler("cpu")
    >>> w.grad = torch.tensor([float("inf"), 1.0])   # an overflow
    >>> scaler.step(opt); scaler.update()
    >>> last_step_applied(scaler), w.tolist()
    (False, [1.0, 1.0])

    Host syncs: none by default (the decision was read on the host); one after a fused
    optimizer's device-side step (``device_side_skip=True``, a GPU).

    Raises:
      TypeError: the Trainer's scaler does not report skips (``torch.amp.GradScaler``, which
        Lightning builds for ``precision="16-mixed"`` when no scaler is given).
      RuntimeError: a LightningModule that is not attached to a Trainer.
    """
    scaler = _scaler_of(source)
    if scaler is None:
        return True
    return bool(scaler.read_last_step_applied())


def _interval(module: Any, scheduler: Any) -> str:
    for config in module.trainer.lr_scheduler_configs:
        if config.scheduler is scheduler:
            return cast(str, config.interval)
    return "step"


class SkipAwareSchedulers:
    """A LightningModule mixin: step-interval schedulers do not advance on skipped steps.

    Its ``lr_scheduler_step`` drops Lightning's call for an ``"interval": "step"`` scheduler
    after a skipped step (with ``"frequency": n``, when that batch's step was skipped);
    ``"epoch"`` schedulers step as Lightning calls them. Put it first among the bases
    (``class Model(SkipAwareSchedulers, LightningModule)``), with lossscale's ``GradScaler``
    in the ``MixedPrecision`` plugin (a ``TypeError`` names the fix otherwise). Costs what
    :func:`last_step_applied` costs per call.

    What Lightning's call does after a skipped step (the Trainer's parts it reads, by hand):

    >>> from types import SimpleNamespace
    >>> import torch
    >>> from lossscale.torch import GradScaler
    >>> from lossscale.torch.lightning import SkipAwareSchedulers
    >>> w = torch.nn.Parameter(torch.ones(1))
    >>> opt, scaler = torch.optim.SGD([w], lr=1.0), GradScaler("cpu")
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    >>> class Base:
    ...     def lr_scheduler_step(self, scheduler, metric):
    ...         scheduler.step()
    >>> class Model(SkipAwareSchedulers, Base):
    ...     trainer = SimpleNamespace(
    ...         precision_plugin=SimpleNamespace(scaler=scaler),
    ...         lr_scheduler_configs=[SimpleNamespace(scheduler=sched, interval="step")])
    >>> w.grad = torch.tensor([float("nan")])
    >>> scaler.step(opt); scaler.update()                 # skipped
    >>> Model().lr_scheduler_step(sched, None)            # dropped
    >>> sched.last_epoch, opt.param_groups[0]["lr"]
    (0, 1.0)
    """

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step ``scheduler`` as Lightning would, unless it has ``"interval": "step"`` and the
        last optimizer step was skipped."""
        if _interval(self, scheduler) == "step" and not last_step_applied(self):
            return
        cast(Any, super()).lr_scheduler_step(scheduler, metric)
