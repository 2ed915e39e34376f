"""lossscale.torch.LossScaleOptimizer vs torch.amp.GradScaler vs the bare optimizer step.

Run: ``python -m benchmarks.torch_bench [--quick] [--rounds N] [--devices cpu,cuda] [--json F]``

Per device (CPU; CUDA too when available), parameter set (24 tensors / 25M elements, 300
transformer-like / 25M, 2000 / 2M) and optimizer (SGD with momentum and AdamW; for-loop,
foreach and fused), in one interleaved run, medians of the rounds:

  bare        the inner optimizer's step alone
  gs          torch.amp.GradScaler: scale, step, update (step unscales; a fused optimizer
              gets the scale as grad_scale and the gradients are only checked)
  ls          LossScaleOptimizer: get_scaled_loss, step (unscale + check inside)
  gs_skip / ls_skip   the same with one inf gradient (the step is skipped)
  floor       the memory-bandwidth floor: one in-place multiply over all gradient bytes (the
              gradients are views into one flat buffer; the floor multiplies that buffer)
  foreach_mul the same multiply per tensor (``torch._foreach_mul_``); on CPU this pays a
              per-tensor dispatch that lossscale's fused kernel does not, so it is no floor
  ls_unscale  lossscale's fused unscale + non-finite check alone
  dropin / dropin_skip   lossscale.torch.GradScaler, the drop-in: the same calls as gs

The gradients and the scales are reset before every timed call (untimed). Ratios: overhead =
(ls - bare) / (gs - bare) (below 1: lossscale costs less than GradScaler), unscale_over_floor
= ls_unscale / floor, skip = ls_skip / gs_skip, dropin = (dropin - bare) / (gs - bare): the
drop-in's per-step overhead against torch's GradScaler on the same models. Each ``x - bare``
is the median of the differences within a round (``over_bare_ms``), not of two medians.

Device ops and host syncs per step (every device): one call of gs, ls and dropin under a
``TorchDispatchMode``, minus the bare step's ops: every dispatched aten op is a kernel launch
on a GPU, every ``aten._local_scalar_dense`` a host sync (profiler range markers left out). On
CUDA the syncs are also counted with ``torch.cuda.set_sync_debug_mode("warn")`` (one warning
per synchronising call).

Host time per step (CPU, not with ``--only``), two models of 10-element tensors whose device
work is negligible: 4 tensors stepped by SGD's for-loop, and 2000 stepped by SGD with
``foreach`` (the many-tensor set's per-parameter work; 200 with ``--quick``). Variants bare,
gs, ls, dropin and dropin_no_alarm, each the median of per-round differences with bare and
its ratio to gs's: what a small, launch-bound GPU step waits for. Speed is never asserted.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lossscale.torch import GradScaler, LossScaleOptimizer

if not __package__:  # run as a file (python benchmarks/NAME.py): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _cli, _report, _shapes
from benchmarks._timing import Timing, interleaved

SCALE = _shapes.SCALE
#: The variants whose host syncs are counted on CUDA; ``*_dev``: the drop-in and the
#: LossScaleOptimizer with ``device_side_skip=True`` (0 syncs for a fused optimizer, else 1).
SYNC_COUNTED = (
    "bare",
    "gs",
    "ls",
    "dropin",
    "gs_skip",
    "ls_skip",
    "dropin_skip",
    "ls_dev",
    "dropin_dev",
    "ls_dev_skip",
    "dropin_dev_skip",
)
#: The variants whose device ops and host syncs are counted (on every device).
OP_COUNTED = ("gs", "ls", "dropin")
#: Host-only profiler range markers (``torch.optim`` step wrappers): no device work.
MARKERS = ("_record_function_enter_new", "_record_function_exit")

MakeOpt = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
Variants = dict[str, tuple[Callable[[], object] | None, Callable[[], object]]]


def optimizers() -> dict[str, MakeOpt]:
    """SGD with momentum and AdamW, each as for-loop, foreach and fused implementation."""
    out: dict[str, MakeOpt] = {}
    for impl, kw in (
        ("forloop", {"foreach": False}),
        ("foreach", {"foreach": True}),
        ("fused", {"fused": True}),
    ):
        out[f"SGDm-{impl}"] = lambda ps, kw=kw: torch.optim.SGD(ps, lr=1e-6, momentum=0.9, **kw)
        out[f"AdamW-{impl}"] = lambda ps, kw=kw: torch.optim.AdamW(ps, lr=1e-6, **kw)
    return out


@dataclass
class Fixture:
    """One parameter set with gradients and one optimizer over it (``opt``, stepped bare,
    through ``scaler`` and ``dropin``, and wrapped by ``lso``)."""

    flat: torch.Tensor
    saved: torch.Tensor
    grads: list[torch.Tensor]
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    lso: LossScaleOptimizer
    loss: torch.Tensor
    dropin: GradScaler


def _sizes(pset: _shapes.ParamSet) -> list[int]:
    return [math.prod(s) for s in pset.shapes]


def make_fixture(pset: _shapes.ParamSet, make_opt: MakeOpt, device: str) -> Fixture:
    """Parameters and gradients on ``device``, and one optimizer over them that every variant
    steps (bare, through GradScaler, wrapped by the LossScaleOptimizer, through the drop-in):
    the inner step then works on the same state buffers in every variant (AdamW's moments are
    200 MB on 25M elements), and a difference between variants is the loss scaling's."""
    torch.manual_seed(0)
    params = [torch.randn(s, device=device).requires_grad_() for s in pset.shapes]
    flat = torch.randn(pset.n_elements, device=device) * 1e-3
    grads = [v.view(s) for v, s in zip(flat.split(_sizes(pset)), pset.shapes, strict=True)]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    scaler = torch.amp.GradScaler(device, init_scale=SCALE, growth_interval=10**9)
    loss = torch.ones((), device=device, requires_grad=True)
    scaler.scale(loss)  # creates the scaler's lazy state, so setup can reset it
    opt = make_opt(params)
    return Fixture(
        flat=flat,
        saved=flat.clone(),
        grads=grads,
        opt=opt,
        scaler=scaler,
        lso=LossScaleOptimizer(opt, dynamic_growth_steps=10**9),
        loss=loss,
        dropin=GradScaler(device, init_scale=SCALE, growth_interval=10**9, stall_steps=None),
    )


