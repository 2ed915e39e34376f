"""Lightning: keep learning-rate schedulers and EMA-style callbacks from advancing on skipped
steps.

Lightning steps its schedulers after every optimizer step, whether the loss scaler applied the
step or skipped it (non-finite gradients), with any scaler. With
:class:`lossscale.torch.GradScaler` in Lightning's ``MixedPrecision`` plugin:

* automatic optimization: put :class:`SkipAwareSchedulers` first among a LightningModule's
  bases; Lightning's calls to step-interval schedulers after a skipped step are then dropped;
* manual optimization (you step the schedulers) and callbacks (EMA, weight averaging): ask
  :func:`last_step_applied` after the optimizer step.

Nothing here imports Lightning (it reads the objects it is given), and ``import
lossscale.torch`` does not import this module.
"""

from __future__ import annotations

from typing import Any, cast

__all__ = ["SkipAwareSchedulers", "last_step_applied"]


def _scaler_of(source: Any) -> Any:
    """The loss scaler behind ``source`` (None: Lightning runs without one)."""
    if hasattr(source, "read_last_step_applied"):  # a GradScaler or LossScaleOptimizer
        return source
    # a LightningModule reaches its Trainer (raising when it is not attached to one)
    trainer = source if hasattr(source, "precision_plugin") else source.trainer
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and not hasattr(scaler, "read_last_step_applied"):
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

    ``source``: a Lightning ``Trainer`` or ``LightningModule`` (the scaler of its
    ``MixedPrecision`` plugin), or a :class:`lossscale.torch.GradScaler` /
    :class:`lossscale.torch.LossScaleOptimizer` itself (e.g. timm's ``NativeScaler._scaler``).
    True when Lightning runs without a scaler (bfloat16 or 32-bit: no step is skipped).
    Call it after the optimizer step (and, for a GradScaler, its ``update()``, which
    Lightning's plugin calls right after ``step``).

    >>> import torch
    >>> from lossscale.torch import GradScaler
    >>> from lossscale.torch.lightning import last_step_applied
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt, scaler = torch.optim.SGD([w], lr=0.1), GradScaler("cpu")
    >>> w.grad = torch.tensor([float("inf"), 1.0])   # an overflow
    >>> scaler.step(opt); scaler.update()
    >>> last_step_applied(scaler), w.tolist()
    (False, [1.0, 1.0])

    Host syncs: none when the step's decision was read on the host, which is every step by
    default (unfused and fused optimizers, CPU and GPU); one (reading the flag) after a fused
    optimizer's step on a GPU with ``device_side_skip=True``, where the decision stayed on the
    device. (``bool(scaler.last_step_applied)`` reads a device tensor: one sync on a GPU
    either way.)

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

    Lightning calls ``lr_scheduler_step`` for every scheduler after every optimizer step
    (automatic optimization), skipped or not. This mixin's ``lr_scheduler_step`` drops the call
    for a scheduler with ``"interval": "step"`` when :func:`last_step_applied` says the step was
    skipped, so such a scheduler advances once per applied step. ``"interval": "epoch"``
    schedulers (they count epochs) are stepped as Lightning calls them. With ``"frequency": n``
    Lightning calls every n-th batch; the call is dropped when that batch's step was skipped.
    An ``lr_scheduler_step`` of your own in the module goes under this one (``super()``)::

        class Model(SkipAwareSchedulers, lightning.pytorch.LightningModule): ...

        trainer = Trainer(plugins=[MixedPrecision("16-mixed", "cuda", scaler=GradScaler())])

    Needs lossscale's scaler in the ``MixedPrecision`` plugin (a ``TypeError`` names the fix
    otherwise). Costs what :func:`last_step_applied` costs, per scheduler call: nothing by
    default; one host sync with ``device_side_skip=True`` and a fused optimizer on a GPU.
    In manual optimization Lightning does not step schedulers: call
    ``if last_step_applied(self): scheduler.step()`` after ``optimizer.step()``.

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
