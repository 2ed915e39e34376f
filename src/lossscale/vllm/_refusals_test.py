"""What a planned engine refuses at build, naming the cause, and what it leaves alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import lossscale.vllm
from lossscale.vllm import _testing as T


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("refusals")


@pytest.fixture(scope="module")
def model(folder: Path) -> str:
    return T.tiny_llama(str(folder / "llama"), plant_layer=None)


@pytest.fixture(scope="module")
def plan(folder: Path) -> str:
    return T.plan_file(str(folder / "plan.json"), ["model.layers.1.mlp.down_proj"])


def test_left_out_of_vllm_plugins_a_bfloat16_engine_runs_with_the_variable_set(
    model: str, plan: str
) -> None:
    """A trainer keeping the plan beside vLLM rollouts in bfloat16 (verl's default rollout
    dtype): vLLM's own allowlist of plugins leaves lossscale's out (its own process: vLLM loads
    plugins once per process)."""
    import subprocess
    import sys

    script = (
        "import torch, vllm.engine.arg_utils as a\n"
        "from lossscale.vllm import _testing as T\n"
        f"with T.engine({model!r}, 'bfloat16', {plan!r}) as llm:\n"
        "    assert llm.llm_engine.model_config.dtype == torch.bfloat16\n"
        "    assert T.vllm_logprobs(llm, T.prompts()).isfinite().all()\n"
        "print('ran', hasattr(a.EngineArgs.create_model_config, '__wrapped__'))\n"
    )
    env = os.environ | {"VLLM_PLUGINS": "", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ran False" in done.stdout


def test_another_dtype_is_refused_and_auto_becomes_float16(model: str, plan: str) -> None:
    with (
        pytest.raises(
            ValueError, match=r"LOSSSCALE_PLAN is set, and the engine's dtype is .*VLLM_PLUGINS"
        ),
        T.engine(model, "bfloat16", plan),
    ):
        pass
    with T.engine(model, "auto", plan) as llm:  # vLLM alone picks bfloat16 on this CPU
        assert llm.llm_engine.model_config.dtype == torch.float16


@pytest.mark.parametrize("text", ["{}", "not json", None])
def test_a_file_that_is_not_a_plan_is_refused(folder: Path, model: str, text: str | None) -> None:
    path = folder / "bad.json"
    path.unlink(missing_ok=True)
    if text is not None:
        path.write_text(text, encoding="utf-8")
    with (
        pytest.raises(ValueError, match=r"LOSSSCALE_PLAN='.*bad\.json' is not a float16 plan"),
        T.engine(model, "float16", str(path)),
    ):
        pass


def test_a_module_the_model_lacks_is_refused_by_name(folder: Path, model: str) -> None:
    plan = T.plan_file(str(folder / "lacks.json"), ["model.layers.7.mlp.down_proj"])
    with (
        pytest.raises(ValueError, match=r"keeps 'model\.layers\.7\.mlp\.down_proj' in float32"),
        T.engine(model, "float16", plan),
    ):
        pass


def test_an_architecture_it_does_not_know_is_refused(folder: Path, plan: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    path = str(folder / "gpt2")
    config = GPT2Config(vocab_size=T.VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=128)
    GPT2LMHeadModel(config).save_pretrained(path)
    with (
        pytest.raises(ValueError, match=r"this model is GPT2LMHeadModel, whose layout"),
        T.engine(path, "float16", plan),
    ):
        pass


def test_an_unsupported_vllm_is_refused_only_with_the_variable(
    monkeypatch: pytest.MonkeyPatch, plan: str
) -> None:
    import vllm

    with pytest.raises(ImportError, match=r"supports vLLM 0\.32\.x .*this is vLLM 0\.31\.0"):
        lossscale.vllm.check_version("0.31.0")
    lossscale.vllm.check_version(vllm.__version__)
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    monkeypatch.delenv("LOSSSCALE_PLAN", raising=False)
    lossscale.vllm.register()  # an engine without the variable is never touched
    monkeypatch.setenv("LOSSSCALE_PLAN", plan)
    with pytest.raises(
        ImportError, match=r"this is vLLM 0\.33\.1: .*unset LOSSSCALE_PLAN.*VLLM_PLUGINS"
    ):
        lossscale.vllm.register()


def test_without_the_variable_nothing_changes(model: str) -> None:
    def read(model: torch.nn.Module) -> tuple[set[str], list[str]]:
        dtypes = {str(p.dtype) for p in model.parameters()}
        replaced = [
            name
            for name, m in model.named_modules()
            if "forward" in vars(m) or type(m).__module__.startswith("lossscale")
        ]
        return dtypes, replaced

    with T.engine(model, "float16") as llm:
        dtypes, replaced = llm.apply_model(read)[0]
    assert dtypes == {"torch.float16"}
    assert replaced == []


def test_a_family_vllm_refuses_in_float16_and_lossscale_does_not_know_stays_refused(
    folder: Path, plan: str
) -> None:
    # GLM-4: vLLM refuses it in float16 ("numerical instability"), and lossscale.vllm does
    # not lift that refusal for it (it lifts it for the Gemma 2 and 3 layouts it computes)
    from transformers import Glm4Config, Glm4ForCausalLM

    path = str(folder / "glm4")
    config = Glm4Config(
        vocab_size=T.VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        pad_token_id=0,
        eos_token_id=2,
    )
    Glm4ForCausalLM(config).save_pretrained(path)
    with (
        pytest.raises(ValueError, match=r"'glm4' does not support float16"),
        T.engine(path, "float16", plan),
    ):
        pass
