"""What the float16 audit leaves as it found it: the model's buffers and ``training`` flags,
the RNG (and the same RNG state for every run of a batch), CUDA's TF32 settings, and Python's
garbage collector."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["full_float32", "old_objects_frozen", "rng_reset", "rng_restorer", "untouched_state"]


@contextmanager
def old_objects_frozen() -> Iterator[None]:
    """Python's cyclic garbage collector spared the objects alive before (``gc.freeze``)
    until exit (``gc.unfreeze``): the audit's passes make many small objects (results,
    hooks, closures), and each full collection would otherwise walk every object of torch
    and the user's program too (40% of an audit's host time, measured on a small Llama).
    Left alone when the collector is off or something else froze objects."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def full_float32(device: torch.device) -> Iterator[None]:
    """float32 matrix products in full float32 on CUDA (TF32 off), put back on exit: the
    noise level of the underflow count is float32's rounding, not TF32's."""
    if device.type != "cuda":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    matmul.allow_tf32, cudnn.allow_tf32 = False, False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def rng_restorer(device: torch.device) -> Callable[[], None]:
    """A function that sets the CPU's (and ``device``'s CUDA) RNG back to its state of now."""
    cpu_rng = torch.get_rng_state()
    cuda = device.type == "cuda" and torch.cuda.is_available()
    cuda_rng = torch.cuda.get_rng_state_all() if cuda else None

    def restore() -> None:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    return restore


@contextmanager
def untouched_state(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Puts ``model``'s buffers and ``training`` flags and the RNG state back on exit."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    training = [(m, m.training) for m in model.modules()]
    restore_rng = rng_restorer(device)
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, flag in training:
            m.training = flag
        restore_rng()


def rng_reset(device: torch.device) -> Callable[[], Any]:
    """A context manager factory: each use starts from the RNG state of now, so that every
    run of a batch draws the same dropout masks (the audit restores the state at its end)."""
    restore_rng = rng_restorer(device)

    @contextmanager
    def same() -> Iterator[None]:
        restore_rng()
        yield

    return same
