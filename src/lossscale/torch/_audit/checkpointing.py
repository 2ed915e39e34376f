"""Gradient checkpointing off for the float16 audit's runs, and back on after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["CHECKPOINT_CALLS", "checkpointing_off"]

#: How :attr:`Float16Audit.checkpointing` names the calls of ``torch.utils.checkpoint``'s
#: ``checkpoint`` that ran without checkpointing.
CHECKPOINT_CALLS = "torch.utils.checkpoint.checkpoint"


@contextmanager
def checkpointing_off(model: torch.nn.Module) -> Iterator[list[str]]:
    """Run ``model`` without gradient checkpointing inside the block; yield the list of what
    was turned off (filled in as the block runs), and put everything back on exit.

    Two kinds: a module whose boolean ``gradient_checkpointing`` attribute is True
    (transformers' ``gradient_checkpointing_enable()`` sets it on the layers it checkpoints):
    set to False, listed by name; and calls of ``torch.utils.checkpoint.checkpoint`` made
    through the module (``torch.utils.checkpoint.checkpoint(fn, ...)``, and
    ``checkpoint_sequential``): they call ``fn`` directly, listed once as
    :data:`CHECKPOINT_CALLS`. The audit's backward (``torch.autograd.grad``) cannot run
    through a reentrant checkpoint, and a recomputed forward would be run unwatched.

    The replacement of ``torch.utils.checkpoint.checkpoint`` is process-wide while the block
    runs (another thread checkpointing meanwhile would not). A name bound before
    (``from torch.utils.checkpoint import checkpoint``) keeps the original.
    """
    flagged = [
        (name, m)
        for name, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", None) is True
    ]
    turned_off = [name for name, _ in flagged]
    original: Callable[..., Any] = torch.utils.checkpoint.checkpoint

    def run_through(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        for key in (
            "use_reentrant",
            "context_fn",
            "determinism_check",
            "debug",
            "preserve_rng_state",
            "early_stop",
        ):
            kwargs.pop(key, None)
        if CHECKPOINT_CALLS not in turned_off:
            turned_off.append(CHECKPOINT_CALLS)
        return function(*args, **kwargs)

    for _, m in flagged:
        m.gradient_checkpointing = False
    torch.utils.checkpoint.checkpoint = run_through
    try:
        yield turned_off
    finally:
        torch.utils.checkpoint.checkpoint = original
        for _, m in flagged:
            m.gradient_checkpointing = True
