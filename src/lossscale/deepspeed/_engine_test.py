"""lossscale installed in real DeepSpeed engines (deepspeed 0.19.8, CPU, gloo), side by side with
DeepSpeed's own scalers: every ZeRO stage, the ``fp16`` and ``torch_autocast`` paths, one and two
ranks. Each job runs in spawned processes (DeepSpeed's "autocast initialised" is process-wide, so
the ``fp16`` and ``torch_autocast`` runs get a process each); the tests read the recorded runs.

Flags (one letter per step, :mod:`lossscale.deepspeed._testing`): ``.`` finite, ``L`` an
infinite loss, ``R`` an infinite loss on rank 0 only, ``B`` an infinite gradient of the last bias.
DeepSpeed's CPU accelerator refuses the ``fp16`` path on a CPU without float16 instructions
(AVX512-FP16 or AMX); the jobs lift that with the test helpers' switch
(:func:`lossscale.deepspeed._testing.allow_fp16_on_cpu`), so every test runs on every CPU, and
one job runs as on such a CPU (oneDNN limited to AVX2) to show it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lossscale._testing import NO_FLOAT16_CPU_ENV, gloo_job_once, run_gloo_job
from lossscale.deepspeed._testing import config, model, prepare_cpu, run

STAGES = (0, 1, 2, 3)
#: W=2, H=2, 2**8: growth, absorbed overflows and back-offs within ten steps.
RULE = {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}
FLAGS = "..L.LL...."


def _fp16_job(rank: int, world: int) -> dict[Any, Any]:
    del rank, world
    prepare_cpu()
    out: dict[Any, Any] = {}
    for stage in STAGES:
        for who, ls in (("deepspeed", None), ("lossscale", {})):
            out["rule", stage, who] = run(stage, "fp16", FLAGS, ls, **RULE)
            # where both rules agree: no growth within the run, hysteresis 1
            agree = {"initial_scale_power": 8, "loss_scale_window": 100, "hysteresis": 1}
            out["agree", stage, who] = run(stage, "fp16", ".L..L..", ls, **agree)
            floor = {"initial_scale_power": 1, "hysteresis": 1, "min_loss_scale": 1}
            alarm = None if ls is None else {"stall_steps": 3}
            out["floor", stage, who] = run(stage, "fp16", "LLLLLL", alarm, **floor)
            out["static", stage, who] = run(stage, "fp16", ".L..", ls, loss_scale=128)
        out["raise", stage] = run(stage, "fp16", "LLLLLL", {"stall_steps": 3, "on_stall": "raise"},
                                  initial_scale_power=1, hysteresis=1)  # fmt: skip
        out["floor_below_one", stage] = run(
            stage, "fp16", "LLLLL", {"min_loss_scale": 0.25}, initial_scale_power=1, hysteresis=1
        )
    for who, ls in (("deepspeed", None), ("lossscale", {})):
        out["growth", who] = run(2, "fp16", "......", ls, initial_scale_power=4,
                                 loss_scale_window=3, hysteresis=1)  # fmt: skip
        out["consecutive", who] = run(2, "fp16", "L.L.LL.LLL", ls, initial_scale_power=8,
                                      loss_scale_window=100, hysteresis=2,
                                      consecutive_hysteresis=True)  # fmt: skip
    for stage in STAGES:  # docs/deepspeed.md's run: overflows in a row from 2**4, hysteresis 1
        out["from16", stage] = run(stage, "fp16", "LLLLLL", None, initial_scale_power=4,
                                   hysteresis=1)  # fmt: skip
    for name in ("sgd", "adamw"):
        for stage in (0, 1):
            out["first_update", name, stage] = _first_updates(stage, name)
    for who, ls in (("deepspeed", None), ("lossscale", {})):  # ZeRO 0's FP16_Optimizer
        out["fused", who] = run(0, "fp16", FLAGS, ls, optimizer="fused", **RULE)
        alarm = None if ls is None else {"stall_steps": 3}
        out["fused_floor", who] = run(0, "fp16", "LLLLLL", alarm, optimizer="fused",
                                      initial_scale_power=1, hysteresis=1)  # fmt: skip
    return out


def _first_updates(stage: int, optimizer: str) -> dict[str, Any]:
    """lossscale installed, three finite steps: the torch optimizer's step counts when the
    engine is built and after, the float32 weights' first update, and the last weights."""
    from lossscale.deepspeed import install
    from lossscale.deepspeed._testing import build, master_weights, optimizer_steps, train

    cfg = config(stage, "fp16", initial_scale_power=8, loss_scale_window=100, hysteresis=1)
    engine, sched = build(cfg, optimizer=optimizer)
    built = optimizer_steps(engine)
    before = master_weights(engine)
    scaler = install(engine)
    train(engine, sched, ".", scaler)
    first = master_weights(engine) - before
    last = train(engine, sched, "..", scaler)
    return {"built": built, "after": optimizer_steps(engine), "first": first, "last": last}


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    return dict(gloo_job_once(_fp16_job, 1, 600, tmp_path_factory)[0])


