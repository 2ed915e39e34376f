"""lossscale's own part of a step compiles with fullgraph=True (no graph break, no host sync).

A whole train step cannot (torch 2.13 graph-breaks inside every torch.optim step; see
_end_to_end_test.py), but everything lossscale adds around it — unscale + check and the
scale rule — traces into one graph.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lossscale.core import (  # noqa: E402
    dynamic_rule,
    dynamic_state,
    dynamic_update,
    namespace_of,
)
from lossscale.torch import LossScaleOptimizer  # noqa: E402


@pytest.fixture
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_dynamic_update_compiles_fullgraph_and_matches_eager(fresh_dynamo: Any) -> None:
    xp = namespace_of(torch.ones(()))
    rule = dynamic_rule(increment_period=2, multiplier=3.0)

    def step(state: Any, finite: Any) -> Any:
        return dynamic_update(state, finite, rule, xp)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    eager_state = compiled_state = dynamic_state(10.0, rule, xp=xp)
    for finite in (True, False, True, True, False, False, True):
        flag = torch.tensor(finite)
        eager_state = step(eager_state, flag)
        compiled_state = compiled(compiled_state, flag)
        for a, b in zip(eager_state, compiled_state, strict=True):
            assert torch.equal(a, b)
    assert float(compiled_state.loss_scale) == pytest.approx(10 / 3 / 3, rel=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_unscale_and_check_compile_fullgraph(fused: bool, fresh_dynamo: Any) -> None:
    model = torch.nn.Linear(4, 3)
    lso = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, fused=fused), initial_scale=8.0
    )
    model(torch.ones(2, 4)).sum().mul(8.0).backward()
    expected = [p.grad / 8.0 for p in model.parameters()]

    def unscale_and_check() -> Any:
        return lso._step.check(unscale=True)

    found = torch.compile(unscale_and_check, fullgraph=True, backend="eager")()
    assert float(found) == 0.0
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p.grad, e)
    model.weight.grad[0, 0] = float("inf")
    found = torch.compile(unscale_and_check, fullgraph=True, backend="eager")()
    assert float(found) == 1.0
