"""``audit``: where a torch model overflows in float16, which modules to keep in float32, and
the loss scales that then fit, found by running the model."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lossscale.core._validation import boolean, choice, fraction
from lossscale.numerics import Report
from lossscale.torch._audit.auditor import Auditor
from lossscale.torch._audit.checkpointing import checkpointing_off
from lossscale.torch._audit.handle import MODES, keep_float32
from lossscale.torch._audit.ops import read_all
from lossscale.torch._audit.ranks import across_ranks, agreed, rank_subject
from lossscale.torch._audit.result import Float16Audit
from lossscale.torch._audit.scales import (
    scale_range,
)
from lossscale.torch._audit.start import initial_scale
from lossscale.torch._audit.state import (
    old_objects_frozen,
    rng_reset,
    untouched_state,
)

__all__ = ["audit"]


def _check_model(model: Any) -> torch.device:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    floating = [p for p in model.parameters() if p.is_floating_point()]
    if not floating:
        raise ValueError(
            f"model ({type(model).__name__}) has no floating parameters: nothing runs in float16"
        )
    return floating[0].device


def _subjects(
    model: torch.nn.Module, mode: str, device: torch.device
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model to run in float16 and the float32 reference: the user's own where it is
    already what is needed, else a copy."""
    on_device = all(p.device == device for p in model.parameters())
    all_float32 = all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point())
    f32 = model if on_device and all_float32 else copy.deepcopy(model).to(device).float()
    f16 = copy.deepcopy(model).to(device).half() if mode == "half" else f32
    return f16, f32


