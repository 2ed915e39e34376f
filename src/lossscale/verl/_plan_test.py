"""The float16 audit's plan in verl's FSDP engine (``LOSSSCALE_PLAN``), on the CPU: a Llama
whose attention logits pass 65504 in float16 skips every step in verl's float16 engine on its
own; with the plan the audit wrote, its kept attention computes in float32 with float32
weights, the rest in float16, and the steps apply, starting at the plan's initial scale."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import lossscale.verl as lv
from lossscale._testing import one_torch_thread
from lossscale.torch import audit
from lossscale.torch._audit import _testing as models
from lossscale.verl import _testing

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)

KEPT = "model.layers.0.self_attn"


@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The failing model saved where verl loads it, and the plan its audit wrote."""
    folder = tmp_path_factory.mktemp("failing")
    models.attention_logits_failure(models.llama()).save_pretrained(folder / "model")
    result = audit(
        models.attention_logits_failure(models.llama()),
        models.token_sum_loss,
        models.batches(2),
        mode="half",
    )
    result.save(folder / "plan.json")
    _testing.cpu_platform()
    with _testing.process_group():
        yield {"model": str(folder / "model"), "plan": str(folder / "plan.json"), "audit": result}


@pytest.fixture(params=["fsdp2", "fsdp"])
def strategy(request: pytest.FixtureRequest) -> Iterator[str]:
    with _testing.on_cpu(request.param):
        yield str(request.param)


def _run(model: str, strategy: str, steps: int = 2) -> dict[str, Any]:
    built = _testing.engine(model, strategy, attention="eager")
    probe = _testing.dtype_probe(
        built.module,
        {"kept": f"{KEPT}.q_proj", "other": "model.layers.1.self_attn.q_proj"},
    )
    start = built.scaler.get_scale()
    for seed in range(steps):
        _testing.train_step(built, seed)
    return {
        "engine": built,
        "start": start,
        "skipped": int(built.scaler.skipped_steps),
        "epochs": built.lr_scheduler.last_epoch,
        "dtypes": dict(probe),
    }


def test_without_the_plan_verl_s_float16_engine_skips_every_step(
    failing: dict[str, Any], strategy: str
) -> None:
    run = _run(failing["model"], strategy)
    assert run["skipped"] == 2 and run["epochs"] == 0  # a forward overflow: no scale helps
    f16 = torch.float16
    assert run["dtypes"] == {"kept": (f16, f16, f16), "other": (f16, f16, f16)}
    assert not hasattr(run["engine"], "lossscale_plan")


def test_with_the_plan_the_kept_modules_compute_in_float32_and_the_steps_apply(
    failing: dict[str, Any], strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert failing["audit"].float32_modules == (KEPT,)
    monkeypatch.setenv("LOSSSCALE_PLAN", failing["plan"])
    run = _run(failing["model"], strategy)
    assert run["skipped"] == 0 and run["epochs"] == 2
    f16, f32 = torch.float16, torch.float32
    assert run["dtypes"] == {"kept": (f32, f32, f32), "other": (f16, f16, f16)}
    assert run["start"] == failing["audit"].initial_scale  # the plan's initial scale
    assert repr(run["engine"].lossscale_plan) == "PlanHandle(1 modules in float32, half, live)"
    # LOSSSCALE_INIT_SCALE wins over the plan's
    monkeypatch.setenv("LOSSSCALE_INIT_SCALE", "256")
    assert _testing.engine(failing["model"], strategy, attention="eager").scaler.get_scale() == 256


def test_the_plan_is_for_float16_language_models_only(
    failing: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOSSSCALE_PLAN", failing["plan"])
    built = _testing.engine(failing["model"], "fsdp2", param_dtype="bf16", attention="eager")
    assert built.scaler is None and not hasattr(built, "lossscale_plan")


def test_a_plan_for_another_model_is_refused_naming_the_module(
    failing: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = json.loads(Path(failing["plan"]).read_text())
    data["float32_modules"] = ["model.layers.7.self_attn"]
    (tmp_path / "other.json").write_text(json.dumps(data))
    monkeypatch.setenv("LOSSSCALE_PLAN", str(tmp_path / "other.json"))
    with pytest.raises(ValueError, match=r"'model.layers.7.self_attn', which the model has not"):
        _testing.engine(failing["model"], "fsdp2", attention="eager")


def test_a_plan_variable_that_names_no_plan_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^LOSSSCALE_PLAN='/nonexistent/plan.json': "):
        lv.settings({"LOSSSCALE_PLAN": "/nonexistent/plan.json"})
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match=r"^LOSSSCALE_PLAN='.*bad.json': "):
        lv.settings({"LOSSSCALE_PLAN": str(tmp_path / "bad.json")})
