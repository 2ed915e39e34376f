"""``lossscale.torch.audit`` on Hugging Face models built from a config, each with weights set
to fail in float16 one way (``lossscale.torch._audit._testing``), side by side with plain float16
runs of the same models: the first finding, the plan, its 1-minimality, the fix verified by
running, the loss-scale range and a ``GradScaler`` started from ``initial_scale``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lossscale._testing import one_torch_thread
from lossscale.torch import Float16Audit, GradScaler, audit
from lossscale.torch._audit import _testing as models
from lossscale.torch._audit.plan import keep_float32

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


def _reads(layers: int, batches: int = 1) -> tuple[int, Float16Audit]:
    model = models.llama(layers, width=64, heads=4)
    listed = models.batches(batches, shape=(4, 12))
    with models.HostReads() as reads:
        result = audit(model, models.token_sum_loss, listed, report=False)
    return reads.count, result


def test_host_reads_do_not_grow_with_the_model() -> None:
    """A clean audit reads the device once per batch and pass: one read after the float16
    forward serves the float32 losses, the forward's maxima, its backward's and the underflow
    count at scale 1; one for the verification. 2 for 2 layers as for 8 (the bound: 8 layers
    at most 1.25x 2 layers' + 4), 6 for three batches."""
    two, small = _reads(2)
    eight, large = _reads(8)
    assert small.scale_range is not None and large.scale_range is not None
    assert small.float32_modules == large.float32_modules == ()
    assert two == eight == 2
    assert eight <= 1.25 * two + 4
    three_batches, result = _reads(2, batches=3)
    assert three_batches == 6 and result.batches == 3 and result.scale_range is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_syncs_do_not_grow_with_the_model() -> None:
    """On CUDA, counted by torch's sync debug mode (every sync, the batch's copy to the device
    inside ``loss_fn`` and the RNG state's read included): 8 layers at most 1.25x 2 layers'
    syncs + 4, as the host reads on the CPU."""
    counts = {}
    for layers in (2, 8):
        model = models.llama(layers, width=64, heads=4).cuda()
        batch = models.batches(1, shape=(4, 12))
        with models.CudaSyncs() as syncs:
            result = audit(model, models.token_sum_loss, batch, report=False)
        assert result.scale_range is not None and result.float32_modules == ()
        counts[layers] = syncs.count
    assert 0 < counts[8] <= 1.25 * counts[2] + 4, counts


def test_host_reads_are_counted() -> None:
    """The counter sees each kind of read (so that a count of 5 means 5)."""
    x = torch.tensor([1.0, -2.0, 3.0])
    with models.HostReads() as reads:
        x.sum().item()
        bool(x[0] > 0)
        float(x[1])
        x.tolist()
        x.numpy()
        x.cpu()
        x.nonzero()
        x[x > 0]
        x.masked_select(x > 0)
        x.unique()
    assert reads.count == 10, reads.by_kind


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


def test_the_largest_magnitudes_are_grouped_by_dtype_and_keep_inf_and_nan() -> None:
    """The GPU path of the magnitudes (one launch per dtype), run on CPU tensors."""
    from lossscale.torch._audit.ops import grouped_norms, magnitudes

    tensors = [
        torch.tensor([1.0, -3.0, math.nan]).half(),
        torch.tensor([2.0, -5.0]),
        torch.tensor([-7.0, 1.0]).half(),
        torch.tensor([-math.inf, 1.0]),
    ]
    for sizes in (grouped_norms(tensors), magnitudes(tensors)):
        got = [float(x) for x in sizes]
        assert math.isnan(got[0]) and got[1:] == [5.0, 7.0, math.inf]
    assert [float(x) for x in grouped_norms(tensors[1:2])] == [5.0]


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


class _GivesFloat16Anyway(torch.autograd.Function):
    """``2 * a``, whose backward also gives ``b`` (which needs none) a float16 gradient and
    gives ``a`` one in float16 (which torch casts to ``a``'s dtype)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (g * 2).half(), g.half() * 3


class _Odd(torch.nn.Module):
    """Gradients in float16 where no input's dtype says so: a custom function's for an input
    that needs none, and a float32 leaf's whose ``grad_dtype`` is float16."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.w = torch.nn.Parameter(torch.linspace(0.5, 2.0, 4))
        if hasattr(self.w, "grad_dtype"):
            self.w.grad_dtype = torch.float16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _GivesFloat16Anyway.apply(self.lin(x).float(), x.half())
        return (h.float() * self.w).sum() + (self.w * 3).sum()


def _records(model: Any, loss_fn: Any, batch: Any, autocast: bool) -> list[Any]:
    from lossscale.torch._audit.watch import watched_forward

    def run() -> torch.Tensor:
        with torch.autocast("cpu", torch.float16, enabled=autocast):
            return loss_fn(model, batch)  # type: ignore[no-any-return]

    params = [p for p in model.parameters() if p.requires_grad]
    watch, loss, *_ = watched_forward(model, autocast, run)
    _, nodes = watch.backward(loss, params, 1.0)
    return [
        (node.name(), watch.owner.get(node), slots, repr(produced), repr(received), down)
        for node, slots, produced, received, down in nodes
    ]


@pytest.mark.parametrize("case", ["llama", "half llama", "backward failure", "odd"])
def test_hooks_only_where_a_float16_gradient_may_come_give_the_same_records(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node is hooked only where ``may_give_float16`` says a float16 gradient may come
    from it: the backward's node records are those of a hook on every node that computes."""
    from lossscale.torch._audit import watch

    model, loss_fn, autocast = {
        "llama": lambda: (models.llama(), models.token_sum_loss, True),
        "half llama": lambda: (models.llama().half(), models.token_sum_loss, False),
        "backward failure": lambda: (
            models.backward_failure(models.qwen3()),
            models.token_sum_loss,
            True,
        ),
        "odd": lambda: (_Odd(), lambda m, x: m(x), True),
    }[case]()
    batch = torch.linspace(-1, 1, 8).reshape(2, 4) if case == "odd" else BATCHES[0]
    hooked: list[bool] = []
    may = watch.may_give_float16
    monkeypatch.setattr(watch, "may_give_float16", lambda e: hooked.append(may(e)) or hooked[-1])
    ours = _records(model, loss_fn, batch, autocast)
    monkeypatch.setattr(watch, "may_give_float16", lambda e: True)
    every = _records(model, loss_fn, batch, autocast)
    assert ours == every and ours
    assert not all(hooked)  # some node is left without a hook
    if case == "odd":
        names = [r[0] for r in ours]
        assert "_GivesFloat16AnywayBackward" in names
        if hasattr(model.w, "grad_dtype"):
            assert "MulBackward0" in names  # the float16 gradient of the float32 leaf


@pytest.mark.parametrize("foreach", [True, False])
def test_the_magnitudes_on_the_cpu_keep_inf_and_nan_and_record_no_graph(
    foreach: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU path of the magnitudes, with and without ``torch._foreach_max``: mixed dtypes,
    NaN, inf, and results that need a gradient (no graph recorded)."""
    from lossscale.torch._audit import ops

    monkeypatch.setattr(ops, "_FOREACH_MAX", foreach and hasattr(torch, "_foreach_max"))
    w = torch.tensor([2.0, -5.0], requires_grad=True)
    tensors = [
        torch.tensor([1.0, -3.0, math.nan]).half(),
        w * 1,
        torch.tensor([-7.0, 1.0]).half(),
        torch.tensor([-math.inf, 1.0]),
        torch.tensor([[65504.0, -65504.0]]).half(),
    ]
    sizes = ops.magnitudes(tensors)
    got = [float(x) for x in sizes]
    assert math.isnan(got[0]) and got[1:] == [5.0, 7.0, math.inf, 65504.0]
    assert [x.dtype for x in sizes] == [t.dtype for t in tensors]
    assert not any(x.requires_grad for x in sizes)


class _SumOverflows(torch.nn.Module):
    """In float16: ``h`` feeds two products whose gradients are finite (40000 each) and sum
    to inf in ``h``'s gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).view(2, 2, 2)
        return ((h * 40000.0).float().sum() + (h * 40000.0).float().sum()) * 1.0


@pytest.mark.parametrize(
    "case", ["backward failure", "half llama at 2**14", "half llama at 2**15", "sum overflows"]
)
def test_what_the_nodes_received_is_known_from_what_fed_them(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a node that produced a non-finite float16 gradient received finite ones, known
    from the gradients the nodes feeding it produced: as read from what it received, and the
    backward overflows the same; the backward runs again only where a sum of finite gradients
    may overflow."""
    from lossscale.torch._audit import backward
    from lossscale.torch._audit.watch import read_all, watched_forward

    model, autocast, scale = {
        "backward failure": lambda: (models.backward_failure(models.qwen3()), True, 1.0),
        "half llama at 2**14": lambda: (models.llama().half(), False, 2.0**14),
        "half llama at 2**15": lambda: (models.llama().half(), False, 2.0**15),
        "sum overflows": lambda: (_SumOverflows().half(), False, 1.0),
    }[case]()
    batch = torch.ones(2, 4).half() if case == "sum overflows" else BATCHES[0]
    loss_fn = (lambda m, x: m(x)) if case == "sum overflows" else models.token_sum_loss

    def run() -> torch.Tensor:
        with torch.autocast("cpu", torch.float16, enabled=autocast):
            return loss_fn(model, batch)  # type: ignore[no-any-return]

    params = [p for p in model.parameters() if p.requires_grad]
    watch, loss, *_ = watched_forward(model, autocast, run)
    again: list[bool] = []
    start = backward.BackwardWatch.start_backward

    def counted(self: Any, *args: Any, received: bool = False) -> Any:
        again.append(received)
        return start(self, *args, received=received)

    monkeypatch.setattr(backward.BackwardWatch, "start_backward", counted)
    _, ours = watch.backward(loss, params, scale)
    ran_again = again.count(True)
    started = watch.start_backward(loss, params, scale, received=True)
    _, read = watch.finish_backward(started, read_all(started.sizes))
    assert [(r[0], r[1], repr(r[2]), r[4]) for r in ours] == [
        (r[0], r[1], repr(r[2]), r[4]) for r in read
    ]
    asked = [r for r in ours if r[3] is not None and not r[4]]  # told from what fed them
    for r, exact in zip(ours, read, strict=True):
        assert exact[3] is not None
        if r[3] is not None:
            assert r[3] == exact[3], r[0].name()
        else:  # not needed: it produced only finite float16 gradients
            assert all(map(math.isfinite, r[2])) and not r[4]
    assert watch.backward_overflows(ours) == watch.backward_overflows(read)
    if case == "backward failure":
        assert watch.backward_overflows(ours) and asked and not ran_again
    if case == "half llama at 2**14":  # the embedding's gradient: a sum of many
        assert ran_again == 1
        assert [o.op for o in watch.backward_overflows(ours)] == ["EmbeddingBackward0"]
    if case == "half llama at 2**15":
        assert any(r[3] is False for r in asked) and any(r[3] is True for r in asked)
        assert not ran_again
    if case == "sum overflows":
        assert ran_again == 1 and not watch.backward_overflows(ours)
        assert any(r[3] is False for r in ours)
