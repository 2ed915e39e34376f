"""The float16 audit's instruments (``watch``, ``backward``, ``ops``): what it reads of the
device and how often, the magnitudes it keeps, the autograd nodes it hooks and what it knows
of what each received, each against the plain way of getting the same answer."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lossscale._testing import one_torch_thread
from lossscale.torch import Float16Audit, audit
from lossscale.torch._audit import _testing as models

pytest.importorskip("transformers")

BATCHES = models.batches(2)

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


def _reads(layers: int, batches: int = 1) -> tuple[int, Float16Audit]:
    model = models.llama(layers, width=64, heads=4)
    listed = models.batches(batches, shape=(4, 12))
    with models.HostReads() as reads:
        result = audit(model, models.token_sum_loss, listed, report=False)
    return reads.count, result


def test_host_reads_do_not_grow_with_the_model() -> None:
    """A clean audit reads the device once per batch and pass: one read after the float16
    forward serves the float32 losses, the forward's maxima, its backward's and the underflow
    count at scale 1; one for the verification of every batch. 2 for 2 layers as for 8 (the
    bound: 8 layers at most 1.25x 2 layers' + 4), 4 for three batches."""
    two, small = _reads(2)
    eight, large = _reads(8)
    assert small.scale_range is not None and large.scale_range is not None
    assert small.float32_modules == large.float32_modules == ()
    assert two == eight == 2
    assert eight <= 1.25 * two + 4
    three_batches, result = _reads(2, batches=3)
    assert three_batches == 4 and result.batches == 3 and result.scale_range is not None


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


def test_values_and_integer_rows_are_read_in_one_transfer_exactly() -> None:
    from lossscale.torch._audit.ops import exact_ints, ints_of, read_all

    big = [2**62 + 12345, 2**53 + 1, 0, 7, 2**31 - 1]
    row = torch.tensor(big, dtype=torch.int64)
    values = [torch.tensor(1.5), exact_ints(row), torch.tensor(3, dtype=torch.int32)]
    values.append(torch.tensor(65504.0, dtype=torch.float16))
    with models.HostReads() as reads:
        got = read_all(values)
    assert reads.count == 1
    assert got[0] == 1.5 and got[-2:] == [3.0, 65504.0]
    assert ints_of(got[1:-2]) == big


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


def test_a_backward_is_queued_ahead_only_where_the_forward_should_be_clean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backward queued before the forward's read is dropped when that forward overflows:
    only on the first pass (nothing is known yet), not on the pruning trials that bring an
    overflow back (the plan lacks a module that fixed it)."""
    from lossscale.torch._audit.backward import BackwardWatch

    started, finished = [0], [0]
    start, finish = BackwardWatch.start_backward, BackwardWatch.finish_backward

    def counted_start(self: Any, *args: Any, **kwargs: Any) -> Any:
        started[0] += 1
        return start(self, *args, **kwargs)

    def counted_finish(self: Any, *args: Any, **kwargs: Any) -> Any:
        finished[0] += 1
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(BackwardWatch, "start_backward", counted_start)
    monkeypatch.setattr(BackwardWatch, "finish_backward", counted_finish)
    model = models.attention_logits_failure(models.massive_activation_failure(models.llama()))
    result = audit(model, models.token_sum_loss, BATCHES, report=False, verify=False)
    assert len(result.float32_modules) == 2  # two pruning trials, each brings an overflow back
    dropped = started[0] - finished[0]
    assert dropped == len(BATCHES)  # the first pass's, one per batch
