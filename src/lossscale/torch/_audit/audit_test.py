"""``lossscale.torch.audit`` on Hugging Face models built from a config, each with weights set
to fail in float16 one way (``lossscale.torch._audit._testing``), side by side with plain float16
runs of the same models: the first finding, the plan, its 1-minimality, the fix verified by
running, the loss-scale range and a ``GradScaler`` started from ``initial_scale``."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lossscale._testing import one_torch_thread
from lossscale.torch import Float16Audit, GradScaler, audit
from lossscale.torch._audit import _testing as models
from lossscale.torch._audit.handle import keep_float32

pytest.importorskip("transformers")

FLOAT16_MAX = 65504.0

#: case -> (build, the first intrinsic finding's place, the plan)
CASES: dict[str, tuple[Callable[[], Any], tuple[str, str, str] | None, tuple[str, ...]]] = {
    "massive activation": (
        lambda: models.massive_activation_failure(models.llama()),
        ("model.layers.1.mlp.down_proj", "forward", "linear"),
        ("model.layers.1.mlp.down_proj",),
    ),
    "attention logits": (
        lambda: models.attention_logits_failure(models.llama()),
        ("model.layers.0.self_attn", "forward", "matmul"),
        ("model.layers.0.self_attn",),
    ),
    "backward at scale 1": (
        lambda: models.backward_failure(models.qwen3()),
        ("model.layers.0.self_attn.q_proj", "backward", "MmBackward0"),
        ("model.layers.0.self_attn.q_proj",),
    ),
    "clean, gradients bound the scale": (models.llama, None, ()),
}
BATCHES = models.batches(2)


one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@pytest.fixture(scope="module")
def audited() -> dict[tuple[str, str], tuple[Any, Float16Audit]]:
    """One audit per case and device, shared by the tests of this module."""
    return {}


def _audit(audited: dict[Any, Any], case: str, device: str) -> tuple[Any, Float16Audit]:
    if (case, device) not in audited:
        model = CASES[case][0]().to(device)
        audited[case, device] = (model, audit(model, models.token_sum_loss, BATCHES))
    return audited[case, device]  # type: ignore[no-any-return]


def _finite_everywhere(model: Any, plan: tuple[str, ...], scale: float = 1.0) -> bool:
    with keep_float32(model, plan, "autocast"):
        return all(models.float16_step_is_finite(model, b, scale) for b in BATCHES)


@pytest.mark.parametrize("case", list(CASES))
def test_first_finding_and_plan(audited: dict[Any, Any], case: str, device: str) -> None:
    model, result = _audit(audited, case, device)
    _, place, plan = CASES[case]
    assert result.float32_modules == plan
    assert result.verified is True
    first_intrinsic = next(iter(result.intrinsic), None)
    if place is None:
        assert first_intrinsic is None
        assert result.findings and not any(f.intrinsic for f in result.findings)
        assert result.scale_range is not None and result.scale_range[1] < 2.0**16
    else:
        assert first_intrinsic is not None and result.first_overflow == first_intrinsic
        assert (first_intrinsic.module, first_intrinsic.phase, first_intrinsic.op) == place
        assert first_intrinsic.amax > FLOAT16_MAX and math.isfinite(first_intrinsic.amax)
        assert first_intrinsic.fixable and first_intrinsic.kind == "intrinsic"
        assert first_intrinsic.scale == (None if place[1] == "forward" else 1.0)
    text = str(result)
    assert "plan: keep" in text and f"of {len(list(model.named_modules()))} modules" in text
    for name in plan:
        assert name in text


@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v[2]])
def test_the_plan_fixes_float16_and_is_one_minimal(
    audited: dict[Any, Any], case: str, device: str
) -> None:
    model, result = _audit(audited, case, device)
    plan = result.float32_modules
    assert not _finite_everywhere(model, ())  # a plain float16 run fails
    assert _finite_everywhere(model, plan, result.initial_scale or 1.0)
    for name in plan:  # 1-minimal: any one module taken out brings an overflow back
        assert not _finite_everywhere(model, tuple(m for m in plan if m != name))


def test_the_massive_activation_is_measured_in_float32(audited: dict[Any, Any]) -> None:
    model, result = _audit(audited, "massive activation", "cpu")
    outputs: list[torch.Tensor] = []
    down = model.model.layers[1].mlp.down_proj
    handle = down.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    try:
        for b in BATCHES:
            models.token_sum_loss(model, b)
    finally:
        handle.remove()
    true_max = max(float(o.abs().max()) for o in outputs)
    assert result.findings[0].amax == pytest.approx(true_max, rel=0.01)
    rows = {r.tensor: r for r in result.report.latest()}
    assert rows["forward:model.layers.1.mlp.down_proj"].overflow > 0
    assert rows["forward:model.layers.1.mlp.down_proj"].amax == pytest.approx(
        float(outputs[-1].abs().max())
    )


@pytest.mark.parametrize("case", list(CASES))
def test_the_scale_range_holds_and_is_tight(
    audited: dict[Any, Any], case: str, device: str
) -> None:
    model, result = _audit(audited, case, device)
    assert result.scale_range is not None
    low, high = result.scale_range
    assert math.log2(low).is_integer() and math.log2(high).is_integer() and 1 <= low <= high
    assert low <= (result.initial_scale or 0) <= high
    plan = result.float32_modules
    assert _finite_everywhere(model, plan, high) and _finite_everywhere(model, plan, low)
    assert not _finite_everywhere(model, plan, 2 * high)  # the bound is exact
    bounds = [f for f in result.findings if not f.intrinsic]
    assert bounds and all(f.scale == 2 * high and f.phase == "backward" for f in bounds)
    # underflow at low, counted independently: float32 gradients against float16 ones, over
    # the entries above float32's rounding level (2**-24 of the gradient's global norm)
    params = [p for p in model.parameters() if p.requires_grad]
    worst_at_low, worst_below = 0.0, 0.0
    with keep_float32(model, plan, "autocast"):
        for b in BATCHES:
            ref = torch.autograd.grad(models.token_sum_loss(model, b), params)
            level = float(torch.stack([r.norm() for r in ref]).norm()) * 2.0**-24
            for scale, worst in ((low, "low"), (low / 2, "below")):
                with torch.autocast(device, dtype=torch.float16):
                    loss = models.token_sum_loss(model, b)
                got = torch.autograd.grad(loss * scale, params)
                lost = max(
                    float(
                        ((r.abs() >= level) & (g == 0)).sum()
                        / max(int((r.abs() >= level).sum()), 1)
                    )
                    for r, g in zip(ref, got, strict=True)
                )
                if worst == "low":
                    worst_at_low = max(worst_at_low, lost)
                else:
                    worst_below = max(worst_below, lost)
    assert worst_at_low <= result.underflow
    if low > 1:
        assert worst_below > result.underflow  # low is the smallest that keeps the threshold


def _skipped_steps(
    model: Any, scaler: Any, plan: tuple[str, ...], steps: int, enough: int | None = None
) -> list[int]:
    """The steps of ``steps`` float16 AdamW steps (lr 1e-4) that ``scaler`` skipped (stopping
    once it has skipped ``enough``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    skipped = []
    device = next(model.parameters()).device.type
    with keep_float32(model, plan, "autocast"):
        for i in range(steps):
            with torch.autocast(device, dtype=torch.float16):
                loss = models.token_sum_loss(model, BATCHES[i % len(BATCHES)])
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < before:
                skipped.append(i)
            optimizer.zero_grad()
            if len(skipped) == enough:
                break
    return skipped


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_from_initial_scale_does_not_back_off(audited: dict[Any, Any], case: str) -> None:
    """50 AdamW steps from ``initial_scale`` skip none (the gradients grow in the first steps:
    from one doubling below the top, the massive activation's run backs off at step 22); from
    torch's default start, each run backs off."""
    _, result = _audit(audited, case, "cpu")
    assert result.initial_scale is not None and result.scale_range is not None
    low, high = result.scale_range
    assert result.initial_scale == max(low, high / 8)
    plan = result.float32_modules
    steps = 50
    ours = _skipped_steps(
        CASES[case][0](), GradScaler("cpu", init_scale=result.initial_scale), plan, steps
    )
    default = _skipped_steps(CASES[case][0](), torch.amp.GradScaler("cpu"), plan, steps, enough=2)
    assert ours == [] and len(default) == 2


def test_a_backward_overflow_moves_until_the_producer_is_kept() -> None:
    """B's gradient into its input overflows; keeping B in float32 moves the overflow to the
    cast back to float16 at B's input, which only keeping A (its producer) removes: the plan
    is found by running again, and both are needed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with torch.no_grad():
        model[1].weight.fill_(1e3)

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).float().sum() * 100

    result = audit(model, loss_fn, [torch.randn(4, 8)])
    assert set(result.float32_modules) == {"0", "1"}
    places = [(f.module, f.phase, f.op) for f in result.intrinsic]
    assert places[0] == ("1", "backward", "AddmmBackward0")
    assert ("1", "backward", "ToCopyBackward0") in places
    assert result.verified is True


def test_half_mode_finds_the_residual_stream_has_no_local_fix() -> None:
    model = models.massive_activation_failure(models.llama())
    result = audit(model, models.token_sum_loss, BATCHES[:1], mode="half")
    assert result.mode == "half"
    first = result.findings[0]
    assert (first.module, first.phase, first.op) == (
        "model.layers.1.mlp.down_proj",
        "forward",
        "linear",
    )
    assert not first.fixable and "mode='autocast'" in first.note
    assert result.float32_modules == () and result.scale_range is None
    assert "mode='autocast'" in result.reason or "overflows" in result.reason
    assert result.verified is False
    assert "no module-local fix" in str(result)


def test_half_mode_keeps_attention_in_float32() -> None:
    model = models.attention_logits_failure(models.llama())
    result = audit(model, models.token_sum_loss, BATCHES[:1], mode="half")
    assert result.float32_modules == ("model.layers.0.self_attn",)
    assert result.verified is True and result.scale_range is not None
    half = model.half()
    with result.apply(half):
        attn = half.model.layers[0].self_attn
        assert attn.q_proj.weight.dtype == torch.float32
        assert half.model.layers[1].self_attn.q_proj.weight.dtype == torch.float16
        loss = models.token_sum_loss(half, BATCHES[0])
        assert bool(torch.isfinite(loss))
    assert attn.q_proj.weight.dtype == torch.float16


class _Loud(torch.nn.Linear):
    """A linear layer whose output is multiplied by 4e4 (in float16 under autocast)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 4e4


class _TwoBranches(torch.nn.Module):
    """One branch's float16 gradient is large (4e4: it bounds the scale at 2**0), the other's
    tiny (1e-8: it underflows at every scale up to there), both above float32's rounding level
    of the parameters' gradient (the large branch's weight gradient is exactly zero): no loss
    scale fits both."""

    def __init__(self) -> None:
        super().__init__()
        self.big = _Loud(8, 8, bias=False)
        self.small = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(torch.zeros_like(x)).float().sum() + self.small(x).float().sum() * 1e-8


def test_no_scale_fits_when_the_gradients_span_too_far() -> None:
    torch.manual_seed(0)
    result = audit(_TwoBranches(), lambda m, x: m(x), [torch.randn(4, 8)], report=False)
    assert result.float32_modules == () and result.report is None
    assert result.scale_range is None and result.initial_scale is None
    assert "small.weight" in result.reason and "2^0" in result.reason
    assert [(f.module, f.intrinsic, f.scale) for f in result.findings] == [("big", False, 2.0)]
    assert "no power of two fits" in str(result)


#: model -> (build, loss, the plan): transformers models whose key biases (in softmax
#: attention, their exact gradient is zero) leave float32 rounding noise in their gradient
HF_CASES: dict[str, tuple[Callable[[], Any], Callable[[Any, Any], Any], tuple[str, ...]]] = {
    "bert": (models.bert, models.logits_sum_loss, ()),
    "gpt2 with a massive activation": (
        lambda: models.gpt2_massive_activation(models.gpt2()),
        models.token_sum_loss,
        ("transformer.h.1.mlp.c_proj",),
    ),
    "t5": (models.t5, models.logits_sum_loss, ()),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_rounding_noise_does_not_bound_the_range(case: str) -> None:
    build, loss_fn, plan = HF_CASES[case]
    model = build()  # in training mode: dropout draws the same masks as in the audit's runs
    rng = torch.get_rng_state()
    result = audit(model, loss_fn, BATCHES, report=False)
    assert result.float32_modules == plan and result.verified is True
    assert result.scale_range is not None, result.reason
    high = result.scale_range[1]
    params = [p for p in model.parameters() if p.requires_grad]

    def finite(scale: float) -> bool:
        for b in BATCHES:
            torch.set_rng_state(rng)
            with keep_float32(model, plan, "autocast"), torch.autocast("cpu", torch.float16):
                loss = loss_fn(model, b)
            grads = torch.autograd.grad(loss * scale, params, allow_unused=True)
            if not all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
                return False
        return True

    assert finite(high) and not finite(2 * high)  # the top is exact
    if case != "t5":  # a key bias: its float32 gradient is rounding noise
        key = next(n for n, _ in model.named_parameters() if "key.bias" in n or "c_attn.bias" in n)
        torch.set_rng_state(rng)
        ref = dict(
            zip(
                [n for n, _ in model.named_parameters()],
                torch.autograd.grad(loss_fn(model, BATCHES[0]), params),
                strict=True,
            )
        )
        level = float(torch.stack([g.norm() for g in ref.values()]).norm()) * 2.0**-24
        if "c_attn" in key:
            width = ref[key].numel() // 3
            noise = ref[key][width : 2 * width]
        else:
            noise = ref[key]
        assert 0 < float(noise.abs().max()) < level


def test_the_predicted_bottom_is_the_final_casts_underflow_counted_exactly() -> None:
    """predicted_low against casting each gradient times 2**k to float16 (the entries below
    2**-24 of the global norm left out), for gradients whose magnitudes span 2**-45..2**3."""
    from lossscale.torch._audit.scales import MAX_EXPONENT, predicted_low, reference_of

    g = torch.Generator().manual_seed(0)
    grads = {
        name: torch.ldexp(
            torch.rand(n, generator=g) + 1.0, torch.randint(-45, 3, (n,), generator=g)
        )
        * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        for name, n in (("a", 1000), ("b", 300), ("c", 77))
    }
    grads["b"][:7] = 0.0  # zeros never count
    grads["d"] = torch.full((5,), 2.0**-60)  # all noise: never counts
    reference = reference_of(grads)
    level = float(torch.stack([x.norm() for x in grads.values()]).norm()) * 2.0**-24
    for threshold in (0.0, 0.01, 0.1, 0.3):

        def fits(k: int, threshold: float = threshold) -> bool:
            for x in grads.values():
                counted = x.abs() >= level
                lost = (counted & ((x * 2.0**k).half() == 0)).sum()
                if float(lost) > threshold * max(int(counted.sum()), 1):
                    return False
            return True

        expected = next((k for k in range(MAX_EXPONENT + 1) if fits(k)), MAX_EXPONENT)
        assert predicted_low(reference, threshold) == expected
    assert not bool(reference.counted["d"].any())


class _ClampedInPlace(torch.nn.Module):
    """A linear layer whose float16 output overflows, clamped in place right after: the
    overflow is found although what follows sees only finite values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.clamp_(-1e4, 1e4)
        return y.float().sum()


def test_an_overflow_hidden_by_a_later_in_place_op_is_found() -> None:
    model = _ClampedInPlace()
    with torch.no_grad():
        model.lin.weight.fill_(300.0)
    result = audit(model, lambda m, x: m(x), [torch.full((2, 4), 100.0)], report=False)
    first = result.first_overflow
    assert first is not None
    assert (first.module, first.phase, first.op, first.intrinsic) == (
        "lin",
        "forward",
        "linear",
        True,
    )
    assert first.amax == pytest.approx(1.2e5, rel=0.01)
    assert result.float32_modules == ("lin",) and result.verified is True


def test_the_float32_reference_runs_without_tf32_on_cuda_and_puts_it_back() -> None:
    from lossscale.torch._audit.state import full_float32

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    try:
        matmul.allow_tf32, cudnn.allow_tf32 = True, True
        with pytest.raises(RuntimeError), full_float32(torch.device("cuda")):
            assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, False)
            raise RuntimeError("the loss function failed")
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (True, True)
        with full_float32(torch.device("cpu")):  # nothing to do off CUDA
            assert (matmul.allow_tf32, cudnn.allow_tf32) == (True, True)
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def test_the_objects_alive_before_are_frozen_for_the_collector_during_the_audit() -> None:
    import gc

    frozen: list[int] = []

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        frozen.append(gc.get_freeze_count())
        return m(x).float().sum()

    model = torch.nn.Linear(4, 4)
    assert gc.get_freeze_count() == 0
    audit(model, loss_fn, [torch.ones(2, 4)], report=False)
    assert frozen and min(frozen) > 0 and gc.get_freeze_count() == 0
    gc.disable()  # a collector switched off is left alone
    try:
        frozen.clear()
        audit(model, loss_fn, [torch.ones(2, 4)], report=False)
        assert frozen and max(frozen) == 0 and not gc.isenabled()
    finally:
        gc.enable()


def test_a_batch_float32_does_not_compute_is_refused_and_the_model_left_as_it_was() -> None:
    """The float32 losses are read with the first float16 forward: a non-finite one is still
    a ValueError naming its batch, and the model is as it was."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [torch.ones(2, 4), torch.full((2, 4), 1e38)]  # float32's square overflows

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (m(x).float() * x.sum()).pow(2).sum()

    with pytest.raises(ValueError, match=r"non-finite loss in float32 on batch 1 \(inf\)"):
        audit(model, loss_fn, batches, report=False)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def _keep(module: Any, args: Any, out: Any, *, into: dict[str, torch.Tensor], name: str) -> None:
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        into[f"forward:{name}"] = out.detach()


def test_the_report_rows_are_those_of_a_report_recorded_from_the_float32_pass() -> None:
    """The rows are counted during the float32 pass and read with the first float16 forward
    (no read of their own): the same rows as ``Report.record`` of that pass's leaf outputs
    and gradients, in the same order."""
    from lossscale.numerics import Report

    model = models.llama(2, width=64, heads=4)
    listed = models.batches(2, shape=(4, 12))
    result = audit(model, models.token_sum_loss, listed, verify=False)
    expected = Report()
    leaves = [(n, m) for n, m in model.named_modules() if not any(m.children())]
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for step, ids in enumerate(listed):
        seen: dict[str, torch.Tensor] = {}

        hooks = [
            m.register_forward_hook(functools.partial(_keep, into=seen, name=n)) for n, m in leaves
        ]
        try:
            loss = models.token_sum_loss(model, ids)
        finally:
            for h in hooks:
                h.remove()
        grads = torch.autograd.grad(loss, [p for _, p in params])
        ref = {n: g for (n, _), g in zip(params, grads, strict=True)}
        expected.record(step, {**seen, **ref})
    assert result.report is not None and len(result.report.rows) == 88
    assert result.report.rows == expected.rows
    assert result.report.exponents == expected.exponents