def run_start_weights() -> list[torch.Tensor]:
    """The weights every run starts from (``build``'s seed 0)."""
    return [p.detach().float() for p in model(0).parameters()]


def equal_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        torch.equal(x, y) for wa, wb in zip(a["weights"], b["weights"], strict=True)
        for x, y in zip(wa, wb, strict=True)
    )  # fmt: skip


# -- fp16 ----------------------------------------------------------------------------------


def test_lossscale_rule_on_every_stage(fp16_runs: dict[Any, Any]) -> None:
    """Hysteresis honoured (DeepSpeed's refill on growth), TensorFlow's growth timing, and one
    trajectory and the same weights, bit for bit, on ZeRO 0, 1, 2 and 3."""
    expected = [256, 512, 512, 512, 256, 128, 128, 256, 256, 512]
    first = fp16_runs["rule", 1, "lossscale"]
    for stage in STAGES:
        ours = fp16_runs["rule", stage, "lossscale"]
        assert ours["error"] is None and ours["scale"] == expected
        assert ours["skipped"] == [0, 0, 1, 1, 2, 3, 3, 3, 3, 3]
        assert ours["applied"] == [flag == "." for flag in FLAGS]
        assert ours["last_epoch"] == [1, 2, 2, 3, 3, 3, 4, 5, 6, 7]  # held on skipped steps
        assert equal_weights(ours, first)  # SGD: ZeRO-0's updates are ZeRO-1's


def test_deepspeed_zero0_ignores_hysteresis_and_never_scales_the_loss(
    fp16_runs: dict[Any, Any],
) -> None:
    ds0, ds1 = fp16_runs["rule", 0, "deepspeed"], fp16_runs["rule", 1, "deepspeed"]
    assert ds0["scale"][2] == 128 and ds1["scale"][2] == 256  # ZeRO-0 halves at once
    assert not equal_weights(ds0, ds1)  # ZeRO-0's updates shrunk by the scale
    # the same stage-1 trajectory on ZeRO 2 and 3; growth one step later than lossscale's
    assert ds1["scale"] == [256, 256, 256, 256, 128, 64, 64, 64, 128, 128]
    for stage in (2, 3):
        assert fp16_runs["rule", stage, "deepspeed"]["scale"] == ds1["scale"]


def test_bit_identical_to_deepspeed_where_the_rules_agree(fp16_runs: dict[Any, Any]) -> None:
    for stage in (1, 2, 3):
        ds, ours = fp16_runs["agree", stage, "deepspeed"], fp16_runs["agree", stage, "lossscale"]
        assert ours["scale"] == ds["scale"] == [256, 128, 128, 128, 64, 64, 64]
        assert ours["skipped"] == ds["skipped"] and ours["last_epoch"] == ds["last_epoch"]
        assert equal_weights(ours, ds)
    # ZeRO-0: lossscale's run is ZeRO-1's, bit for bit
    assert equal_weights(fp16_runs["agree", 0, "lossscale"], fp16_runs["agree", 1, "deepspeed"])


