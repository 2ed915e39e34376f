"""lossscale.vllm on CUDA (``scripts/gpu_check.sh``'s ``vllm_cuda`` section; skipped without a
CUDA device and vLLM's CUDA build): the planted Llama of ``_engine_test`` in a float16 engine,
plain and planned, eager and with vLLM's torch.compile and CUDA graphs, against the trainer's
autocast-with-plan forward on the same GPU; and the engine in a Ray worker given the variable
in its ``runtime_env`` only, as verl runs its rollouts."""

from __future__ import annotations

import os

import pytest
import torch

from lossscale.vllm import _testing as T

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

KEPT = "model.layers.1.mlp.down_proj"
#: A small share of the GPU for each engine (one at a time).
CUDA = {"gpu_memory_utilization": 0.2}


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The planted Llama of ``_engine_test`` and a plan keeping ``KEPT``: (model, plan)."""
    folder = tmp_path_factory.mktemp("vllm_cuda")
    return T.tiny_llama(str(folder / "layer1")), T.plan_file(str(folder / "plan.json"), [KEPT])


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_planned_float16_on_cuda(planted: tuple[str, str], eager: bool) -> None:
    model, plan = planted
    with T.engine(model, "float16", None, enforce_eager=eager, **CUDA) as llm:
        plain = T.vllm_logprobs(llm, T.prompts())
    with T.engine(model, "float16", plan, enforce_eager=eager, **CUDA) as llm:
        planned = T.vllm_logprobs(llm, T.prompts())
    with T.engine(model, "float32", None, enforce_eager=eager, **CUDA) as llm:
        float32 = T.vllm_logprobs(llm, T.prompts())
    reference = T.trainer_logprobs(
        model, T.prompts(), dtype=torch.float16, plan=[KEPT], device="cuda"
    )
    assert plain.isnan().any()
    assert not planned.isnan().any()
    assert T.mean_abs(planned, reference) <= T.mean_abs(float32, reference)


def test_a_ray_worker_on_cuda_gets_the_variable_from_its_runtime_env(
    planted: tuple[str, str],
) -> None:
    model, plan = planted
    ray = pytest.importorskip("ray")
    assert "LOSSSCALE_PLAN" not in os.environ
    env = {"LOSSSCALE_PLAN": plan, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

    def rollout(path: str) -> list[list[float]]:
        from vllm import LLM

        llm = LLM(model=path, dtype="float16", **(T.ENGINE | CUDA))
        try:
            return T.vllm_logprobs(llm, T.prompts()).tolist()  # type: ignore[no-any-return]
        finally:
            llm.llm_engine.engine_core.shutdown()

    with T.environ(RAY_USAGE_STATS_ENABLED="0"):
        ray.init(num_gpus=1, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        rows = ray.get(ray.remote(num_gpus=1)(rollout).remote(model), timeout=300)
    finally:
        ray.shutdown()
    with T.engine(model, "float16", plan, **CUDA) as llm:
        here = T.vllm_logprobs(llm, T.prompts())
    assert not here.isnan().any()
    torch.testing.assert_close(torch.tensor(rows, dtype=torch.float64), here, rtol=0, atol=1e-6)
