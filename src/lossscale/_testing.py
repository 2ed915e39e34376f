"""Private helpers of the test suite, shared by test modules that would otherwise import one
another: multi-process ``torch.distributed`` jobs on one machine (and what their tests compare:
tensor lists, the expected scale trajectory), bit-level tree comparison and forced host devices
for JAX, a minimal :class:`~lossscale.LossScale` subclass, timm's ``NativeScaler`` loaded
without torchvision, and a Lightning module's overflowing training step.

:func:`run_gloo_job` starts ``world`` processes (torch.multiprocessing, ``spawn``), each with a
gloo process group on loopback (127.0.0.1) at a free port, calls ``fn(rank, world, *args)`` in
every rank and returns the ranks' results, in rank order. A job that does not finish within
``timeout`` seconds is killed and raises :class:`TimeoutError`; an exception in a rank is
raised in the caller with that rank's traceback.

torch, jax, timm, lightning and pytest are imported inside the functions only: importing this
module never imports them. Not part of the public API.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import socket
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lossscale.stateful import LossScale

if TYPE_CHECKING:
    import pytest

#: The gloo timeout of a collective inside a job (a rank that never joins one fails it).
COLLECTIVE_TIMEOUT_S = 60.0

#: The environment of a process that runs as on a CPU without float16 instructions
#: (AVX512-FP16, AMX): oneDNN limited to AVX2, so ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``
#: is False there, as on such a CPU, and DeepSpeed's CPU accelerator refuses ``fp16``. Set
#: before the process starts (oneDNN reads it once). TensorFlow's own oneDNN kernels are
#: turned off: on a CPU with AMX, TensorFlow aborts when its oneDNN is limited this way.
NO_FLOAT16_CPU_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "TF_ENABLE_ONEDNN_OPTS": "0"}


def one_torch_thread() -> Iterator[None]:
    """A fixture's body (``pytest.fixture(autouse=True, scope="module")(one_torch_thread)``):
    one torch thread for a module of tests on tiny models, restored after. Two threads that
    wait on each other while other work shares the CPU made such steps 5-50x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def torch_devices() -> list[Any]:
    """The devices a device-parametrized torch test runs on: the CPU always, CUDA where a CUDA
    device is present (skipped with a reason elsewhere, and counted as skipped)."""
    import pytest
    import torch

    return [
        pytest.param("cpu", id="cpu"),
        pytest.param(
            "cuda",
            id="cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int, fn: Callable[..., Any], world: int, port: int, out_dir: str, args: tuple[Any, ...]
) -> None:
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # The rank's work is done and saved: leave without the interpreter's teardown, where
    # torch 2.13's gloo now and then aborts a process that used FSDP2 ("terminate called
    # without an active exception", seen in long test runs only).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: What torch 2.13's gloo prints when it aborts a process at interpreter teardown, now and then,
#: after all its work is done (a std::thread still joinable at exit; seen in long test runs).
TEARDOWN_ABORT = "terminate called without an active exception"


def run_torchrun(
    script: Path, args: list[str], expect: list[str], timeout: float, *, ranks: int = 2
) -> Any:
    """``torchrun --nproc_per_node=ranks script *args`` on 127.0.0.1 (gloo on the loopback,
    ``src`` first on the path), run once more when every line of ``expect`` was printed and a
    rank then aborted at teardown (:data:`TEARDOWN_ABORT`). Returns the last
    ``subprocess.CompletedProcess`` (stdout and stderr captured as text)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    done = None
    for _ in range(2):
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1"),
            *(f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1"),
            *(f"--master_port={free_port()}", str(script), *args),
        ]
        done = subprocess.run(
            command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
        )
        finished = all(line in done.stdout for line in expect)
        if done.returncode == 0 or not (finished and TEARDOWN_ABORT in done.stderr):
            break
    return done


def run_gloo_job(
    fn: Callable[..., Any],
    world: int,
    timeout: float,
    out_dir: str | os.PathLike[str],
    args: Sequence[Any] = (),
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes joined by a gloo group.

    ``fn`` must be importable by the child processes (a module-level function) and return
    something ``torch.save`` can write; the results come back in rank order. ``out_dir`` holds
    the results' files (and anything ``fn`` writes there).
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mp: Any = torch.multiprocessing
    ctx = mp.start_processes(
        _rank_main,
        args=(fn, world, free_port(), str(out), tuple(args)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world}-rank job did not finish in {timeout} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


_JOBS: dict[tuple[str, str, int], list[Any]] = {}


def gloo_job_once(
    fn: Callable[..., Any], world: int, timeout: float, tmp_path_factory: pytest.TempPathFactory
) -> list[Any]:
    """:func:`run_gloo_job` of ``fn`` over ``world`` ranks, once per pytest process: a later
    call with the same ``fn`` and ``world`` returns the first call's results (the job's files
    go to a fresh ``tmp_path_factory`` folder)."""
    key = (fn.__module__, fn.__qualname__, world)
    if key not in _JOBS:
        out = tmp_path_factory.mktemp(f"w{world}")
        _JOBS[key] = run_gloo_job(fn, world, timeout, out)
    return _JOBS[key]


def tensors_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Two sequences of tensors of the same length, equal element by element
    (``torch.equal``: the same shape and values)."""
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def expected_scales(
    overflows: set[int], steps: int, scale: float, growth_interval: int
) -> list[tuple[float, int]]:
    """``(scale, growth tracker)`` after each of ``steps`` updates of torch's dynamic rule with
    its default factors, written out here as an independent oracle: at a step in ``overflows``
    the scale halves and the tracker resets; after ``growth_interval`` finite steps in a row
    it doubles."""
    tracker, out = 0, []
    for step in range(steps):
        if step in overflows:
            scale, tracker = scale / 2, 0
        elif tracker + 1 == growth_interval:
            scale, tracker = scale * 2, 0
        else:
            tracker += 1
        out.append((scale, tracker))
    return out


