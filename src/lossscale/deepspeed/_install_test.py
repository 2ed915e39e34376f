"""``install`` misused, and ``NumericsMonitor`` on DeepSpeed engines: real engines (deepspeed
0.19.8, CPU, gloo) in spawned processes, as in :mod:`lossscale.deepspeed._engine_test`.

* A second ``install`` on one engine returns the scaler in place (its state kept: on ZeRO 0 the
  hysteresis allowance already spent) or, with other keywords, refuses and changes nothing.
* Things that are not an engine (a module, an optimizer, the tuple ``deepspeed.initialize``
  returns) get a TypeError that names them and says what to pass.
* DeepSpeed's version is checked against the supported ones.
* ``NumericsMonitor`` accepts the installed scaler and DeepSpeed's own, warns on ZeRO 2 where
  ``.grad`` is None, and reads the partitioned gradients through ``engine_gradients``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lossscale._testing import gloo_job_once
from lossscale.deepspeed._testing import build, config, prepare_cpu, train

#: W=100 (no growth), H=2 with DeepSpeed's refill on growth: the first overflow is absorbed,
#: the second backs off (the allowance stays spent).
RULE = {"initial_scale_power": 8, "loss_scale_window": 100, "hysteresis": 2}


def _twice(stage: int, path: str, **fp16: Any) -> dict[str, Any]:
    """Install, overflow once, install again (same keywords, then others), overflow again."""
    from lossscale.deepspeed import install

    engine, sched = build(config(stage, path, **fp16))
    first = install(engine, min_loss_scale=0.25)
    out: dict[str, Any] = {"first": train(engine, sched, "L", first)["scale"]}
    again = install(engine, min_loss_scale=0.25)
    out["same"] = again is first
    try:
        install(engine, min_loss_scale=0.5)
        out["refused"] = ""
    except ValueError as error:
        out["refused"] = str(error)
    out["still"] = install(engine, min_loss_scale=0.25) is first
    out["then"] = train(engine, sched, "L.", first)["scale"]
    return out


def _misuse() -> dict[str, str]:
    """install's TypeErrors for things that are not an engine, and the version check."""
    import deepspeed

    from lossscale.deepspeed import engine_gradients, install

    out: dict[str, str] = {}
    net = torch.nn.Linear(4, 2)
    returned = deepspeed.initialize(
        model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config=config(1, "fp16")
    )
    engine = returned[0]
    cases = {
        "linear": torch.nn.Linear(2, 2),
        "optimizer": torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
        "tuple": returned,
        "zero_optimizer": engine.optimizer,
    }
    for name, thing in cases.items():
        try:
            install(thing)
            out[name] = ""
        except TypeError as error:
            out[name] = str(error)
    try:
        engine_gradients(returned)
        out["gradients_tuple"] = ""
    except TypeError as error:
        out["gradients_tuple"] = str(error)
    before, version = engine.optimizer.loss_scaler, deepspeed.__version__
    deepspeed.__version__ = "0.18.4"
    try:
        install(engine)
        out["old"] = ""
    except RuntimeError as error:
        out["old"] = str(error)
    deepspeed.__version__ = "0.21.0"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            install(engine)
        out["new"] = "; ".join(str(w.message) for w in caught if w.category is UserWarning)
    finally:
        deepspeed.__version__ = version
    out["old_left_engine"] = str(before is not None)
    return out


def _rows(monitor: Any) -> list[tuple[Any, ...]]:
    return [
        (r.tensor, r.underflow, r.subnormal, r.overflow, r.zeros, r.nonfinite, r.amax, r.loss_scale)
        for r in monitor.report.rows
    ]


