"""verl 0.9's FSDP engine itself, built and run on the CPU (gloo, one rank here; two in
``_ranks_test.py``), with lossscale.verl and side by side with verl's own hard-coded torch scaler:
``initialize``, ``train_batch`` (scale, backward, unscale_, clip, step, update),
``lr_scheduler_step``, ``save_checkpoint`` and ``load_checkpoint``.

verl registers its FSDP engine for cuda and npu only and has no CPU platform; the tests register
one with verl's platform API (``_testing.cpu_platform``). FSDP2 then runs verl's code unchanged.
FSDP1 needs three CPU changes of verl's calls (``_testing.cpu_fsdp1``): ``sync_module_states=False``
and ``device_id=cpu`` in its ``FSDP(...)`` call (torch's FSDP1 syncs module states on an
accelerator only), and no move "to the GPU" before a save. The same run on a GPU is in
``scripts/gpu_check.sh``'s verl section."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.fsdp import sharded_grad_scaler as torch_sharded
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

import lossscale.verl as lv
from lossscale._testing import one_torch_thread
from lossscale.verl import _testing

STRATEGIES = ["fsdp2", "fsdp"]
one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _testing.cpu_platform()
    with _testing.process_group():
        yield _testing.tiny_llama(str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(params=STRATEGIES)
def strategy(request: pytest.FixtureRequest) -> Iterator[str]:
    with _testing.on_cpu(request.param):
        yield str(request.param)


@pytest.fixture
def verl_alone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """verl's own methods (lossscale.verl unpatched) and its hard-coded
    ``ShardedGradScaler(growth_interval=400)`` with one change: on the CPU (torch's default
    device, ``"cuda"``, disables it without CUDA, so it would scale nothing here)."""
    lv.unpatch()
    monkeypatch.setattr(
        torch_sharded,
        "ShardedGradScaler",
        functools.partial(TorchSharded, "cpu"),
    )
    try:
        yield
    finally:
        lv.patch()


def test_verl_builds_lossscale_s_scaler_with_its_own_arguments(
    model_path: str, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = _testing.engine(model_path, strategy)
    scaler = built.scaler
    assert type(scaler) is lv.ShardedGradScaler
    assert isinstance(scaler, TorchSharded)  # verl's own test's check
    assert scaler.get_growth_interval() == 400  # verl's argument
    assert (scaler.get_scale(), scaler.is_enabled()) == (2.0**16, True)
    assert torch_sharded.ShardedGradScaler is TorchSharded  # swapped only while verl builds
    # lossscale's settings, read from the environment when verl builds the engine
    monkeypatch.setenv("LOSSSCALE_INIT_SCALE", "1024")
    monkeypatch.setenv("LOSSSCALE_GROWTH_INTERVAL", "7")
    scaler = _testing.engine(model_path, strategy).scaler
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (1024.0, 7)
    # bfloat16 engines have no scaler, as in verl
    assert _testing.engine(model_path, strategy, param_dtype="bf16").scaler is None


@pytest.mark.usefixtures("verl_alone")
def test_side_by_side_verl_alone_builds_torch_s_scaler(model_path: str, strategy: str) -> None:
    scaler = _testing.engine(model_path, strategy).scaler
    assert type(scaler) is TorchSharded
    assert scaler.get_growth_interval() == 400


def test_a_skipped_step_changes_nothing_and_leaves_the_lr_schedule(
    model_path: str, strategy: str
) -> None:
    run = _testing.skip_run(model_path, strategy)
    assert run["weights"] and run["moments"]  # bit-identical across the skipped step
    assert run["scale"] == 2.0**15  # backed off
    assert run["epochs"] == 0  # verl's LR schedule did not advance on the skipped step
    assert run["lrs"][1] == run["lrs"][0]  # the LR verl reports for it: unchanged
    assert run["lrs"][2] < run["lrs"][1]  # the next applied step advances the cosine
    assert run["final_epoch"] == 2


@pytest.mark.usefixtures("verl_alone")
def test_side_by_side_verl_alone_advances_the_lr_schedule_on_a_skip(
    model_path: str, strategy: str
) -> None:
    run = _testing.skip_run(model_path, strategy)
    assert run["weights"] and run["moments"]  # torch's scaler skips the step too
    assert run["scale"] == 2.0**15
    assert run["epochs"] == 1  # but verl steps the LR schedule anyway
    assert run["lrs"][1] < run["lrs"][0]
    assert run["final_epoch"] == 3


def test_the_scale_is_saved_with_verl_s_checkpoint_and_restored(
    model_path: str, strategy: str, tmp_path: Path
) -> None:
    uninterrupted, resumed, files = _testing.resume_run(model_path, strategy, str(tmp_path))
    assert uninterrupted == resumed == 2.0**15
    assert lv.checkpoint_file(str(tmp_path), 1, 0) == str(
        tmp_path / "lossscale_scaler_world_size_1_rank_0.pt"
    )
    assert "lossscale_scaler_world_size_1_rank_0.pt" in files
    assert "extra_state_world_size_1_rank_0.pt" in files  # verl's, beside it


@pytest.mark.usefixtures("verl_alone")
def test_side_by_side_verl_alone_restarts_the_scale_at_2_16(
    model_path: str, strategy: str, tmp_path: Path
) -> None:
    uninterrupted, resumed, files = _testing.resume_run(model_path, strategy, str(tmp_path))
    assert uninterrupted == 2.0**15
    assert resumed == 2.0**16  # not checkpointed: a resume starts over
    assert not any(name.startswith("lossscale") for name in files)


def test_a_checkpoint_without_the_scale_warns_and_keeps_the_initial_one(
    model_path: str, strategy: str, tmp_path: Path
) -> None:
    built = _testing.engine(model_path, strategy)
    _testing.train_step(built, 0, overflow=True)
    built.save_checkpoint(str(tmp_path), global_step=1)
    os.remove(lv.checkpoint_file(str(tmp_path), 1, 0))  # as if saved by verl alone
    resumed = _testing.engine(model_path, strategy)
    with pytest.warns(UserWarning, match="saved without lossscale.verl.*starts at 65536"):
        resumed.load_checkpoint(str(tmp_path))
    assert resumed.scaler.get_scale() == 2.0**16


def test_verl_s_checkpoint_contents_decide(model_path: str, strategy: str, tmp_path: Path) -> None:
    """The scale is extra state: saved and loaded only when verl saves and loads its own
    (``checkpoint.save_contents`` / ``load_contents`` name ``extra``)."""
    contents = {"save_contents": ["model", "optimizer"], "load_contents": ["model", "optimizer"]}
    built = _testing.engine(model_path, strategy, checkpoint=contents)
    _testing.train_step(built, 0, overflow=True)
    built.save_checkpoint(str(tmp_path), global_step=1)
    assert not os.path.exists(lv.checkpoint_file(str(tmp_path), 1, 0))
    assert not os.path.exists(tmp_path / "extra_state_world_size_1_rank_0.pt")