def test_the_floor_raises_in_deepspeed_and_warns_once_with_lossscale(
    fp16_runs: dict[Any, Any],
) -> None:
    for stage in (1, 2, 3):
        ds = fp16_runs["floor", stage, "deepspeed"]
        assert "Current loss scale already at minimum" in ds["error"]
    ds0 = fp16_runs["floor", 0, "deepspeed"]  # ZeRO-0: skips forever, silently
    assert ds0["error"] is None and ds0["scale"][-1] == 1 and ds0["warnings"] == []
    for stage in STAGES:
        ours = fp16_runs["floor", stage, "lossscale"]
        assert ours["error"] is None
        assert ours["scale"] == [1.0] * 6 and ours["skipped"] == [1, 2, 3, 4, 5, 6]
        stalls = [w for w in ours["warnings"] if w.startswith("LossScaleStalledWarning")]
        assert len(stalls) == 1 and "the last 3 steps were all skipped" in stalls[0]
        raised = fp16_runs["raise", stage]
        assert raised["error"].startswith("LossScaleStalledError")
        assert "the last 3 steps" in raised["error"] and "(1.0)" in raised["error"]
        assert fp16_runs["floor_below_one", stage]["scale"] == [1.0, 0.5, 0.25, 0.25, 0.25]


def test_deepspeed_raises_at_the_fifth_overflow_in_a_row_from_16(
    fp16_runs: dict[Any, Any],
) -> None:
    """docs/deepspeed.md's count: DeepSpeed's scaler halves 16 -> 8 -> 4 -> 2 -> 1 on the first
    four overflows and raises on the fifth, at its floor of 1 (ZeRO 1-3; ZeRO 0 skips on)."""
    for stage in (1, 2, 3):
        ds = fp16_runs["from16", stage]
        assert ds["scale"] == [8.0, 4.0, 2.0, 1.0], stage  # four steps done, the fifth raised
        assert ds["skipped"] == [1, 2, 3, 4]
        assert "Current loss scale already at minimum" in ds["error"]
    zero0 = fp16_runs["from16", 0]
    assert zero0["error"] is None and zero0["scale"] == [8.0, 4.0, 2.0, 1.0, 1.0, 1.0]


def test_zero0_updates_are_zero1s_for_sgd_not_for_adamw(fp16_runs: dict[Any, Any]) -> None:
    """DeepSpeed's ZeRO-0 fp16 optimizer takes one optimizer step with zero gradients when it is
    built (``initialize_optimizer_states``). SGD's step with a zero gradient changes nothing,
    so ZeRO 0's updates are ZeRO 1's bit for bit; AdamW's counts a step: its step count starts
    one ahead on ZeRO 0, whose first update is then sqrt(1 + b2) / (1 + b1) of ZeRO 1's (Adam's
    bias correction of a second step on the first gradient, about 0.744 with torch's betas)."""
    runs = fp16_runs
    sgd0, sgd1 = runs["first_update", "sgd", 0], runs["first_update", "sgd", 1]
    assert sgd0["built"] == sgd1["built"] == []  # SGD keeps no step count
    assert torch.equal(sgd0["first"], sgd1["first"]) and bool(sgd0["first"].abs().sum() > 0)
    assert equal_weights(sgd0["last"], sgd1["last"])
    adam0, adam1 = runs["first_update", "adamw", 0], runs["first_update", "adamw", 1]
    assert (adam0["built"], adam1["built"]) == ([1], [])  # one step ahead from the start
    assert (adam0["after"], adam1["after"]) == ([4], [3])
    moved = adam1["first"].abs() > 1e-3  # lr 0.01: |update| = lr where the gradient is nonzero
    assert int(moved.sum()) > 10
    ratio = adam0["first"][moved] / adam1["first"][moved]
    b1, b2 = 0.9, 0.999
    expected = (1 + b2) ** 0.5 / (1 + b1)  # 0.7441...
    assert torch.allclose(ratio, torch.full_like(ratio, expected), rtol=1e-3)
    assert not equal_weights(adam0["last"], adam1["last"])