@contextmanager
def counting_all_reduces() -> Iterator[list[tuple[str, Any]]]:
    """Count the ``torch.distributed.all_reduce`` calls made inside the ``with`` block: yields
    a list that receives ``(op name, group)`` per call (a group None is the default group)."""
    import torch.distributed

    dist: Any = torch.distributed
    calls: list[tuple[str, Any]] = []
    real = dist.all_reduce

    def counting(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, **kw: Any) -> Any:
        calls.append((str(op).rsplit(".", 1)[-1], group))
        return real(tensor, op=op, group=group, **kw)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = real


def require_fused(cls_name: str, device: str) -> None:
    """Skip the calling test, with the reason, where this torch has no fused ``cls_name`` on
    ``device`` (torch 2.11's fused Adagrad is CPU-only; 2.13, pinned for CI, has it on CUDA)."""
    import pytest
    import torch

    param = torch.zeros(1, device=device, requires_grad=True)
    param.grad = torch.zeros(1, device=device)
    try:  # some versions check the device at the first step, not at construction
        getattr(torch.optim, cls_name)([param], fused=True).step()
    except RuntimeError as error:
        pytest.skip(f"torch {torch.__version__} has no fused {cls_name} on {device}: {error}")


# -- JAX ----------------------------------------------------------------------------------------
def bits(tree: Any) -> list[tuple[str, str, bytes]]:
    """Every leaf's path, dtype and bytes: equal lists mean bit-identical trees."""
    import jax

    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [
        (jax.tree_util.keystr(path), str(np.asarray(x).dtype), np.asarray(x).tobytes())
        for path, x in leaves
    ]


def run_on_host_devices(code: str, devices: int = 8) -> list[str]:
    """Run ``code`` in a fresh Python with ``devices`` forced CPU devices (the count is fixed
    when jax starts, hence the subprocess); return its stdout split into words."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split()


# -- the stateful API ---------------------------------------------------------------------------
class Constant(LossScale):
    """A minimal subclass: the contract is three methods."""

    def __init__(self, value: float = 2.0) -> None:
        self.value = value

    def __call__(self) -> Any:
        return np.asarray(self.value, np.float32)

    def update(self, grads: Any) -> tuple[None, bool]:
        return None, True

    def get_config(self) -> dict[str, Any]:
        return {"value": self.value}


# -- frameworks ---------------------------------------------------------------------------------
def timm_native_scaler_class() -> Any:
    """timm's ``NativeScaler`` class, loaded without running ``timm/__init__`` (which imports
    torchvision, whose PyPI wheel does not load beside the CPU torch wheel); skips the calling
    test where timm is not installed."""
    import pytest

    spec = importlib.util.find_spec("timm")
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("timm is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    saved = {name: sys.modules.get(name) for name in ("timm", "timm.utils")}
    try:
        for name, path in (("timm", root), ("timm.utils", root / "utils")):
            package = types.ModuleType(name)
            package.__path__ = [str(path)]  # a namespace for the submodules, no __init__ run
            sys.modules[name] = package
        cuda = importlib.import_module("timm.utils.cuda")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return cuda.NativeScaler


class OverflowingTrainingStep:
    """A mixin for a small Lightning module, listed before ``LightningModule`` in its bases: the
    module's ``net`` (a ``Sequential``) is trained on the MSE of ``net(x)``, as float32, against
    ``y``; after backward at a global step in ``overflow_at`` the first layer's weight gradient
    turns inf (lightning is not imported here)."""

    overflow_at: frozenset[int] | set[int] = frozenset()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        import torch

        module: Any = self
        x, y = batch
        return torch.nn.functional.mse_loss(module.net(x).float(), y)

    def on_after_backward(self) -> None:
        module: Any = self
        if module.global_step in self.overflow_at:
            module.net[0].weight.grad[0, 0] = math.inf
