"""The cost of ``LOSSSCALE_PLAN`` in vLLM: time per generated token of a planned float16
engine beside plain float16 and bfloat16 (lossscale.vllm).

Run: ``python -m benchmarks.vllm_bench [--quick] [--rounds N] [--json F]`` (in an environment
with vLLM: ``.venv-vllm``; ``python -m benchmarks`` skips it without vLLM).

A Llama built from a config (hidden 512, 4 layers, 8 heads of 64, intermediate 1024, vocabulary
1024; ``--quick``: hidden 128, 2 layers), random float32 weights saved with
``save_pretrained``. Three engines (``vllm.LLM``, eager, no torch.compile), each in its own
process:

  float16       ``dtype="float16"``: vLLM alone
  float16+plan  the same with ``LOSSSCALE_PLAN`` naming a one-module plan
                (``model.layers.1.mlp.down_proj``): that module in float32, the residual
                stream and the norms in float32
  bfloat16      ``dtype="bfloat16"``: vLLM alone

Each round, each engine (rotating order, as ``_timing.interleaved``) generates 64 tokens for
each of 4 prompts of 16 tokens (``ignore_eos``, temperature 1): timed per round, the whole
``generate`` over the tokens generated. Ratios: over plain float16, of the medians. Speed is
never asserted.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# each engine in its own process (vLLM's default): engines sharing one process bind the same
# OpenMP threads, and the later ones then ran 2-10x slower here, whatever their dtype
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import importlib.metadata
import sys
import tempfile
import warnings
from typing import Any

if not __package__:  # run as a file (python benchmarks/NAME.py): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _cli, _report
from benchmarks._timing import interleaved

VARIANTS = ("float16", "float16+plan", "bfloat16")
KEPT = "model.layers.1.mlp.down_proj"


def _model(path: str, hidden: int, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def _plan(path: str) -> None:
    import torch

    from lossscale.torch import Float16Plan

    versions = {"lossscale": "bench", "torch": torch.__version__}
    Float16Plan("autocast", (KEPT,), None, None, 2.0**-24, "", None, 0, (), versions).save(path)


def run(quick: bool, rounds: int | None) -> dict[str, Any]:
    """Every round, each engine once (rotating order); the section, JSON-ready."""
    warnings.filterwarnings("ignore")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rounds = rounds or (2 if quick else 7)
    hidden, layers = (128, 2) if quick else (512, 4)
    new_tokens, batch = 64, 4
    prompts = [
        TokensPrompt(prompt_token_ids=[(7 * i + j) % 1000 + 3 for j in range(16)])
        for i in range(batch)
    ]
    params = SamplingParams(
        max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=1.0, seed=0
    )
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model")
        plan = os.path.join(folder, "plan.json")
        _model(path, hidden, layers)
        _plan(plan)
        engines = {}
        for name in VARIANTS:
            _cli.progress(f"vllm: starting the {name} engine")
            if name == "float16+plan":
                os.environ["LOSSSCALE_PLAN"] = plan
            try:
                engines[name] = LLM(
                    model=path,
                    dtype=name.split("+")[0],
                    enforce_eager=True,
                    max_model_len=256,
                    skip_tokenizer_init=True,
                    seed=0,
                )
            finally:
                os.environ.pop("LOSSSCALE_PLAN", None)

        def generate(name: str) -> Any:
            return lambda: engines[name].generate(prompts, params, use_tqdm=False)

        _cli.progress(f"vllm: {rounds} rounds")
        timing = interleaved({name: (None, generate(name)) for name in VARIANTS}, rounds, warmup=1)
        for engine in engines.values():
            engine.llm_engine.engine_core.shutdown()
    tokens = new_tokens * batch
    per_token = {n: timing.median(n) / tokens * 1e3 for n in VARIANTS}
    row = {
        "model": f"Llama hidden {hidden}, {layers} layers",
        **timing.summary(),
        "per_token_ms": per_token,
        "ratios": {n: per_token[n] / per_token["float16"] for n in VARIANTS[1:]},
    }
    versions = {p: importlib.metadata.version(p) for p in ("vllm-cpu", "torch", "transformers")}
    return {
        "config": {
            "rounds": rounds,
            "tokens": tokens,
            "plan": [KEPT],
            "device": "cpu",
            "versions": versions,
        },
        "rows": [row],
    }


def render(section: dict[str, Any]) -> list[str]:
    return _report.render_vllm(section)


def main(argv: list[str] | None = None) -> int:
    args = _cli.parser(__doc__).parse_args(argv)
    return _cli.finish(run(args.quick, args.rounds), args.json, render)


if __name__ == "__main__":
    raise SystemExit(main())
