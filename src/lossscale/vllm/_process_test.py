"""The engine in its own process (vLLM's default): the plugin loads there from the entry
point and reads LOSSSCALE_PLAN from the environment the process inherits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from lossscale.vllm import _testing as T

SCRIPT = """
import json, sys
from lossscale.vllm import _testing as T
from vllm import LLM
try:
    LLM(model=sys.argv[1], dtype="float16", **T.ENGINE)
except ValueError as error:  # the plan names a module the model lacks
    print("REFUSED", error, flush=True)
import os
os.environ["LOSSSCALE_PLAN"] = sys.argv[2]
llm = LLM(model=sys.argv[1], dtype="float16", **T.ENGINE)
print("LOGPROBS", json.dumps(T.vllm_logprobs(llm, T.prompts()).tolist()), flush=True)
llm.llm_engine.engine_core.shutdown()
"""


def test_the_engine_in_its_own_process_keeps_the_plan(tmp_path: Path) -> None:
    model = T.tiny_llama(str(tmp_path / "llama"), plant_layer=1)
    plan = T.plan_file(str(tmp_path / "plan.json"), ["model.layers.1.mlp.down_proj"])
    lacks = T.plan_file(str(tmp_path / "lacks.json"), ["model.layers.1.mlp.nothing"])
    env = os.environ | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "LOSSSCALE_PLAN": lacks,
    }
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, model, plan],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stderr[-3000:]
    assert any(
        line.startswith("REFUSED") and "'model.layers.1.mlp.nothing'" in line for line in lines
    ), run.stdout
    found = next(line for line in lines if line.startswith("LOGPROBS"))
    own_process = torch.tensor(json.loads(found.split(" ", 1)[1]), dtype=torch.float64)
    with T.engine(model, "float16", plan) as llm:
        in_process = T.vllm_logprobs(llm, T.prompts())
    with T.engine(model, "float16") as llm:
        plain = T.vllm_logprobs(llm, T.prompts())
    assert plain.isnan().any()
    assert not own_process.isnan().any()
    torch.testing.assert_close(own_process, in_process, rtol=0, atol=1e-6)
