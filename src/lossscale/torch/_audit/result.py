"""What the float16 audit found (:func:`lossscale.torch.audit`): the places float16 overflows,
the plan that keeps the fewest modules in float32, and the loss scales that then fit."""

from __future__ import annotations

import os

import torch

from lossscale.numerics import Report, format_scale
from lossscale.torch._audit.finding import Finding
from lossscale.torch._audit.handle import PlanHandle
from lossscale.torch._audit.plan import Float16Plan, plan_of

__all__ = ["Float16Audit"]


class Float16Audit:
    """The result of :func:`lossscale.torch.audit`; ``str()`` is a readable table.

    Attributes:
      mode: ``"autocast"`` or ``"half"``, as audited.
      batches: how many batches were run (over all ranks, see ``ranks``).
      findings: every :class:`Finding`, in the order the run first met each (forward places in
        execution order, then backward ones); the plan's search may meet some only once an
        earlier one is fixed (in ``"half"`` mode, a kept module's output cast back to float16:
        op ``"to"`` in that module, where an enclosing module is then tried). In ``"half"``
        mode a parameter that float16 cannot hold (above 65504) comes first: op
        ``"parameter"`` in its module, not fixable, its ``note`` naming it.
      float32_modules: the plan: the names of the modules to run in float32 so that no
        intrinsic finding remains (1-minimal: with any one left out, one comes back). Empty
        when float16 needs no help.
      modules: how many modules the model has (``len(list(model.named_modules()))``).
      scale_range: ``(low, high)``, powers of two: with the plan applied, at every loss scale
        in it no float16 gradient overflows and at most ``underflow`` of any parameter
        gradient's nonzero entries underflow to zero (entries below float32's rounding level
        of the gradient, 2**-24 of its global norm, left out); None when no scale does
        (``reason`` says why).
      initial_scale: where a dynamic loss scale should start: in ``scale_range``, three
        doublings below its top (``max(low, high / 8)``: room for the gradients' growth in the
        first steps of training, measured on the weights as they are), None without a range.
      underflow: the threshold the range was found with.
      reason: why there is no range (``""`` when there is one).
      verified: whether the batches, run again in float16 with the plan applied (through
        :meth:`apply`) at ``initial_scale``, gave a finite loss and finite gradients (None
        when the audit ran with ``verify=False``).
      checkpointing: what the audit turned off for its runs and put back after: the names of
        the modules whose gradient checkpointing was on (transformers'
        ``gradient_checkpointing_enable()``), and ``"torch.utils.checkpoint.checkpoint"`` when
        calls of it ran without checkpointing (``()``: none). The runs watch the forward
        pass itself, not a recomputation; the findings are those of the model without it.
      ranks: how many ranks audited together (a model in ``DistributedDataParallel`` or
        sharded by FSDP2's ``fully_shard``: each rank its own batches; the findings are their
        union, the range their intersection, the same on every rank; ``report`` holds this
        rank's batches); 1 otherwise.
      report: a :class:`lossscale.numerics.Report` with a step per batch: each leaf module's
        output in the float32 run (``forward:<module>``) and each parameter's float32
        gradient, as float16 would hold them at loss scale 1, so its table, log and heatmap
        show activations too (None when audited with ``report=False``).

    Example:
      >>> import torch
      >>> from lossscale.torch import audit
      >>> _ = torch.manual_seed(0)
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
      >>> result = audit(model, lambda m, x: m(x).float().sum(), [torch.randn(8, 4)])
      >>> result.float32_modules, result.intrinsic, result.verified
      ((), (), True)
      >>> low, high = result.scale_range
      >>> low <= result.initial_scale <= high
      True
      >>> str(result).splitlines()[-3]
      'plan: keep 0 of 3 modules in float32: none needed'
    """

    def __init__(
        self,
        *,
        mode: str,
        batches: int,
        findings: tuple[Finding, ...],
        float32_modules: tuple[str, ...],
        modules: int,
        scale_range: tuple[float, float] | None,
        initial_scale: float | None,
        underflow: float,
        reason: str,
        verified: bool | None,
        report: Report | None,
        checkpointing: tuple[str, ...] = (),
        ranks: int = 1,
    ) -> None:
        self.mode = mode
        self.batches = batches
        self.findings = findings
        self.float32_modules = float32_modules
        self.modules = modules
        self.scale_range = scale_range
        self.initial_scale = initial_scale
        self.underflow = underflow
        self.reason = reason
        self.verified = verified
        self.report = report
        self.checkpointing = checkpointing
        self.ranks = ranks

    @property
    def first_overflow(self) -> Finding | None:
        """The first finding, or None when float16 overflows nowhere."""
        return self.findings[0] if self.findings else None

    @property
    def intrinsic(self) -> tuple[Finding, ...]:
        """The findings no loss scale avoids."""
        return tuple(f for f in self.findings if f.intrinsic)

    @property
    def plan(self) -> Float16Plan:
        """The plan and what the audit measured, without the model or the batches: what
        :meth:`save` writes and :func:`lossscale.torch.load_plan` reads back."""
        return plan_of(self)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :attr:`plan` to ``path`` as JSON: the modules to keep in float32, the mode,
        the scale range, the initial scale, the findings, and lossscale's and torch's versions
        (format version 1, described in the float16 audit guide). Read it in any process with
        :func:`lossscale.torch.load_plan`: audit once, apply in every worker.

        Raises:
          TypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        """
        self.plan.save(path)

    def apply(
        self, model: torch.nn.Module, *, output_dtype: torch.dtype | None = None
    ) -> PlanHandle:
        """Put the plan on ``model``: each module in :attr:`float32_modules` runs in float32
        (see :class:`~lossscale.torch.PlanHandle`) until the handle's ``remove()``; the same as
        :meth:`lossscale.torch.Float16Plan.apply` (which documents ``output_dtype``, for
        models FSDP runs in float16, and the wrappers it sees through).

        In ``"half"`` mode call it on the float16 model (after ``model.half()``): the kept
        modules' parameters become float32 while the handle is live. A model in
        ``DistributedDataParallel`` gets the plan on its ``module`` (the names the audit used).

        Raises:
          TypeError: ``model`` is not a ``torch.nn.Module``.
          ValueError: ``model`` has no module of one of those names, another live plan
            keeps one of them, or its parameters are not of the plan's mode (nothing is
            changed).
        """
        return self.plan.apply(model, output_dtype=output_dtype)

    def __repr__(self) -> str:
        return (
            f"Float16Audit(mode={self.mode!r}, findings={len(self.findings)}, "
            f"float32_modules={self.float32_modules!r}, scale_range={self.scale_range!r}, "
            f"initial_scale={self.initial_scale!r}, verified={self.verified!r})"
        )

    def __str__(self) -> str:
        n_in = len(self.intrinsic)
        on = f" on {self.ranks} ranks" if self.ranks > 1 else ""
        head = (
            f"float16 audit ({self.mode}, {self.batches} batch{'es' * (self.batches != 1)}{on}): "
            f"{len(self.findings)} place{'s' * (len(self.findings) != 1)} overflow"
            f"{'s' * (len(self.findings) == 1)}; {n_in} intrinsic, "
            f"{len(self.findings) - n_in} bound the loss scale"
        )
        lines = [head]
        if self.findings:
            cells = [["#", "phase", "module", "op", "amax", "class"]]
            for i, f in enumerate(self.findings, 1):
                kind = f.kind
                if not f.intrinsic and f.scale is not None:
                    kind += f" (overflows at {format_scale(f.scale)})"
                if not f.fixable:
                    kind += ", no module-local fix (*)"
                cells.append([str(i), f.phase, f.module or "(root)", f.op, f"{f.amax:.3g}", kind])
            widths = [max(len(c[i]) for c in cells) for i in range(5)]
            for c in cells:
                left = [c[0].rjust(widths[0])] + [
                    v.ljust(w) for v, w in zip(c[1:5], widths[1:], strict=True)
                ]
                lines.append("  " + "  ".join([*left, c[5]]).rstrip())
        notes = dict.fromkeys(f.note for f in self.findings if not f.fixable)
        lines.extend(f"  (*) {note}" for note in notes)
        kept = ", ".join(self.float32_modules) or ("none helps" if notes else "none needed")
        lines.append(
            f"plan: keep {len(self.float32_modules)} of {self.modules} modules in float32: {kept}"
        )
        if self.scale_range is None:
            lines.append(f"loss scale: no power of two fits: {self.reason}")
        else:
            low, high = self.scale_range
            start = "-" if self.initial_scale is None else format_scale(self.initial_scale)
            lines.append(
                f"loss scale: {format_scale(low)} .. {format_scale(high)} (no float16 "
                f"gradient overflows, at most {self.underflow:.2%} of a gradient's nonzero "
                f"entries underflow); start at {start}"
            )
        if self.checkpointing:
            lines.append(
                f"gradient checkpointing: off for the audit's runs, on again after "
                f"({len(self.checkpointing)} place{'s' * (len(self.checkpointing) != 1)}: "
                f"{', '.join(self.checkpointing)})"
            )
        if self.verified is None:
            lines.append("verified: not run (verify=False)")
        else:
            at = format_scale(1.0 if self.initial_scale is None else self.initial_scale)
            gives = "a finite loss and finite" if self.verified else "a non-finite loss or"
            lines.append(
                f"verified: {'yes' if self.verified else 'NO'}: the batches in float16 with "
                f"the plan applied give {gives} gradients at loss scale {at}"
            )
        return "\n".join(lines)
