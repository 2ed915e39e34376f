"""Accelerate's FSDP2 checkpoint load with lossscale's scaler: the scale comes back as saved.

Accelerate's ``load_state`` under FSDP2 loads ``scaler.pt``, calls the scaler's private
``_lazy_init_scale_growth_tracker``, then loads the optimizer with
``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict``, which runs a dummy
``step()`` (zero gradients, learning rate 0) through the prepared optimizer
(``AcceleratedOptimizer``) and so through ``scaler.step``/``update`` (accelerate#4289). On the
CPU Accelerate turns an FSDP plugin into DDP, so this runs that sequence itself: an FSDP2
(``fully_shard``) model on 2 gloo ranks, its Adam inside ``AcceleratedOptimizer`` with the
scaler, trained two steps, then a fresh model, optimizer and scaler loaded as ``load_state``
does. Side by side, torch's ``GradScaler`` shows both symptoms: the saved 1024 comes back as
2048 (the dummy step counted as the growth interval's last finite step), and calling
``_lazy_init_scale_growth_tracker`` on a scaler that has stepped fails ("_growth_tracker
initialized before _scale").
"""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from lossscale._testing import gloo_job_once  # noqa: E402

JOB_TIMEOUT_S = 120.0
KINDS = ("torch", "lossscale")


def _rank(rank: int, world: int) -> dict[str, Any]:
    """Both scalers' runs in one job (one spawn of 2 ranks)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    import accelerate

    accelerate.Accelerator(cpu=True)  # the state AcceleratedOptimizer reads (MULTI_CPU here)
    return {kind: _save_and_load(rank, kind) for kind in KINDS}


def _save_and_load(rank: int, kind: str) -> dict[str, Any]:
    from accelerate.optimizer import AcceleratedOptimizer
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lossscale.accelerate import AcceleratorGradScaler

    def build() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        # a CPU mesh: fully_shard's default takes the GPU where there is one
        fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
        make = torch.amp.GradScaler if kind == "torch" else AcceleratorGradScaler
        scaler = make("cpu", init_scale=1024.0, growth_interval=3)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, AcceleratedOptimizer(opt, device_placement=False, scaler=scaler), scaler

    model, opt, scaler = build()
    for step in range(2):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        scaler.scale(model(x).square().mean()).backward()
        opt.step()
        opt.zero_grad()
    saved = scaler.state_dict()
    saved_opt = get_optimizer_state_dict(model, opt.optimizer)
    # a resume: fresh objects, loaded in Accelerator.load_state's order under FSDP2
    model2, opt2, scaler2 = build()
    scaler2.load_state_dict(saved)
    scaler2._lazy_init_scale_growth_tracker(scaler2._device)
    set_optimizer_state_dict(model2, opt2, saved_opt)
    loaded_opt = get_optimizer_state_dict(model2, opt2.optimizer)
    # load_state again in the same process, into the scaler that has stepped
    try:
        scaler.load_state_dict(saved)
        scaler._lazy_init_scale_growth_tracker(scaler._device)
        again = None
    except AssertionError as error:
        again = str(error)
    keys = ("scale", "_growth_tracker")
    return {
        "saved": {k: saved[k] for k in keys},
        "loaded": {k: scaler2.state_dict()[k] for k in keys},
        "optimizer_state_loaded": _equal_states(saved_opt["state"], loaded_opt["state"]),
        "load_again": again,
    }


def _equal_states(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    def same(x: dict[str, Any], y: dict[str, Any]) -> bool:
        return x.keys() == y.keys() and all(torch.equal(local(x[k]), local(y[k])) for k in x)

    return a.keys() == b.keys() and all(same(a[p], b[p]) for p in a)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return gloo_job_once(_rank, 2, JOB_TIMEOUT_S, tmp_path_factory)


def test_torch_scaler_moves_the_scale_on_the_checkpoint_load(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        torch_run = rank["torch"]
        assert torch_run["saved"] == {"scale": 1024.0, "_growth_tracker": 2}
        assert torch_run["loaded"] == {"scale": 2048.0, "_growth_tracker": 0}  # accelerate#4289
        assert torch_run["load_again"] == "_growth_tracker initialized before _scale"


def test_lossscale_scaler_comes_back_as_saved(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        ours = rank["lossscale"]
        assert ours["saved"] == {"scale": 1024.0, "_growth_tracker": 2}
        assert ours["loaded"] == ours["saved"]
        assert ours["optimizer_state_loaded"]
        assert ours["load_again"] is None
