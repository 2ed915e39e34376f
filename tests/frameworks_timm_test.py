"""``lossscale.torch.GradScaler`` inside timm's ``NativeScaler``, side by side with
``torch.amp.GradScaler``.

timm's training script drives ``timm.utils.NativeScaler``, which wraps a ``torch.amp.GradScaler``
in ``self._scaler`` and calls ``scale(loss).backward()``, ``unscale_`` (when clipping), ``step``,
``update``, ``state_dict`` and ``load_state_dict`` on it. The plug-in: replace ``_scaler``.

How timm is installed here (clarification F5): ``pip install --no-deps timm`` (scripts/dev.sh),
because PyPI's torchvision does not load beside the CPU torch wheel and ``import timm`` imports
torchvision. So the test does not ``import timm``: it registers empty ``timm`` and
``timm.utils`` packages pointing at the installed directories and imports only
``timm.utils.cuda`` (the module that defines ``NativeScaler``) and what it imports
(``clip_grad``, ``agc``), none of which needs torchvision.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lossscale._testing import timm_native_scaler_class  # noqa: E402
from lossscale.torch import GradScaler  # noqa: E402

STEPS = 10
OVERFLOW_AT = {1, 2, 6}


def _run(make_scaler: Any, steps: range, state: Any = None) -> tuple[list[float], list[Any], Any]:
    native = timm_native_scaler_class()("cpu")
    native._scaler = make_scaler()  # the plug-in point
    if state is not None:
        native.load_state_dict(state["scaler"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    scales = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if step in OVERFLOW_AT:
            loss = loss * math.inf
        # timm's train_one_epoch: loss_scaler(loss, optimizer, clip_grad=..., parameters=...)
        native(loss, opt, clip_grad=1.0, clip_mode="norm", parameters=model.parameters())
        opt.zero_grad()
        scales.append(native._scaler.get_scale())
    checkpoint = {
        native.state_dict_key: native.state_dict(),
        "scaler": native.state_dict(),
        "model": model.state_dict(),
        "opt": opt.state_dict(),
    }
    return scales, [p.detach().clone() for p in model.parameters()], checkpoint


def test_native_scaler_matches_torch_grad_scaler() -> None:
    ours = _run(lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=2), range(STEPS))
    theirs = _run(
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2), range(STEPS)
    )
    assert ours[0] == theirs[0] and len(set(ours[0])) > 2
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(a, b)
    # timm checkpoints the scaler under its state_dict_key ("amp_scaler"): torch's reads ours
    into_torch = torch.amp.GradScaler("cpu")
    into_torch.load_state_dict(ours[2]["amp_scaler"])
    assert into_torch.state_dict() == theirs[2]["amp_scaler"]


def test_resume_from_a_timm_checkpoint() -> None:
    def make() -> GradScaler:
        return GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    first = _run(make, range(5))
    resumed = _run(make, range(5, STEPS), state=first[2])
    uninterrupted = _run(make, range(STEPS))
    assert resumed[0] == uninterrupted[0][5:]
    for a, b in zip(resumed[1], uninterrupted[1], strict=True):
        assert torch.equal(a, b)