def test_zero0_fp16_optimizer_takes_the_rule_as_the_unfused_one(fp16_runs: dict[Any, Any]) -> None:
    """ZeRO 0 with a ``FusedAdam`` runs DeepSpeed's ``FP16_Optimizer`` (here its stand-in of
    ``FusedAdam``'s type, doing SGD; the real kernel on CUDA in ``_cuda_test.py``): lossscale's
    trajectory, decisions and weights are those of the unfused optimizer; DeepSpeed's own rule
    there ignores hysteresis and skips on forever at its floor, as the unfused one."""
    ours, theirs = fp16_runs["fused", "lossscale"], fp16_runs["fused", "deepspeed"]
    assert ours["optimizer"] == theirs["optimizer"] == "FP16_Optimizer"
    unfused = fp16_runs["rule", 0, "lossscale"]
    assert unfused["optimizer"] == "FP16_UnfusedOptimizer"
    assert ours["scale"] == unfused["scale"] == [256, 512, 512, 512, 256, 128, 128, 256, 256, 512]
    assert ours["skipped"] == unfused["skipped"] and ours["applied"] == unfused["applied"]
    assert equal_weights(ours, unfused)
    assert theirs["scale"] == fp16_runs["rule", 0, "deepspeed"]["scale"]
    assert theirs["scale"][2] == 128  # hysteresis 2 ignored: halved at the first overflow
    ds_floor, floor = fp16_runs["fused_floor", "deepspeed"], fp16_runs["fused_floor", "lossscale"]
    assert ds_floor["error"] is None and ds_floor["skipped"] == [1, 2, 3, 4, 5, 6]
    assert ds_floor["warnings"] == []  # silently
    assert floor["error"] is None and floor["scale"] == [1.0] * 6
    stalls = [w for w in floor["warnings"] if w.startswith("LossScaleStalledWarning")]
    assert len(stalls) == 1


def test_static_loss_scale_never_changes_and_skips(fp16_runs: dict[Any, Any]) -> None:
    for stage in STAGES:
        ours = fp16_runs["static", stage, "lossscale"]
        assert ours["scale"] == [128.0] * 4 and ours["applied"] == [True, False, True, True]
        assert equal_weights(ours, fp16_runs["static", 1, "deepspeed"])


def test_growth_timing_differs_from_deepspeed_by_one_step(fp16_runs: dict[Any, Any]) -> None:
    assert fp16_runs["growth", "lossscale"]["scale"] == [16, 16, 32, 32, 32, 64]
    assert fp16_runs["growth", "deepspeed"]["scale"] == [16, 16, 16, 32, 32, 32]


def test_consecutive_hysteresis_is_deepspeeds(fp16_runs: dict[Any, Any]) -> None:
    ds, ours = fp16_runs["consecutive", "deepspeed"], fp16_runs["consecutive", "lossscale"]
    assert ours["scale"] == ds["scale"] == [256, 256, 256, 256, 256, 128, 128, 128, 64, 32]
    assert equal_weights(ours, ds)