def scaler_iteration(
    scaler: torch.amp.GradScaler | GradScaler, opt: torch.optim.Optimizer, loss: torch.Tensor
) -> Callable[[], None]:
    """One iteration through a GradScaler (torch's or the drop-in): scale, step, update."""

    def run() -> None:
        scaler.scale(loss)
        scaler.step(opt)
        scaler.update()

    return run


def lso_iteration(lso: LossScaleOptimizer, loss: torch.Tensor) -> Callable[[], None]:
    """One iteration through the LossScaleOptimizer: get_scaled_loss, step."""

    def run() -> None:
        lso.get_scaled_loss(loss)
        lso.step()

    return run


def step_variants(fx: Fixture) -> Variants:
    """The timed calls, each with its untimed reset of the gradients (and of the scale)."""

    def reset() -> None:
        fx.flat.copy_(fx.saved)

    def reset_inf() -> None:
        reset()
        fx.grads[len(fx.grads) // 2].view(-1)[0] = math.inf

    def reset_gs(inf: bool = False) -> Callable[[], None]:
        def setup() -> None:
            (reset_inf if inf else reset)()
            fx.scaler.update(new_scale=SCALE)  # a skip halved it

        return setup

    def reset_ls(inf: bool = False) -> Callable[[], None]:
        def setup() -> None:
            (reset_inf if inf else reset)()
            fx.lso._ls.load(SCALE, 0, 0)  # a skip halved it

        return setup

    def reset_dropin(inf: bool = False) -> Callable[[], None]:
        def setup() -> None:
            (reset_inf if inf else reset)()
            fx.dropin.update(new_scale=SCALE)  # a skip halved it

        return setup

    gs_step = scaler_iteration(fx.scaler, fx.opt, fx.loss)
    ls_step = lso_iteration(fx.lso, fx.loss)
    dropin_step = scaler_iteration(fx.dropin, fx.opt, fx.loss)
    return {
        "bare": (reset, fx.opt.step),
        "gs": (reset_gs(), gs_step),
        "ls": (reset_ls(), ls_step),
        "gs_skip": (reset_gs(inf=True), gs_step),
        "ls_skip": (reset_ls(inf=True), ls_step),
        "floor": (reset, lambda: fx.flat.mul_(1 / SCALE)),
        "foreach_mul": (reset, lambda: torch._foreach_mul_(fx.grads, 1 / SCALE)),
        "ls_unscale": (reset_ls(), lambda: fx.lso._step.check(unscale=True)),
        "dropin": (reset_dropin(), dropin_step),
        "dropin_skip": (reset_dropin(inf=True), dropin_step),
    }


def device_side_variants(fx: Fixture, make_opt: MakeOpt, device: str) -> Variants:
    """The drop-in (over ``fx.opt``) and a LossScaleOptimizer (over a second optimizer of the
    same parameters: one optimizer is wrapped once) with ``device_side_skip=True``; counted,
    not timed."""
    lso = LossScaleOptimizer(
        make_opt([p for g in fx.opt.param_groups for p in g["params"]]),
        dynamic_growth_steps=10**9,
        device_side_skip=True,
    )
    dropin = GradScaler(
        device, init_scale=SCALE, growth_interval=10**9, stall_steps=None, device_side_skip=True
    )

    def reset(inf: bool, scale: Callable[[], None]) -> Callable[[], None]:
        def setup() -> None:
            fx.flat.copy_(fx.saved)
            if inf:
                fx.grads[len(fx.grads) // 2].view(-1)[0] = math.inf
            scale()

        return setup

    def lso_scale() -> None:
        lso._ls.load(SCALE, 0, 0)

    def dropin_scale() -> None:
        dropin.update(new_scale=SCALE)

    ls_step, dropin_step = lso_iteration(lso, fx.loss), scaler_iteration(dropin, fx.opt, fx.loss)
    return {
        "ls_dev": (reset(False, lso_scale), ls_step),
        "dropin_dev": (reset(False, dropin_scale), dropin_step),
        "ls_dev_skip": (reset(True, lso_scale), ls_step),
        "dropin_dev_skip": (reset(True, dropin_scale), dropin_step),
    }


def count_syncs(setup: Callable[[], object] | None, run: Callable[[], object]) -> int:
    """Host syncs of one call of ``run`` on CUDA: the warnings of the sync debug mode."""
    if setup is not None:
        setup()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_ops(setup: Callable[[], object] | None, run: Callable[[], object]) -> dict[str, int]:
    """Aten ops of one call of ``run`` in steady state (after its setup and one uncounted
    call, which fills per-scale caches), profiler markers left out."""
    if setup is not None:
        setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run()
        with _OpCount() as mode:
            run()
    return {k: n for k, n in mode.ops.items() if k not in MARKERS}


def op_counts(variants: Variants) -> dict[str, dict[str, int]]:
    """``{variant: {"ops": n, "syncs": n}}`` for :data:`OP_COUNTED`, beyond the bare step."""
    bare = count_ops(*variants["bare"])
    bare_syncs = bare.get("_local_scalar_dense", 0)  # for-loop Adam reads each step count
    out = {}
    for name in OP_COUNTED:
        ops = count_ops(*variants[name])
        out[name] = {
            "ops": sum(ops.values()) - sum(bare.values()),
            "syncs": ops.get("_local_scalar_dense", 0) - bare_syncs,
        }
    return out


#: The variants whose time over the bare step (an overhead) is taken round by round.
OVER_BARE = ("gs", "ls", "dropin")


def ratios(timing: Timing) -> dict[str, float | None]:
    """The overhead ratios (None when GradScaler costs nothing measurable), unscale/floor,
    skip. An overhead is the median of the per-round differences with the bare step
    (:meth:`Timing.paired_median`), not the difference of two medians: on the AdamW rows a
    few-ms overhead sits on a 60-120 ms step, whose drift between rounds would swamp it."""
    over = {name: timing.paired_median(name, "bare") for name in OVER_BARE}
    m = {name: timing.median(name) for name in ("ls_unscale", "floor", "ls_skip", "gs_skip")}
    gs_over = over["gs"]
    return {
        "overhead": over["ls"] / gs_over if gs_over > 0 else None,
        "unscale_over_floor": m["ls_unscale"] / m["floor"],
        "skip": m["ls_skip"] / m["gs_skip"],
        "dropin": over["dropin"] / gs_over if gs_over > 0 else None,
    }


def bench_row(
    pset: _shapes.ParamSet, opt_name: str, make_opt: MakeOpt, device: str, rounds: int, warmup: int
) -> dict[str, Any]:
    """One interleaved run of every variant on one device, parameter set and optimizer."""
    fx = make_fixture(pset, make_opt, device)
    variants = step_variants(fx)
    sync = torch.cuda.synchronize if device == "cuda" else None
    timing = interleaved(variants, rounds=rounds, sync=sync, warmup=warmup)
    stats = timing.summary()
    syncs = None
    if device == "cuda":
        counted = {**variants, **device_side_variants(fx, make_opt, device)}
        for name in SYNC_COUNTED:  # one uncounted call first: lazy state, per-scale caches
            count_syncs(*counted[name])
        syncs = {name: count_syncs(*counted[name]) for name in SYNC_COUNTED}
    counts = op_counts(variants)
    return {
        "device": device,
        "set": pset.name,
        "n_tensors": pset.n_tensors,
        "n_elements": pset.n_elements,
        "optimizer": opt_name,
        **stats,
        "over_bare_ms": {n: timing.paired_median(n, "bare") * 1e3 for n in OVER_BARE},
        "ratios": ratios(timing),
        "syncs_per_step": syncs,
        "ops_per_step": counts,
    }


#: The tiny model of :func:`host_time`: tensors x elements, SGD's default (for-loop) step.
HOST_MODEL = (4, 10)
#: The many-tensor model of :func:`host_time`: 2000 tensors of 10 elements, SGD stepped with
#: foreach (what a GPU uses): the per-parameter host work of the issue's 2000-tensor set
#: without its kernels' per-element time.
HOST_MODEL_MANY = (2000, 10)


def host_time(
    rounds: int, steps: int, model: tuple[int, int] = HOST_MODEL, foreach: bool = False
) -> dict[str, Any]:
    """Host time per step, on the CPU, of a model whose tensors are so small (10 elements)
    that a step's device work is negligible: what a small, launch-bound GPU step waits for.
    ``model`` is (tensors, elements): the tiny model (4 tensors, SGD for-loop) or the
    many-tensor one (2000 tensors, SGD with ``foreach``).

    Variants (each a block of ``steps`` consecutive steps, the blocks interleaved): bare
    (the optimizer step), gs (torch.amp.GradScaler: scale, step, update), ls
    (LossScaleOptimizer: get_scaled_loss, step), dropin (lossscale.torch.GradScaler, stall
    alarm on, its default) and dropin_no_alarm (``stall_steps=None``). Every scale is 1.0
    with growth never due, so the gradients keep their values from step to step.
    Returns microseconds per step (medians), each front end's time over the bare step
    (medians of the per-round differences) and its ratio to GradScaler's."""
    n_tensors, size = model
    torch.manual_seed(0)
    params = [torch.randn(size, requires_grad=True) for _ in range(n_tensors)]
    for p in params:
        p.grad = torch.randn(size)
    loss = torch.ones((), requires_grad=True)
    kw: dict[str, Any] = {"init_scale": 1.0, "growth_interval": 10**9}
    # one optimizer, as in make_fixture; foreach=None is the for-loop on the CPU
    opt = torch.optim.SGD(params, lr=1e-6, foreach=foreach or None)
    lso = LossScaleOptimizer(opt, initial_scale=1.0, dynamic_growth_steps=10**9)
    quiet = GradScaler("cpu", **kw, stall_steps=None)
    ones = {
        "bare": opt.step,
        "gs": scaler_iteration(torch.amp.GradScaler("cpu", **kw), opt, loss),
        "ls": lso_iteration(lso, loss),
        "dropin": scaler_iteration(GradScaler("cpu", **kw), opt, loss),
        "dropin_no_alarm": scaler_iteration(quiet, opt, loss),
    }

    def block(one: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(steps):
                one()

        return run

    timing = interleaved({k: (None, block(f)) for k, f in ones.items()}, rounds=rounds)
    over = {k: timing.paired_median(k, "bare") / steps * 1e6 for k in ones if k != "bare"}
    return {
        "model": {"tensors": n_tensors, "elements": size, "foreach": foreach},
        "rounds": rounds,
        "steps": steps,
        "us_per_step": {k: timing.median(k) / steps * 1e6 for k in ones},
        "over_bare_us": over,
        "ratio_to_gs": {k: v / over["gs"] if over["gs"] > 0 else None for k, v in over.items()},
        "noisy": timing.noisy(),
    }


def run(
    quick: bool = False,
    rounds: int | None = None,
    devices: list[str] | None = None,
    only: str | None = None,
) -> dict[str, Any]:
    """The PyTorch section of the report (``only``: a substring of 'device/set/optimizer')."""
    rounds = rounds or (2 if quick else 31)
    warmup = 1 if quick else 2
    devices = devices or ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    rows = []
    for device in devices:
        for pset in _shapes.param_sets(quick):
            for opt_name, make_opt in optimizers().items():
                if only and only not in f"{device}/{pset.name}/{opt_name}":
                    continue
                row = bench_row(pset, opt_name, make_opt, device, rounds, warmup)
                overhead = _report.ratio(row["ratios"]["overhead"], row["noisy"])
                dropin = _report.ratio(row["ratios"]["dropin"], row["noisy"])
                _cli.progress(
                    f"torch {device}/{pset.name}/{opt_name}: overhead ratio {overhead}, "
                    f"drop-in {dropin}"
                )
                rows.append(row)
    host = host_many = None
    if not only:
        host = host_time(rounds=3 if quick else 31, steps=20 if quick else 500)
        _cli.progress(f"torch host time: drop-in / GradScaler {host['ratio_to_gs']['dropin']}")
        many = HOST_MODEL_MANY if not quick else (200, HOST_MODEL_MANY[1])
        host_many = host_time(
            rounds=3 if quick else 31, steps=2 if quick else 20, model=many, foreach=True
        )
        _cli.progress(
            f"torch host time, {many[0]} tensors: drop-in / GradScaler "
            f"{host_many['ratio_to_gs']['dropin']}"
        )
    return {
        "framework": "torch",
        "host": host,
        "host_many": host_many,
        "config": {
            "quick": quick,
            "rounds": rounds,
            "warmup": warmup,
            "devices": devices,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if "cuda" in devices else None,
        },
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = _cli.parser(__doc__)
    ap.add_argument("--devices", default=None, help="comma-separated (default: cpu[,cuda])")
    ap.add_argument("--only", default=None, help="substring filter on 'device/set/optimizer'")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.devices.split(",") if args.devices else None
    if devices and "cuda" in devices and not torch.cuda.is_available():
        _cli.progress(
            "torch: no CUDA device here (torch.cuda.is_available() is False): cuda left out"
        )
        devices = [d for d in devices if d != "cuda"]
        if not devices:
            return 0
    section = run(args.quick, args.rounds, devices, args.only)
    return _cli.finish(section, args.json, _report.render_torch)


if __name__ == "__main__":
    raise SystemExit(main())