def _monitor(stage: int) -> dict[str, Any]:
    """NumericsMonitor after one backward pass: DeepSpeed's own scaler, then the installed
    one; ``.grad`` and ``engine_gradients``."""
    from lossscale.deepspeed import engine_gradients, install
    from lossscale.torch import NumericsMonitor, NumericsNoGradientsWarning

    engine, _ = build(config(stage, "fp16", initial_scale_power=12))
    # DeepSpeed's own scaler: the ZeRO optimizers' slot (ZeRO 0's optimizers have none)
    own = NumericsMonitor(engine.module, getattr(engine.optimizer, "loss_scaler", None), every=1)
    scaler = install(engine)
    plain = NumericsMonitor(engine.module, scaler, every=1)
    read = NumericsMonitor(engine.module, scaler, every=1, gradients=engine_gradients(engine))
    torch.manual_seed(1)
    x = torch.randn(2, 4).to(next(engine.module.parameters()).dtype)
    engine.backward(engine(x).float().pow(2).mean() * 1e-6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampled = [own.record(), plain.record(), read.record()]
    engine.step()
    said = [str(w.message) for w in caught if w.category is NumericsNoGradientsWarning]
    return {
        "sampled": sampled,
        "own": _rows(own),
        "plain": _rows(plain),
        "read": _rows(read),
        "warned": said,
        "scale": scaler.cur_scale,
    }


def _fp16_job(rank: int, world: int) -> dict[Any, Any]:
    del rank, world
    prepare_cpu()
    out: dict[Any, Any] = {}
    for stage in (0, 2):
        out["twice", stage] = _twice(stage, "fp16", **RULE)
    out["misuse"] = _misuse()
    for stage in (0, 1, 2):
        out["monitor", stage] = _monitor(stage)
    return out


def _autocast_job(rank: int, world: int) -> dict[Any, Any]:
    del rank, world
    prepare_cpu()
    return {"twice": _twice(0, "autocast")}


@pytest.fixture(scope="module")
def fp16(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return gloo_job_once(_fp16_job, 2, 600, tmp_path_factory)


@pytest.fixture(scope="module")
def autocast(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    return dict(gloo_job_once(_autocast_job, 1, 600, tmp_path_factory)[0])


@pytest.mark.parametrize("stage", [0, 2])
def test_a_second_install_returns_the_scaler_in_place(
    fp16: list[dict[Any, Any]], stage: int
) -> None:
    for rank in fp16:
        twice = rank["twice", stage]
        assert twice["first"] == [256.0]  # the first overflow is absorbed (hysteresis 2)
        assert twice["same"] and twice["still"]
        # nothing forgotten: the allowance stays spent, the next overflow backs off
        assert twice["then"] == [128.0, 128.0]


@pytest.mark.parametrize("stage", [0, 2])
def test_a_second_install_with_other_keywords_is_refused(
    fp16: list[dict[Any, Any]], stage: int
) -> None:
    refused = fp16[0]["twice", stage]["refused"]
    assert "already holds the scaler installed with install(engine, **{" in refused
    assert "'min_loss_scale': 0.25" in refused and "'min_loss_scale': 0.5" in refused


def test_the_autocast_zero0_grad_scaler_is_returned_again(autocast: dict[Any, Any]) -> None:
    twice = autocast["twice"]
    assert twice["first"] == [32768.0]  # torch's defaults: back off at once
    assert twice["same"] and twice["still"] and "already holds" in twice["refused"]
    assert twice["then"] == [16384.0, 16384.0]


def test_what_is_not_an_engine_is_named(fp16: list[dict[Any, Any]]) -> None:
    misuse = fp16[0]["misuse"]
    assert (
        "got a tuple of 4 items, what deepspeed.initialize returns: unpack it" in (misuse["tuple"])
    )
    assert "engine_gradients(engine) got a tuple" in misuse["gradients_tuple"]
    for name, kind in (
        ("linear", "torch.nn.modules.linear.Linear"),
        ("optimizer", "torch.optim.sgd.SGD"),
        ("zero_optimizer", "DeepSpeedZeroOptimizer"),
    ):
        assert (
            "install(engine) needs the DeepSpeed engine that deepspeed.initialize" in (misuse[name])
        )
        assert kind in misuse[name], misuse[name]


def test_the_deepspeed_version_is_checked(fp16: list[dict[Any, Any]]) -> None:
    misuse = fp16[0]["misuse"]
    assert (
        "supports DeepSpeed 0.19.8 and later 0.19.x releases; this is DeepSpeed 0.18.4"
        in (misuse["old"])
    )
    assert "was not tested with DeepSpeed 0.21.0" in misuse["new"]


def test_check_deepspeed_version_reads_versions() -> None:
    from lossscale.deepspeed._install import check_deepspeed_version

    for ok in ("0.19.8", "0.19.12", "0.19.8+cpu"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_deepspeed_version(ok)
    for old in ("0.19.7", "0.9.99", "dev"):
        with pytest.raises(RuntimeError, match=r'pip install "deepspeed>=0.19.8,<0.20"'):
            check_deepspeed_version(old)
    with pytest.warns(UserWarning, match="0.20.0"):
        check_deepspeed_version("0.20.0")


def test_the_monitor_reads_the_engines_scalers(fp16: list[dict[Any, Any]]) -> None:
    for rank in fp16:
        zero0 = rank["monitor", 0]
        assert zero0["sampled"] == [True, True, True] and zero0["warned"] == []
        assert zero0["plain"] and zero0["plain"] == zero0["read"]  # .grad: engine_gradients
        assert {row[-1] for row in zero0["plain"]} == {4096.0} == {zero0["scale"]}
        assert {row[-1] for row in zero0["own"]} == {1.0}  # no scaler given: scale 1
        for stage in (1, 2):
            # DeepSpeed's own scaler (before install) and the installed one: the same scale
            assert {row[-1] for row in rank["monitor", stage]["read"]} == {4096.0}


@pytest.mark.parametrize("stage", [1, 2])
def test_the_monitor_says_why_zero_has_no_grad_and_reads_the_partitions(
    fp16: list[dict[Any, Any]], stage: int
) -> None:
    for rank in fp16:
        zero = rank["monitor", stage]
        assert zero["own"] == [] and zero["plain"] == []  # .grad is None on ZeRO 1 and 2
        assert len(zero["warned"]) == 2  # said, for both monitors that read .grad
        assert all("DeepSpeed's ZeRO optimizers (stages 1-3)" in w for w in zero["warned"])
        # read where the engine keeps them: the same counts as ZeRO 0's .grad
        assert zero["read"] == rank["monitor", 0]["read"]
        assert any(row[1] > 0 or row[4] > 0 for row in zero["read"])  # the tiny loss shows
