"""The test toolbox of :mod:`lossscale.deepspeed` (kept out of the wheel): small DeepSpeed runs on
the CPU, side by side with and without lossscale, run in spawned gloo processes by the tests.

Each run builds ``Linear(4, 8) -> ReLU -> Linear(8, 2)`` from one seed, trains it with plain SGD
(bit-exact to compare) on fixed inputs and records, per step, the scale in use, DeepSpeed's
``skipped_steps`` and ``was_step_applied()``, the LR scheduler's ``last_epoch`` and the weights.
Overflows are injected by a ``flags`` string, one letter per step: ``.`` a finite step, ``L`` an
infinite loss on every rank, ``R`` an infinite loss on rank 0 only, ``B`` an infinite gradient of
the last bias only (on ZeRO 2 it lives in the last rank's partition alone).

The ``fp16`` path runs on every CPU: DeepSpeed's CPU accelerator answers ``is_fp16_supported()``
from oneDNN's float16 support (a CPU with AVX512-FP16 or AMX), and elsewhere
``deepspeed.initialize`` refuses ``fp16`` ("Type fp16 is not supported on your device"), although
torch computes float16 on any CPU and the engine's ``fp16`` path is the same Python there.
:func:`allow_fp16_on_cpu` is the one switch that lifts the refusal; :func:`prepare_cpu` turns it
on, so no test skips for a CPU's lack of float16. The docs and the examples use the same line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any

import torch


def allow_fp16_on_cpu() -> None:
    """The switch: DeepSpeed's CPU accelerator says yes to ``is_fp16_supported()`` whatever the
    CPU (it asks oneDNN, which says yes only with AVX512-FP16 or AMX). torch's float16 math runs
    on any CPU, emulated where the CPU has no float16 instructions, so the engine's ``fp16``
    path is tested on every CPU rather than skipped. For testing only: on a CPU without those
    instructions float16 is slow. The docs' one line for CPU users is the same assignment."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True  # type: ignore[method-assign]


def prepare_cpu(allow_fp16: bool = True) -> None:
    """DeepSpeed on the CPU over the gloo group the caller made, without building its
    shared-memory communication op (a C++ build: the gloo collectives are used instead), with
    its ``fp16`` path allowed on any CPU (:func:`allow_fp16_on_cpu`; ``allow_fp16=False``
    leaves DeepSpeed's own answer, for the test that shows the refusal)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    if allow_fp16:
        allow_fp16_on_cpu()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    deepspeed.init_distributed("gloo")


def config(stage: int, path: str, **fp16: Any) -> dict[str, Any]:
    """A DeepSpeed config: ``path`` is ``"fp16"`` (with ``fp16`` keys) or ``"autocast"``."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": fp16.pop("gradient_clipping", 0.0),
        "steps_per_print": 10**9,
    }
    if "compute_grad_norm" in fp16:
        cfg["zero_optimization"]["compute_grad_norm"] = fp16.pop("compute_grad_norm")
    if path == "fp16":
        cfg["fp16"] = {"enabled": True, **fp16}
    else:
        cfg["torch_autocast"] = {"enabled": True, "dtype": "torch.float16"}
    return cfg


def model(seed: int = 0) -> torch.nn.Module:
    """The runs' model, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def build(
    cfg: dict[str, Any], groups: int = 1, seed: int = 0, optimizer: str = "sgd"
) -> tuple[Any, Any]:
    """A fresh engine and its LR scheduler (``StepLR`` with gamma 1: it counts its steps).
    ``optimizer``: ``"sgd"`` (plain SGD, lr 0.1), ``"adamw"`` (lr 0.01, no weight decay) or
    ``"fused"``: DeepSpeed's ``FusedAdam`` (lr 0.01) on CUDA, with which ZeRO 0 takes
    ``FP16_Optimizer``; on the CPU, where that kernel does not build, :class:`FusedAdamType`
    (plain SGD, lr 0.1, of ``FusedAdam``'s type: ZeRO 0 takes ``FP16_Optimizer`` as well)."""
    import deepspeed

    net = model(seed)
    params: Any = net.parameters()
    if groups == 2:
        params = [
            {"params": [p for n, p in net.named_parameters() if "bias" not in n]},
            {"params": [p for n, p in net.named_parameters() if "bias" in n]},
        ]
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=0.01, weight_decay=0.0)
    elif optimizer == "fused" and torch.cuda.is_available():
        from deepspeed.ops.adam import FusedAdam

        from lossscale.deepspeed import set_cuda_arch_list

        set_cuda_arch_list()  # DeepSpeed's builder fails on torch's 9.0a (Hopper)

        opt = FusedAdam(params, lr=0.01)
    elif optimizer == "fused":
        opt = fused_adam_type()(params, lr=0.1)
    else:
        opt = torch.optim.SGD(params, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=1.0)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, lr_scheduler=sched, config=cfg)
    return engine, sched


