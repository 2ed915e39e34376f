"""``audit(..., mode="half")`` on post-norm blocks and on parameters float16 cannot hold, run on
``model.half()`` models built from a config (BERT, OLMo2, Gemma2, with a massive activation
planted as the audit's tests plant it, and the smallest case: ``Sequential(PostNorm(Linear ->
LayerNorm), Linear)``): where keeping the overflowing module in float32 does not help (its
float32 output, cast back to float16, still overflows), the enclosing module that normalises
it is kept, the plan 1-minimal and verified, and it trains in float16 where the same run
without it does not; a parameter above 65504 is a finding that names it."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lossscale._testing import one_torch_thread
from lossscale.torch import LossScaleOptimizer, audit, load_plan
from lossscale.torch._audit import _testing as models
from lossscale.torch._audit.auditor import enclosing_modules
from lossscale.torch._audit.handle import keep_float32

pytest.importorskip("transformers")

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)
STEPS = 4

#: case -> (build the float32 model with the overflow planted, loss_fn, the batches audited
#: (each overflows float16), the module that overflows, the plan)
CASES: dict[str, tuple[Callable[[], Any], Callable[..., Any], list[torch.Tensor], str, str]] = {
    "post norm": (
        models.post_norm,
        models.squared_loss,
        models.post_norm_batches(2),
        "0.linear",
        "0",
    ),
    "bert": (
        lambda: models.bert_massive_activation(models.bert(), weight=1000.0, gain=5.0),
        models.logits_sum_loss,
        models.batches(2),
        "bert.encoder.layer.1.output.dense",
        "bert.encoder.layer.1.output",
    ),
    "olmo2": (
        lambda: models.massive_activation_failure(models.olmo2(), gain=20.0),
        models.token_sum_loss,
        models.batches(2),
        "model.layers.1.mlp.down_proj",
        "model.layers.1",
    ),
    "gemma2": (
        lambda: models.massive_activation_failure(models.gemma2(), gain=4.0),
        models.token_sum_loss,
        models.batches(2),
        "model.layers.1.mlp.down_proj",
        "model.layers.1",
    ),
}


def _train(
    model: torch.nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    batches: list[torch.Tensor],
    scale: float,
) -> tuple[list[float], int]:
    """A few steps of float16 training of the ``.half()`` model (SGD under lossscale's
    ``LossScaleOptimizer``, from ``scale``): the losses and how many steps were skipped."""
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4), initial_scale=scale)
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        losses.append(float(loss.detach()))
        opt.get_scaled_loss(loss).backward()
        opt.step()
        opt.zero_grad()
    return losses, int(opt.skipped_steps)


@pytest.fixture(scope="module")
def audited() -> dict[str, Any]:
    found = {}
    for case, (build, loss_fn, batches, _, _) in CASES.items():
        found[case] = audit(build(), loss_fn, batches, mode="half", report=False)
    return found


@pytest.mark.filterwarnings("ignore:.*eos_token_id")
@pytest.mark.parametrize("case", list(CASES))
def test_the_enclosing_module_is_kept_and_the_plan_trains_in_float16(
    audited: dict[str, Any], case: str
) -> None:
    build, loss_fn, audited_batches, overflowing, kept = CASES[case]
    batches = audited_batches * (STEPS // len(audited_batches))  # the steps: each overflows
    result = audited[case]
    first = result.findings[0]
    assert (first.module, first.phase, first.op) == (overflowing, "forward", "linear")
    assert first.fixable and first.amax > 65504.0
    assert all(f.fixable for f in result.findings)
    assert result.float32_modules == (kept,)
    assert result.verified is True and result.scale_range is not None
    assert kept in str(result) and "no module-local fix" not in str(result)
    scale = result.initial_scale
    assert scale is not None

    # the module alone, kept in float32, hands its output back to float16: inf
    alone = build().half()
    with keep_float32(alone, (overflowing,), "half"), torch.no_grad():
        assert not math.isfinite(float(loss_fn(alone, batches[0])))

    plain = build().half()  # the same run without the plan
    plain_losses, plain_skipped = _train(plain, loss_fn, batches, scale)
    assert not any(map(math.isfinite, plain_losses)) and plain_skipped == STEPS

    model = build().half()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    handed: list[torch.dtype] = []  # what the kept module hands back: float16
    hook = model.get_submodule(kept).register_forward_hook(
        lambda module, args, out: handed.append(out.dtype)
    )
    with result.apply(model):
        assert next(model.get_submodule(kept).parameters()).dtype == torch.float32
        losses, skipped = _train(model, loss_fn, batches, scale)
    hook.remove()
    assert handed == [torch.float16] * STEPS
    assert all(map(math.isfinite, losses)), losses
    assert skipped == 0
    after = dict(model.named_parameters())
    assert after[f"{overflowing}.weight"].dtype == torch.float16  # back after remove()
    changed = [n for n, p in before.items() if not torch.equal(p, after[n].detach())]
    assert any(n.startswith(f"{kept}.") for n in changed)  # trained, in float32 while kept
    assert any(not n.startswith(f"{kept}.") for n in changed)  # and in float16 around it


def test_a_block_is_the_largest_module_tried() -> None:
    """Smallest first, up to the decoder or encoder layer; never the backbone, the root, a
    ``ModuleList`` (no forward of its own) or a module outside every block that holds one."""
    llama = enclosing_modules(models.llama())
    chain = ["model.layers.1.mlp.down_proj"]
    while (up := llama(chain[-1])) is not None:
        chain.append(up)
    assert chain == [
        "model.layers.1.mlp.down_proj",
        "model.layers.1.mlp",
        "model.layers.1",
    ]
    assert llama("lm_head") is None and llama("model.norm") is None
    assert llama("model.embed_tokens") is None  # its parent holds the layers: the backbone
    bert = enclosing_modules(models.bert())
    assert bert("bert.encoder.layer.0.output.dense") == "bert.encoder.layer.0.output"
    assert bert("bert.encoder.layer.0.output") == "bert.encoder.layer.0"
    assert bert("bert.embeddings.word_embeddings") == "bert.embeddings"
    assert bert("bert.embeddings") is None
    assert bert("cls.predictions.transform.dense") == "cls.predictions.transform"

    class Experts(torch.nn.Module):  # a layer's experts: a list inside the block list
        def __init__(self) -> None:
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(Experts() for _ in range(2))
    moe = enclosing_modules(model)
    assert moe("layers.1.experts.0") == "layers.1"  # past the experts' ModuleList
    assert moe("layers.1") is None
    post = enclosing_modules(models.post_norm())
    assert post("0.linear") == "0" and post("0") is None and post("1") is None


def test_an_overflow_of_the_residual_stream_stays_without_a_fix() -> None:
    """Llama adds the MLP's output to the residual stream inside the decoder layer: the
    enclosing modules are tried, smallest first, up to the layer, and none helps."""
    model = models.massive_activation_failure(models.llama())
    result = audit(model, models.token_sum_loss, models.batches(1), mode="half", report=False)
    assert result.float32_modules == () and result.verified is False
    tried = [f.module for f in result.findings if f.op == "to"]
    assert tried == ["model.layers.1.mlp.down_proj", "model.layers.1.mlp", "model.layers.1"]
    assert not any(f.fixable for f in result.findings)


@pytest.mark.parametrize("mode", ["half", "autocast"])
def test_a_parameter_float16_cannot_hold_is_a_finding_naming_it(
    mode: str, tmp_path: pathlib.Path
) -> None:
    model = models.llama()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 5] = 7e4
    batches = models.batches(2)
    # plain float16: model.half() makes it inf, and the loss is not finite
    half = models.llama()
    half.load_state_dict(model.state_dict())
    half = half.half()
    assert torch.isinf(half.model.layers[0].mlp.up_proj.weight).any()
    with torch.no_grad():
        assert not torch.isfinite(models.token_sum_loss(half, batches[0]))

    result = audit(model, models.token_sum_loss, batches, mode=mode, report=False)
    if mode == "autocast":  # the parameter stays float32: keeping its module fixes it
        assert result.float32_modules == ("model.layers.0.mlp.up_proj",)
        assert result.verified is True
        return
    first = result.findings[0]
    assert (first.module, first.phase, first.op) == (
        "model.layers.0.mlp.up_proj",
        "forward",
        "parameter",
    )
    assert first.amax == 7e4 and first.intrinsic and not first.fixable
    assert "'model.layers.0.mlp.up_proj.weight'" in first.note and "65504" in first.note
    assert not any(f.module == "" and f.op == "loss" for f in result.findings)
    assert result.float32_modules == () and result.verified is False
    assert "model.layers.0.mlp.up_proj.weight" in str(result)
    assert "(forward parameter in model.layers.0.mlp.up_proj)" in result.reason
    result.save(tmp_path / "plan.json")  # the plan file keeps it
    assert load_plan(tmp_path / "plan.json").findings[0] == first


def test_the_parameters_are_read_with_the_first_forward() -> None:
    """A clean half-mode audit reads the device once per batch and once to verify, as an
    autocast one: the parameters' check rides on the first forward's read."""
    reads = {}
    for mode in ("autocast", "half"):
        model = models.llama(2, width=64, heads=4)
        listed = models.batches(2, shape=(4, 12))
        with models.HostReads() as counted:
            result = audit(model, models.token_sum_loss, listed, mode=mode, report=False)
        assert result.float32_modules == () and result.verified is True
        reads[mode] = counted.count
    assert reads["half"] == reads["autocast"] == 3
