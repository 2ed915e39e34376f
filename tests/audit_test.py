"""The float16 audit on the numerics benchmark's transformer (``benchmarks.numerics_bench``:
the model docs/numerics.md trains, with biases, in float16), with its rows in a ``Report`` of
the user's: the JSON lines log and the heatmap show the forward activations."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from benchmarks.numerics_bench import TinyTransformer, batch  # noqa: E402

from lossscale._testing import one_torch_thread  # noqa: E402
from lossscale.numerics import Report, heatmap  # noqa: E402
from lossscale.torch import audit  # noqa: E402

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


def loss_fn(model: torch.nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = xy
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _finite(model: torch.nn.Module, xy: tuple[torch.Tensor, torch.Tensor], scale: float) -> bool:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model, xy)
    grads = torch.autograd.grad(loss * scale, list(model.parameters()), allow_unused=True)
    return bool(torch.isfinite(loss)) and all(
        bool(torch.isfinite(g).all()) for g in grads if g is not None
    )


def test_the_numerics_pages_transformer_needs_no_float32_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    batches = [batch(), batch()]
    log = tmp_path / "audit.jsonl"
    result = audit(model, loss_fn, batches, report=Report(("float16", "float8_e4m3fn"), path=log))
    assert result.float32_modules == () and not result.intrinsic and result.verified
    assert result.scale_range is not None
    high = result.scale_range[1]
    assert all(_finite(model, b, high) for b in batches)
    assert not all(_finite(model, b, 2 * high) for b in batches)
    assert result.findings and all(f.scale == 2 * high for f in result.findings)
    # the forward activations are rows of the report, in its log and its heatmap
    report = result.report
    assert report is not None and report.steps == [0, 1]
    forward = [r for r in report.latest() if r.tensor.startswith("forward:")]
    assert {r.tensor for r in forward} >= {"forward:embed", "forward:head"}
    assert all(r.loss_scale == 1.0 and math.isfinite(r.amax) for r in forward)
    report.close()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert {line["format"] for line in lines} == {"float16", "float8_e4m3fn"}
    assert any(line["tensor"] == "forward:head" for line in lines)
    image = tmp_path / "overflow.png"
    heatmap(report, image, field="overflow")
    assert image.read_bytes()[:4] == b"\x89PNG"