def _no_float16_cpu_job(rank: int, world: int) -> dict[Any, Any]:
    """Run as on a CPU without float16 instructions (the test sets NO_FLOAT16_CPU_ENV): DeepSpeed
    refuses fp16 there until the test helpers' switch lifts it; then the fp16 path trains."""
    from lossscale.deepspeed._testing import allow_fp16_on_cpu, build

    del rank, world
    prepare_cpu(allow_fp16=False)
    out: dict[Any, Any] = {"onednn_fp16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())}
    try:
        build(config(2, "fp16"))
        out["refused"] = ""
    except ValueError as error:  # DeepSpeed's own check of the CPU's flags
        out["refused"] = str(error)
    allow_fp16_on_cpu()
    for stage in STAGES:
        out["rule", stage] = run(stage, "fp16", FLAGS, {}, **RULE)
    return out


def test_the_fp16_path_runs_on_a_cpu_without_float16_instructions(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU without AVX512-FP16 or AMX (simulated: oneDNN limited to AVX2) DeepSpeed's CPU
    accelerator refuses fp16; with the switch the engine trains as on any other CPU."""
    for key, value in NO_FLOAT16_CPU_ENV.items():
        monkeypatch.setenv(key, value)  # the spawned rank starts with it
    out = run_gloo_job(_no_float16_cpu_job, 1, 300, tmp_path)[0]
    assert out["onednn_fp16"] is False
    assert "Type fp16 is not supported on your device" in out["refused"]
    for stage in STAGES:
        ours = out["rule", stage]
        assert ours["error"] is None
        assert ours["scale"] == [256, 512, 512, 512, 256, 128, 128, 256, 256, 512]
        assert ours["skipped"] == [0, 0, 1, 1, 2, 3, 3, 3, 3, 3]
        assert equal_weights(ours, out["rule", 1])


# -- torch_autocast float16 ------------------------------------------------------------------


def _autocast_job(rank: int, world: int) -> dict[Any, Any]:
    del rank, world
    prepare_cpu()
    out: dict[Any, Any] = {}
    for stage in STAGES:
        for who, ls in (("deepspeed", None), ("lossscale", {})):
            # DeepSpeed's default clipping: its norm check finds the overflow first
            out["clip", stage, who] = run(stage, "autocast", "LLL..", ls, gradient_clipping=1.0)
            out["plain", stage, who] = run(stage, "autocast", ".L..", ls)
    for who, ls in (("deepspeed", None), ("lossscale", {})):
        out["groups", who] = run(2, "autocast", "B..", ls, groups=2, compute_grad_norm=False)
    out["refused"] = _refusals()
    out["lightning"] = _lightning_callback()
    return out


def _refusals() -> list[str]:
    """install's errors, and the engine left as it was."""
    from lossscale.deepspeed import install
    from lossscale.deepspeed._testing import build

    errors = []
    plain, _ = build(config(2, "autocast") | {"torch_autocast": {"enabled": False}})
    before = plain.optimizer.loss_scaler
    for engine, kwargs in ((plain, {}), (build(config(0, "autocast"))[0], {"dynamic": False})):
        try:
            install(engine, **kwargs)
        except ValueError as error:
            errors.append(str(error))
    errors.append(str(plain.optimizer.loss_scaler is before))
    return errors


def _lightning_callback() -> tuple[str, str, str]:
    """lossscale.deepspeed.lightning.LossScaleCallback on a real engine, as Lightning's
    DeepSpeedStrategy holds it (the strategy itself runs on CUDA only)."""
    from types import SimpleNamespace

    from lossscale.deepspeed._testing import build
    from lossscale.deepspeed.lightning import LossScaleCallback

    engine, _ = build(config(2, "autocast"))
    callback = LossScaleCallback(min_loss_scale=0.5)
    callback.on_train_start(
        SimpleNamespace(strategy=SimpleNamespace(deepspeed_engine=engine)), None
    )
    try:
        LossScaleCallback().on_train_start(SimpleNamespace(strategy=SimpleNamespace()), None)
        refused = ""
    except ValueError as error:
        refused = str(error)
    installed = engine.optimizer.loss_scaler
    return type(installed).__name__, str(installed is callback.scaler), refused


@pytest.fixture(scope="module")
def autocast_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    return dict(gloo_job_once(_autocast_job, 1, 600, tmp_path_factory)[0])


def test_autocast_backs_off_when_the_norm_check_finds_the_overflow(
    autocast_runs: dict[Any, Any],
) -> None:
    for stage in (1, 2, 3):
        ds = autocast_runs["clip", stage, "deepspeed"]
        assert ds["scale"][:3] == [65536.0] * 3  # DeepSpeed's GradScaler is bypassed
    for stage in STAGES:
        ours = autocast_runs["clip", stage, "lossscale"]
        assert ours["scale"] == [32768.0, 16384.0, 8192.0, 8192.0, 8192.0]
        assert ours["skipped"] == [1, 2, 3, 3, 3]
        assert ours["applied"] == [False, False, False, True, True]
        assert ours["last_epoch"] == [0, 0, 0, 1, 2]
        assert equal_weights(ours, autocast_runs["clip", 1, "lossscale"])


def test_autocast_zero0_skips_are_seen_by_the_engine(autocast_runs: dict[Any, Any]) -> None:
    ds, ours = autocast_runs["plain", 0, "deepspeed"], autocast_runs["plain", 0, "lossscale"]
    assert ds["skipped"] == [0, 0, 0, 0] and ds["applied"] == [True] * 4  # the skip is missed
    assert ds["last_epoch"] == [1, 2, 3, 4]  # and the schedule advances on it
    assert ours["skipped"] == [0, 1, 1, 1] and ours["applied"] == [True, False, True, True]
    assert ours["last_epoch"] == [1, 1, 2, 3]
    assert ours["scale"] == ds["scale"] == [65536.0, 32768.0, 32768.0, 32768.0]
    assert equal_weights(ours, ds)  # the same updates: torch's rule where both agree
    for stage in (1, 2, 3):
        assert equal_weights(autocast_runs["plain", stage, "lossscale"], ours)


def test_install_refuses_what_it_cannot_scale_and_leaves_the_engine(
    autocast_runs: dict[Any, Any],
) -> None:
    no_scaling, fixed_on_zero0, unchanged = autocast_runs["refused"]
    assert "trains neither with fp16 nor with torch_autocast in float16" in no_scaling
    assert "dynamic=False" in fixed_on_zero0 and unchanged == "True"


def test_the_lightning_callback_installs_into_the_strategys_engine(
    autocast_runs: dict[Any, Any],
) -> None:
    name, same, refused = autocast_runs["lightning"]
    assert (name, same) == ("DeepSpeedLossScaler", "True")
    assert "has no DeepSpeed engine" in refused


def test_autocast_one_update_per_step_not_per_parameter_group(
    autocast_runs: dict[Any, Any],
) -> None:
    ds, ours = autocast_runs["groups", "deepspeed"], autocast_runs["groups", "lossscale"]
    start = [w.clone() for w in run_start_weights()]
    # DeepSpeed: the weight group was applied, the bias group skipped: a partial step
    weight_moved = [not torch.equal(a, b) for a, b in zip(ds["weights"][0], start, strict=True)]
    assert weight_moved == [True, False, True, False]
    # lossscale: the whole step skipped, the scale backed off once
    assert all(torch.equal(a, b) for a, b in zip(ours["weights"][0], start, strict=True))
    assert ours["scale"][0] == 32768.0 and ours["skipped"] == [1, 1, 1]


# -- two ranks ---------------------------------------------------------------------------------


def _two_rank_job(rank: int, world: int) -> dict[Any, Any]:
    del world
    prepare_cpu()
    out: dict[Any, Any] = {}
    # fp16 runs first: an autocast engine makes later fp16 engines autocast too
    for stage in STAGES:
        out["fp16", stage] = run(stage, "fp16", "R..B..", {}, **RULE)
    for who, ls in (("deepspeed", None), ("lossscale", {})):
        out["autocast", who] = run(2, "autocast", "B.", ls, compute_grad_norm=False)
    out["autocast", 0] = run(0, "autocast", "R.", {})
    out["rank"] = rank
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return [dict(r) for r in gloo_job_once(_two_rank_job, 2, 600, tmp_path_factory)]


def test_fp16_ranks_take_one_decision(two_ranks: list[dict[Any, Any]]) -> None:
    r0, r1 = two_ranks
    for stage in STAGES:
        a, b = r0["fp16", stage], r1["fp16", stage]
        assert a["scale"] == b["scale"] == [256, 256, 512, 512, 512, 1024]
        assert a["skipped"] == b["skipped"] == [1, 1, 1, 2, 2, 2]
        assert equal_weights(a, b)


def test_autocast_ranks_diverge_in_deepspeed_and_agree_with_lossscale(
    two_ranks: list[dict[Any, Any]],
) -> None:
    r0, r1 = two_ranks
    ds0, ds1 = r0["autocast", "deepspeed"], r1["autocast", "deepspeed"]
    # only the last rank holds the bad bias: it skips its partition and backs off alone, the
    # other applies its own (a partial step), and the engine counts no skip on either
    assert (ds0["scale"][0], ds1["scale"][0]) == (65536.0, 32768.0)
    assert ds0["skipped"] == ds1["skipped"] == [0, 0] and ds0["applied"][0]
    start = run_start_weights()
    assert not all(torch.equal(a, b) for a, b in zip(ds0["weights"][0], start, strict=True))
    ls0, ls1 = r0["autocast", "lossscale"], r1["autocast", "lossscale"]
    assert ls0["scale"] == ls1["scale"] == [32768.0, 32768.0]
    assert ls0["skipped"] == ls1["skipped"] == [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(ls0["weights"][0], start, strict=True))
    assert equal_weights(ls0, ls1)
    z0, z1 = r0["autocast", 0], r1["autocast", 0]
    assert z0["scale"] == z1["scale"] == [32768.0, 32768.0] and z0["skipped"] == z1["skipped"]
    assert equal_weights(z0, z1)


# -- checkpoints: resume bit for bit, DeepSpeed's state converted, weights_only loads -----------

BEFORE, AFTER = "..L.L", "...L.."
CKPT_CASES = [("lossscale", s, "fp16") for s in STAGES] + [
    ("deepspeed", 0, "fp16"),
    ("deepspeed", 2, "fp16"),
    ("lossscale", 2, "autocast"),
    ("deepspeed", 2, "autocast"),
]


def _ckpt_config(stage: int, path: str) -> dict[str, Any]:
    # autocast: without the norm check, so that DeepSpeed's own GradScaler sees the overflows
    extra = RULE if path == "fp16" else {"compute_grad_norm": False}
    return config(stage, path, **extra)


def _save_job(rank: int, world: int, root: str) -> dict[Any, Any]:
    from lossscale.deepspeed import install
    from lossscale.deepspeed._testing import build, train

    del rank, world
    prepare_cpu()
    out: dict[Any, Any] = {}
    for who, stage, path in CKPT_CASES:  # fp16 first, autocast last (process-wide autocast)
        engine, sched = build(_ckpt_config(stage, path))
        scaler = install(engine) if who == "lossscale" else None
        out["before", who, stage, path] = train(engine, sched, BEFORE, scaler)
        engine.save_checkpoint(f"{root}/{who}-{stage}-{path}", tag="t")
        out["state", who, stage, path] = (
            scaler.state_dict() if scaler is not None else _deepspeed_state(engine)
        )
        out["after", who, stage, path] = train(engine, sched, AFTER, scaler)
    return out


def _deepspeed_state(engine: Any) -> dict[str, Any]:
    opt = engine.optimizer
    if hasattr(opt, "loss_scale_config"):
        c = opt.loss_scale_config
        return {"scale": c.cur_scale, "stable": c.cur_iter - c.last_overflow_iter - 1}
    ls = getattr(opt, "torch_autocast_gradscaler", None)
    if ls is not None:
        return {"scale": ls.get_scale()}
    s = opt.loss_scaler
    return {
        "scale": s.cur_scale,
        "stable": s.cur_iter - s.last_overflow_iter - 1,
        "spent": s.delayed_shift - s.cur_hysteresis,
    }


def _load_job(rank: int, world: int, root: str) -> dict[Any, Any]:
    import deepspeed

    from lossscale.deepspeed import DeepSpeedLossScaler, install
    from lossscale.deepspeed._testing import build, train

    del rank, world
    prepare_cpu()
    out: dict[Any, Any] = {}
    for who, stage, path in CKPT_CASES:
        engine, sched = build(_ckpt_config(stage, path), seed=7)
        engine.load_checkpoint(f"{root}/{who}-{stage}-{path}", tag="t")
        out["loaded", who, stage, path] = _deepspeed_state(engine) if who == "deepspeed" else None
        scaler = install(engine)
        out["state", who, stage, path] = scaler.state_dict()
        out["after", who, stage, path] = train(engine, sched, AFTER, scaler)
    # ZeRO 0, installed (twice) before the load: the load hook of the last carries it
    engine, _ = build(_ckpt_config(0, "fp16"), seed=7)
    install(engine)
    second = install(engine)
    engine.load_checkpoint(f"{root}/lossscale-0-fp16", tag="t")
    out["zero0_install_first"] = second.state_dict()
    # weights_only: ZeRO-0 files plainly; ZeRO 1-3 once DeepSpeed's own two classes are allowed
    folder = f"{root}/lossscale-0-fp16/t"
    out["zero0_plain"] = sorted(torch.load(f"{folder}/mp_rank_00_model_states.pt",
                                           weights_only=True))  # fmt: skip
    optim = f"{root}/lossscale-2-fp16/t/"
    optim += "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    try:
        torch.load(optim, weights_only=True)
    except Exception as error:  # DeepSpeed's classes, not lossscale's, are named
        out["zero2_plain_error"] = str(error)
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([ZeroStageEnum, fragment_address]):
        sd = torch.load(optim, weights_only=True)
    scaler = sd["optimizer_state_dict"]["loss_scaler"]
    out["zero2_allowed"] = (type(scaler) is DeepSpeedLossScaler, scaler.state_dict())
    del deepspeed
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[Any, Any], dict[Any, Any]]:
    from lossscale._testing import run_gloo_job

    root = tmp_path_factory.mktemp("checkpoints")
    saved = run_gloo_job(_save_job, 1, 600, root / "save", args=(str(root),))[0]
    loaded = run_gloo_job(_load_job, 1, 600, root / "load", args=(str(root),))[0]
    return saved, loaded


def test_a_lossscale_checkpoint_resumes_bit_for_bit_in_a_fresh_process(
    resumed: tuple[dict[Any, Any], dict[Any, Any]],
) -> None:
    saved, loaded = resumed
    for who, stage, path in CKPT_CASES:
        if who != "lossscale":
            continue
        key = (who, stage, path)
        assert loaded[("state", *key)] == saved[("state", *key)]  # scale, counters, skipped steps
        if path == "fp16":
            assert saved[("state", *key)]["loss_scale"]["num_nonfinite_steps"] == 1  # H=2, spent
        if key == ("lossscale", 0, "fp16"):
            assert loaded["zero0_install_first"] == saved[("state", *key)]
        a, b = saved[("after", *key)], loaded[("after", *key)]
        assert a["scale"] == b["scale"] and a["skipped"] == b["skipped"]
        assert a["last_epoch"] == b["last_epoch"] and equal_weights(a, b)


def test_a_deepspeed_checkpoint_converts_on_install(
    resumed: tuple[dict[Any, Any], dict[Any, Any]],
) -> None:
    saved, loaded = resumed
    for who, stage, path in CKPT_CASES:
        if who != "deepspeed":
            continue
        key = (who, stage, path)
        before = saved[("state", *key)]
        state = loaded[("state", *key)]
        if path == "autocast":  # DeepSpeed saves no GradScaler state: it restarts at 2**16
            assert before["scale"] == 16384.0 and loaded[("loaded", *key)] == {"scale": 65536.0}
            assert state["loss_scale"]["current_loss_scale"] == 65536.0
            continue
        assert loaded[("loaded", *key)] == before  # DeepSpeed restored its own fields
        ls = state["loss_scale"]
        assert ls["current_loss_scale"] == before["scale"]
        assert ls["num_good_steps"] == before["stable"] % RULE["loss_scale_window"]
        assert ls["num_nonfinite_steps"] == before.get("spent", 0)
        assert state["skipped_steps"] == saved[("before", *key)]["skipped"][-1]


def test_the_autocast_scale_survives_a_resume_with_lossscale(
    resumed: tuple[dict[Any, Any], dict[Any, Any]],
) -> None:
    saved, loaded = resumed
    key = ("lossscale", 2, "autocast")
    assert saved[("state", *key)]["loss_scale"]["current_loss_scale"] == 16384.0
    assert loaded[("state", *key)] == saved[("state", *key)]


def test_checkpoints_load_with_weights_only(
    resumed: tuple[dict[Any, Any], dict[Any, Any]],
) -> None:
    saved, loaded = resumed
    assert "optimizer" in loaded["zero0_plain"]
    assert "ZeroStageEnum" in loaded["zero2_plain_error"]
    assert "DeepSpeedLossScaler" not in loaded["zero2_plain_error"]
    is_ours, state = loaded["zero2_allowed"]
    assert is_ours and state == saved["state", "lossscale", 2, "fp16"]