def audit(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batches: Iterable[Any],
    *,
    mode: str = "autocast",
    device: str | torch.device | None = None,
    underflow: float = 1e-3,
    verify: bool = True,
    report: bool | Report = True,
) -> Float16Audit:
    """Where ``model`` overflows in float16, forward and backward, operator by operator; the
    fewest modules to keep in float32 so that it does not; and the loss scales that then fit.

    The batches run as a float16 run would run them: ``mode="autocast"`` under
    ``torch.autocast(dtype=torch.float16)`` over the model's float32 parameters, ``"half"`` on
    a float16 copy of the model (``model.half()``, as DeepSpeed's fp16 path). Every torch
    operator is seen with its result (a ``TorchFunctionMode``), so an overflow inside a
    module's ``forward`` (``q @ k.transpose(-1, -2)``) is found and placed in that module;
    every autograd node of the backward is seen through a hook, so is a gradient that
    overflows, at loss scale 1 (intrinsic: no scale avoids it) or only above some scale (it
    bounds the scale). How, in order::

        reference: each batch in float32 (TF32 off): its gradients and its report rows
        half mode: each parameter finite in float32 and not in float16 (above 65504) is an
            intrinsic finding no module fixes (op "parameter", its module; read with the
            first forward)
        plan = []
        repeat:                          # fixing one place can move the overflow
            run each batch in float16 with plan kept in float32:
                forward: the largest magnitude of every float16 result kept on the device,
                    read once after it; a result with inf/NaN whose watched operands are
                    finite is looked at in a rerun: from finite operands (not an attention
                    mask's arithmetic) it is a finding; in autocast mode it is recomputed
                    in float32 and the rerun goes on, until a read shows nothing new
                backward at loss scale 1: a node giving a non-finite float16 gradient from
                    finite ones is a finding (its size measured at 2**-8, -16 or -24);
                    no backward when the forward already changed the plan
            plan += the module that fixes each new finding: the forward's module; the
                backward's, or, where the node casts a float32 gradient down to float16,
                the module that made that float16 tensor
            a finding still met with its module kept: unfixable; in half mode, first its
                enclosing modules are tried in its place, smallest first, up to the
                repeated block (an element of the outermost ModuleList: a decoder or
                encoder layer), never a module holding that list nor the root
        until no finding is left (or only unfixable ones)
        prune: drop each module whose absence brings no finding back (1-minimal)
        scales: high = the largest 2**k at which no float16 gradient overflows (exact:
            a power-of-two scale multiplies every float16 gradient exactly); low = the
            smallest 2**k whose measured underflow is within ``underflow`` (measured from
            where the float32 gradients' exponent histograms say the final cast's ends,
            down while it holds and up until it does); entries below 2**-24 of the
            batch's global gradient norm (float32's rounding level) never count
            (``lossscale.torch._audit.scales.NOISE``)
        verify: each batch in float16 with the plan applied (apply) at initial_scale

    Args:
      model: the ``torch.nn.Module``, with floating parameters. Under gradient checkpointing
        (transformers' ``gradient_checkpointing_enable()``, ``torch.utils.checkpoint``) the
        audit turns it off for its runs and back on after
        (:attr:`Float16Audit.checkpointing`). In ``DistributedDataParallel`` or sharded by
        FSDP2's ``fully_shard`` (each rank then audits a whole replica: the parameters
        all-gathered), call it on every rank of its group, each with its own batches: the
        ranks agree after each pass and every rank returns the same result (the union of the
        findings, the intersection of the ranges; ``ranks``, ``batches`` over all).
      loss_fn: ``loss_fn(model, batch)`` returns the scalar floating loss of one batch (it
        moves the batch to the device; it must draw the same random numbers given the same
        RNG state, as dropout does).
      batches: a non-empty iterable of batches (read once, run several times).
      mode: ``"autocast"`` or ``"half"``.
      device: where to run (None: the device of the model's first floating parameter); a
        model elsewhere is copied there.
      underflow: the largest fraction of a parameter gradient's entries that may underflow
        to zero in ``scale_range``, over the entries whose float32 magnitude is at least
        2**-24 of the batch's global gradient norm (L2 over every parameter): the others are
        float32 rounding noise (the key bias of softmax attention, whose exact gradient is
        zero, lands there) and never count.
      verify: run the batches again with the plan applied at ``initial_scale``.
      report: True: fill :attr:`Float16Audit.report` with a new float16 ``Report``; a
        :class:`lossscale.numerics.Report`: add the rows to it (its formats, its log file);
        False: none (the rows, every leaf module's output and every parameter's gradient in
        the float32 run, cost about a float16 step).

    Returns:
      A :class:`~lossscale.torch.Float16Audit`.

    Example:
      >>> import torch
      >>> from lossscale.torch import audit
      >>> _ = torch.manual_seed(0)
      >>> model = torch.nn.Sequential(
      ...     torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 1)
      ... )
      >>> with torch.no_grad():  # the first layer's outputs reach 1.2e5, past float16's 65504
      ...     _ = model[0].weight.fill_(300.0)
      >>> def loss_fn(model, x):
      ...     return model(x).float().pow(2).mean()
      >>> result = audit(model, loss_fn, [torch.full((8, 4), 100.0)])
      >>> first = result.first_overflow
      >>> first.module, first.phase, first.op, first.kind, f"{first.amax:.3g}"
      ('0', 'forward', 'linear', 'intrinsic', '1.2e+05')
      >>> result.float32_modules, result.verified
      (('0',), True)

    Raises:
      TypeError: ``model`` holds FSDP1 modules or FSDP2 on a 2-D mesh, ``model`` is not a
        module, ``loss_fn`` is not callable or returns something
        other than a floating tensor, ``batches`` is not iterable, or an argument has the
        wrong type.
      ValueError: ``batches`` is empty, the model has no floating parameter, ``mode`` is
        unknown, ``underflow`` is not in [0, 1), ``loss_fn`` returns a non-scalar, or a loss
        that is not finite in float32.

    What ``loss_fn`` raises comes through unchanged. The model is left as it was, on an error
    too: parameters, ``.grad`` (gradients are taken with
    ``torch.autograd.grad``), buffers, hooks, ``training`` flags, ``requires_grad``, devices
    and the RNG state. Costs: in autocast mode the audit runs the user's model itself (no
    copy); ``"half"`` and another ``device`` copy it. Per batch and pass: one forward (a
    maximum per float16 operator result, kept on the device), then, before anything is read,
    the backward at loss scale 1 (one reduction launch per group of gradients) and the
    underflow count there, all read in one transfer after it (with the float32 losses on the
    first); a rerun per overflow met in a chain (each repaired one can uncover the next; the
    backward then runs again, with a read); in ``"half"`` mode a pass per enclosing module
    tried; while probing the bottom, one or two backwards
    more through the same graph (a read each). Before the passes, one float32 forward and
    backward per batch (no read: the device runs it while the host watches the first float16
    forward; the report's rows, counted there, come back with that read too); after them
    the verification (every batch queued, then one read). A clean model's audit reads the
    device once per batch and once more to verify, whatever its size, with the report or
    without.
    While it runs, the objects alive before it are frozen for Python's garbage collector
    (``gc.freeze``, undone at its end; not when the collector is off or objects are frozen
    already).
    """
    device_of_model = _check_model(model)
    model_, group = rank_subject(model)  # DDP: its module; FSDP2: a replica; and their ranks
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    mode = choice("mode", mode, MODES)
    threshold = fraction("underflow", underflow)
    boolean("verify", verify)
    if not isinstance(report, bool | Report):
        raise TypeError(f"report must be a bool or a lossscale.numerics.Report, got {report!r}")
    try:
        run_device = device_of_model if device is None else torch.device(device)
    except (TypeError, RuntimeError) as bad:
        raise ValueError(f"device must name a torch device, got {device!r}") from bad
    try:
        listed = list(batches)
    except TypeError:
        raise TypeError(
            f"batches must be an iterable of batches, got {type(batches).__name__}"
        ) from None
    if not listed:
        raise ValueError("batches must hold at least one batch, got none")
    n_modules = len(list(model_.named_modules()))
    with (
        untouched_state(model, run_device),
        checkpointing_off(model_) as checkpointing,
        old_objects_frozen(),
    ):
        f16, f32 = _subjects(model_, mode, run_device)
        auditor = Auditor(
            f16, f32, loss_fn, listed, mode, run_device, threshold, rng_reset(run_device)
        )
        if group is not None:
            across_ranks(auditor, group)
        if report is not False:
            auditor.report = report if isinstance(report, Report) else Report()
        auditor.run_reference()
        if mode == "half":
            auditor.check_parameters()  # read with the first forward (no read here)
        plan, found, final = auditor.search()
        auditor.take_reference()  # read with the first forward already (no read here)
        findings = list(found)
        scale_range_, reason, bounds = scale_range(findings, final.scales, final.places, threshold)
        findings.extend(bounds)
        initial = initial_scale(scale_range_)
        verified = None
        if verify:

            def check() -> bool:
                return _verify(auditor, plan, initial if initial is not None else 1.0)

            verified = check() if group is None else all(agreed(group, check, bool)[1])
        counts = [len(listed)] if group is None else agreed(group, lambda: len(listed), int)[1]
    result = Float16Audit(
        mode=mode,
        batches=sum(counts),
        findings=tuple(findings),
        float32_modules=plan,
        modules=n_modules,
        scale_range=scale_range_,
        initial_scale=initial,
        underflow=threshold,
        reason=reason,
        verified=verified,
        report=auditor.report,
        checkpointing=tuple(checkpointing),
        ranks=len(counts),
    )
    return result


def _verify(auditor: Auditor, plan: tuple[str, ...], scale: float) -> bool:
    """Each batch in float16 with ``plan`` put on by the public path, at ``scale``: a finite
    loss and finite gradients. Every batch is queued, then one host read for all."""
    model = auditor.f16
    _, params = auditor.params(model)
    finite = []
    with keep_float32(model, plan, auditor.mode):
        for batch in auditor.batches:
            loss = auditor.loss(model, batch, autocast=auditor.mode == "autocast")
            grads = torch.autograd.grad(loss.float() * scale, params, allow_unused=True)
            checks = [torch.isfinite(loss).all()]
            checks += [torch.isfinite(g).all() for g in grads if g is not None]
            finite.append(torch.stack([c.to(checks[0].device) for c in checks]).all())
    return all(value == 1.0 for value in read_all(finite))