def fused_adam_type() -> type[Any]:
    """:class:`FusedAdamType`, made on first use (it subclasses DeepSpeed's ``FusedAdam``)."""
    from deepspeed.ops.adam import FusedAdam

    class FusedAdamType(FusedAdam):  # type: ignore[misc]
        """A stand-in of ``FusedAdam``'s type, for the CPU: DeepSpeed builds ``FP16_Optimizer``
        (its fused ZeRO-0 fp16 optimizer) around any ``FusedAdam``, whose CUDA kernel does not
        build on a CPU; this one does plain SGD in Python instead (``FusedAdam.__init__``,
        which loads the kernel, is not called)."""

        def __init__(self, params: Any, lr: float) -> None:
            torch.optim.Optimizer.__init__(self, params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    return FusedAdamType


def current_scale(engine: Any, installed: Any = None) -> float:
    """The factor the engine multiplies the loss by now."""
    if installed is not None:
        return float(
            installed.get_scale() if hasattr(installed, "get_scale") else installed.cur_scale
        )
    z0 = engine.torch_autocast_z0_gradscaler
    if z0 is not None:
        return float(z0.get_scale())
    opt = engine.optimizer
    gs = getattr(opt, "torch_autocast_gradscaler", None)
    if gs is not None:
        return float(gs.get_scale())
    return float(opt.loss_scale)


def master_weights(engine: Any) -> torch.Tensor:
    """The float32 weights the torch optimizer updates (ZeRO 0: DeepSpeed's float32 copies;
    ZeRO 1 and 2: this rank's flat partition), flattened in the model's order, padding cut."""
    size = sum(p.numel() for p in engine.module.parameters())
    inner = engine.optimizer.optimizer
    flat = torch.cat([p.detach().flatten() for g in inner.param_groups for p in g["params"]])
    return flat[:size].clone()


def optimizer_steps(engine: Any) -> list[int]:
    """The step counts in the torch optimizer's state (empty before its first step)."""
    inner = engine.optimizer.optimizer
    return sorted({int(s["step"]) for s in inner.state.values() if "step" in s})


def weights(engine: Any) -> list[torch.Tensor]:
    """The model's weights as float32 copies (ZeRO 3 gathered)."""
    import deepspeed

    params = list(engine.module.parameters())
    ctx = (
        deepspeed.zero.GatheredParameters(params)
        if engine.zero_optimization_stage() == 3
        else contextlib.nullcontext()
    )
    with ctx:
        return [p.detach().float().clone() for p in params]


def train(engine: Any, sched: Any, flags: str, installed: Any = None) -> dict[str, Any]:
    """Run one step per letter of ``flags``; record what each framework-facing reader sees."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(1)
    x = torch.randn(2, 4)
    bias = list(engine.module.parameters())[-1]
    out: dict[str, Any] = {
        "scale": [], "skipped": [], "applied": [], "last_epoch": [], "weights": [],
        "error": None, "warnings": [], "optimizer": type(engine.optimizer).__name__,
    }  # fmt: skip
    inject = {"on": False}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf") if inject["on"] else grad

    handle = bias.register_hook(poison)
    dtype = next(engine.module.parameters()).dtype
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for flag in flags:
                inject["on"] = flag == "B"
                bad = flag == "L" or (flag == "R" and rank == 0)
                loss = engine(x.to(engine.device, dtype)).float().pow(2).mean()
                if bad:
                    loss = loss * float("inf")
                engine.backward(loss)
                engine.step()
                out["scale"].append(current_scale(engine, installed))
                out["skipped"].append(int(engine.skipped_steps))
                out["applied"].append(bool(engine.was_step_applied()))
                out["last_epoch"].append(int(sched.last_epoch))
                out["weights"].append(weights(engine))
        out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    except Exception as error:  # DeepSpeed's exception at the floor, recorded for the test
        out["error"] = f"{type(error).__name__}: {error}"
    finally:
        handle.remove()
    return out


def run(
    stage: int,
    path: str,
    flags: str,
    lossscale: Any = None,
    groups: int = 1,
    optimizer: str = "sgd",
    **fp16: Any,
) -> dict[str, Any]:
    """Build an engine, install lossscale when ``lossscale`` is a dict of overrides (``None``:
    DeepSpeed's own scaler), train on ``flags``."""
    engine, sched = build(config(stage, path, **fp16), groups=groups, optimizer=optimizer)
    installed = None
    if lossscale is not None:
        from lossscale.deepspeed import install

        installed = install(engine, **lossscale)
    return train(engine, sched, flags, installed)
