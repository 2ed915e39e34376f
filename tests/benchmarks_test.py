"""``python -m benchmarks --quick`` runs start to finish and writes a complete report.

The benchmarks are not tests: this keeps them working (CI runs it). It checks that every
section, row and field is there and that every timing is a finite positive number. No speed
threshold is asserted, ever: CI machines are shared and noisy.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 180

# The contract of the JSON report (benchmarks/run.py and the three *_bench.py).
MACHINE_KEYS = {
    "date",
    "cpu",
    "cpu_count",
    "usable_cpus",
    "memory_gib",
    "os",
    "python",
    "load_average_at_start",
    "versions",
    "gpu",
}
VERSION_KEYS = {"lossscale", "numpy", "torch", "jax", "jaxlib", "optax", "jmp"}
SETS = {"big", "transformer", "small"}
NUMPY_VARIANTS = {
    "floor",
    "floor_flat",
    "update",
    "unscale_update",
    "unscale_update_skip",
    "readme",
    "isfinite_all",
}
NUMPY_RATIOS = {
    "unscale_update_over_floor",
    "update_over_floor",
    "readme_over_floor",
    "unscale_update_over_floor_flat",
}
TORCH_VARIANTS = {
    "bare",
    "gs",
    "ls",
    "gs_skip",
    "ls_skip",
    "floor",
    "foreach_mul",
    "ls_unscale",
    "dropin",
    "dropin_skip",
}
TORCH_OPTIMIZERS = {
    f"{opt}-{impl}" for opt in ("SGDm", "AdamW") for impl in ("forloop", "foreach", "fused")
}
TORCH_SYNCED = {
    "bare",
    "gs",
    "ls",
    "dropin",
    "gs_skip",
    "ls_skip",
    "dropin_skip",
    "ls_dev",
    "dropin_dev",
    "ls_dev_skip",
    "dropin_dev_skip",
}
JAX_VARIANTS = {"plain", "floor", "read", "ls-select", "ls-cond", "jmp", "apply-if-finite"}
# the peers are timed donated only
JAX_UNDONATED = {"plain", "floor", "read", "ls-select", "ls-cond"}
JAX_MODELS = {"anchors", "mlp"}
JAX_POSITIVE = {
    "median_ms",
    "min_ms",
    "compile_s",
    "build_s",
    "step_ratio",
    "per_round_ratio",
    "b2b_ms",
    "b2b_ratio",
}


def installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def run_benchmarks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    """One quick run for the whole module: (report, stdout, JSON path)."""
    path = tmp_path_factory.mktemp("benchmarks") / "report.json"
    proc = run_benchmarks("--quick", "--json", str(path))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(path.read_text()), proc.stdout, path


@pytest.fixture(scope="module")
def report(quick_run: tuple[dict[str, Any], str, Path]) -> dict[str, Any]:
    return quick_run[0]


def positive(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def assert_timings(row: dict[str, Any], variants: set[str]) -> None:
    """Medians and minima of every variant: finite, > 0; spreads finite, >= 0."""
    for key in ("median_ms", "min_ms"):
        assert set(row[key]) == variants, key
        assert all(positive(v) for v in row[key].values()), row[key]
    assert set(row["spread"]) == variants
    assert all(math.isfinite(v) and v >= 0 for v in row["spread"].values())
    assert isinstance(row["noisy"], bool)


def test_report_header_machine_and_versions(report: dict[str, Any]) -> None:
    assert report["schema"] == 1
    assert report["quick"] is True
    assert report["command"].startswith("python -m benchmarks")
    machine = report["machine"]
    assert set(machine) == MACHINE_KEYS
    assert set(machine["versions"]) == VERSION_KEYS
    assert machine["versions"]["numpy"] and machine["versions"]["lossscale"]
    assert machine["cpu"] and positive(machine["cpu_count"])
    assert report["errors"] == {}


def test_every_framework_ran_or_was_skipped_with_a_reason(report: dict[str, Any]) -> None:
    expected = {
        "numpy": ("numpy",),
        "torch": ("torch",),
        "jax": ("jax", "optax"),
        "torch_dist": ("torch",),
        "grpo": ("torch", "trl"),
    }
    for name, modules in expected.items():
        if installed(*modules):
            assert name in report["sections"], name
            assert positive(report["elapsed_s"][name])
        else:
            assert "not installed" in report["skipped"][name]


def test_numpy_section(report: dict[str, Any]) -> None:
    section = report["sections"]["numpy"]
    rows = section["rows"]
    assert {(r["set"], r["dtype"]) for r in rows} == {
        (s, d) for s in SETS for d in ("float16", "float32")
    }
    for row in rows:
        assert positive(row["n_tensors"]) and positive(row["n_elements"])
        assert_timings(row, NUMPY_VARIANTS)
        assert set(row["ratios"]) == NUMPY_RATIOS
        assert all(positive(v) for v in row["ratios"].values())


@pytest.mark.skipif(not installed("torch"), reason="torch not installed")
def test_torch_section(report: dict[str, Any]) -> None:
    section = report["sections"]["torch"]
    devices = section["config"]["devices"]
    assert "cpu" in devices
    rows = section["rows"]
    assert {(r["device"], r["set"], r["optimizer"]) for r in rows} == {
        (d, s, o) for d in devices for s in SETS for o in TORCH_OPTIMIZERS
    }
    for row in rows:
        assert_timings(row, TORCH_VARIANTS)
        ratios = row["ratios"]
        assert set(ratios) == {"overhead", "unscale_over_floor", "skip", "dropin"}
        over = row["over_bare_ms"]  # the medians of the per-round differences
        assert set(over) == {"gs", "ls", "dropin"}
        assert all(math.isfinite(v) for v in over.values())
        if over["gs"] > 0:
            assert ratios["dropin"] == pytest.approx(over["dropin"] / over["gs"])
            assert ratios["overhead"] == pytest.approx(over["ls"] / over["gs"])
        assert ratios["dropin"] is None or math.isfinite(ratios["dropin"])
        # (ls - bare) / (gs - bare): on a noisy machine either difference can be <= 0.
        assert ratios["overhead"] is None or math.isfinite(ratios["overhead"])
        assert positive(ratios["unscale_over_floor"]) and positive(ratios["skip"])
        syncs = row["syncs_per_step"]
        if row["device"] == "cuda":
            assert set(syncs) == TORCH_SYNCED
            assert all(isinstance(n, int) and n >= 0 for n in syncs.values())
            # one read of the flag per step, none for a fused step decided on the device;
            # never more than torch.amp.GradScaler's (which reads none for a fused optimizer)
            # (beyond the bare step's own)
            fused = row["optimizer"].endswith("fused")
            extra = {name: n - syncs["bare"] for name, n in syncs.items()}
            for name in ("ls", "dropin", "ls_skip", "dropin_skip"):
                assert extra[name] == 1, name
            for name in ("ls_dev", "dropin_dev", "ls_dev_skip", "dropin_dev_skip"):
                assert extra[name] == (0 if fused else 1), name
                assert extra[name] <= extra["gs" if "skip" not in name else "gs_skip"], name
        else:
            assert syncs is None
    # the host time per step of the tiny model and of the many-tensor one
    tensors = {"host": 4, "host_many": 200}  # --quick shrinks the 2000 tensors to 200
    front_ends = {"gs", "ls", "dropin", "dropin_no_alarm"}
    for key, n_tensors in tensors.items():
        host = section[key]
        assert host["model"]["tensors"] == n_tensors
        assert host["model"]["foreach"] is (key == "host_many")
        assert set(host["us_per_step"]) == front_ends | {"bare"}
        assert all(positive(v) for v in host["us_per_step"].values())
        assert set(host["over_bare_us"]) == set(host["ratio_to_gs"]) == front_ends
        assert all(math.isfinite(v) for v in host["over_bare_us"].values())
        if host["over_bare_us"]["gs"] > 0:
            assert host["ratio_to_gs"]["gs"] == pytest.approx(1.0)


@pytest.mark.skipif(not installed("jax", "optax"), reason="jax/optax not installed")
def test_jax_section(report: dict[str, Any]) -> None:
    section = report["sections"]["jax"]
    config = section["config"]
    assert positive(config["leaves"]) and positive(config["elements"])
    assert isinstance(config["jmp"], str)
    assert set(config["models"]) == JAX_MODELS == set(config["model_sizes"])
    assert {"sgd", "adam"} <= set(config["inners"])
    for size in config["model_sizes"].values():
        assert positive(size["leaves"]) and positive(size["elements"])
    rows = section["rows"]
    assert sorted((r["model"], r["inner"], r["donated"], r["variant"]) for r in rows) == sorted(
        (m, i, d, v)
        for m in config["models"]
        for i in config["inners"]
        for d in config["donation"]
        for v in (JAX_VARIANTS if d else JAX_UNDONATED)
    )
    for row in rows:
        assert all(positive(row[k]) for k in JAX_POSITIVE), row
        assert positive(row["compile_ratio"]) and math.isfinite(row["spread"])
        assert positive(row["build_ratio"])
        assert row["build_s"] > row["compile_s"]  # trace + lower + compile, on the same builds
        assert isinstance(row["conditionals"], int) and row["conditionals"] >= 0
        assert isinstance(row["copies"], int) and row["copies"] >= 0
        faults = row["faults_per_step"]
        assert faults is None or (isinstance(faults, float) and faults >= 0)
        assert 1 <= row["compilations"] <= config["compile_reps"]
        assert isinstance(row["noisy"], bool) and isinstance(row["b2b_noisy"], bool)
    b2b = config["back_to_back"]
    assert positive(b2b["blocks"]) and positive(b2b["steps"])
    plain = [r for r in rows if r["variant"] == "plain"]
    assert all(r["b2b_ratio"] == 1.0 for r in plain)  # each inner's own plain is the base


@pytest.mark.skipif(not installed("torch"), reason="torch not installed")
def test_torch_dist_section(report: dict[str, Any]) -> None:
    section = report["sections"]["torch_dist"]
    assert section["config"]["ranks"] == 2 and section["config"]["backend"] == "gloo"
    rows = section["rows"]
    assert {r["params"] for r in rows} == SETS
    for row in rows:
        assert_timings(row, {"ls_local", "ls", "allreduce"})
        assert math.isfinite(row["added_over_step"])  # may be <= 0 on a noisy machine
        assert positive(row["allreduce_over_step"])
        assert isinstance(row["noisy"], bool)


@pytest.mark.skipif(not installed("torch", "trl"), reason="torch/trl not installed")
def test_grpo_section(report: dict[str, Any]) -> None:
    section = report["sections"]["grpo"]
    config = section["config"]
    assert positive(config["rounds"]) and positive(config["steps"]) and config["device"] == "cpu"
    assert set(config["versions"]) == {"trl", "transformers", "accelerate"}
    (row,) = section["rows"]
    assert_timings(row, {"torch", "lossscale"})
    assert set(row["scaler_ms"]) == {"torch", "lossscale"}
    assert all(positive(v) for v in row["scaler_ms"].values())
    assert positive(row["install_ms"])
    assert set(row["ratios"]) == {"step", "scaler"}
    assert row["ratios"]["step"] == pytest.approx(
        row["median_ms"]["lossscale"] / row["median_ms"]["torch"]
    )
    assert row["ratios"]["scaler"] == pytest.approx(
        row["scaler_ms"]["lossscale"] / row["scaler_ms"]["torch"]
    )


def test_noise_verdict(report: dict[str, Any]) -> None:
    noise = report["noise"]
    rows = [r for s in report["sections"].values() for r in s["rows"]]
    assert noise["rows"] == len(rows)
    assert noise["noisy_rows"] == sum(r["noisy"] for r in rows)
    assert isinstance(noise["noisy"], bool)
    assert ("machine noisy: ratios unreliable" in noise["verdict"]) == noise["noisy"]


def test_table_on_stdout(quick_run: tuple[dict[str, Any], str, Path]) -> None:
    report, stdout, _ = quick_run
    assert stdout.startswith("## lossscale benchmarks (quick mode")
    assert "- machine: " in stdout and "- versions: " in stdout
    titles = {
        "numpy": "### NumPy",
        "torch": "### PyTorch",
        "jax": "### JAX",
        "torch_dist": "### torch.distributed",
        "grpo": "### TRL GRPO",
    }
    for name in report["sections"]:
        assert titles[name] in stdout
    assert report["noise"]["verdict"] in stdout
    table_lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    rows = sum(len(s["rows"]) for s in report["sections"].values())
    tables = len(report["sections"])
    torch_section = report["sections"].get("torch", {})
    for key in ("host", "host_many"):  # the torch section's host tables: a row per variant
        host = torch_section.get(key)
        if host:
            title = f"#### PyTorch: host time per step (CPU; {host['model']['tensors']} tensors"
            assert title in stdout
            rows, tables = rows + len(host["us_per_step"]), tables + 1
    assert len(table_lines) == rows + tables  # + one header per table


def test_from_json_prints_the_same_tables(quick_run: tuple[dict[str, Any], str, Path]) -> None:
    _, stdout, path = quick_run
    proc = run_benchmarks("--from-json", str(path))
    assert proc.returncode == 0, proc.stderr
    assert stdout.startswith(proc.stdout.rstrip("\n"))


def test_paired_median_cancels_drift_between_rounds() -> None:
    """Differences taken within each round: a round that ran slow for both variants does not
    move the overhead, where the difference of the two medians does."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks._timing import Timing
    finally:
        sys.path.remove(str(ROOT))
    timing = Timing({"bare": [0.010, 0.100, 0.012], "x": [0.011, 0.101, 0.014]})
    assert timing.paired_median("x", "bare") == pytest.approx(0.001)
    assert timing.median("x") - timing.median("bare") == pytest.approx(0.002)
    with pytest.raises(ValueError, match="not paired"):
        Timing({"bare": [0.1], "x": [0.1, 0.2]}).paired_median("x", "bare")


def _three_steps(inner: str, variant: str) -> tuple[Any, Any, Any, Any, Any]:
    """``jax_bench`` (imported from the repository root), the quick problem's inputs, the
    ``plain`` and ``variant`` states after three jitted steps of ``inner`` from the same
    parameters, and ``variant``'s jitted step."""
    sys.path.insert(0, str(ROOT))
    try:
        import jax
        from benchmarks import jax_bench
    finally:
        sys.path.remove(str(ROOT))
    params, xs = jax_bench.make_problem(quick=True)
    states, steps = [], []
    for name in ("plain", variant):
        init, step = jax_bench.VARIANTS[name](jax_bench.INNER[inner], jax_bench.loss_fn)
        steps.append(jax.jit(step))
        state = init(params)
        for _ in range(3):
            state = steps[-1](state, xs)
        states.append(state)
    return jax_bench, xs, states[0], states[1], steps[1]


def _bitwise_equal(a: Any, b: Any) -> bool:
    import jax
    import jax.numpy as jnp

    same = jax.tree_util.tree_map(lambda x, y: bool(jnp.array_equal(x, y)), a, b)
    return all(jax.tree_util.tree_leaves(same))


@pytest.mark.skipif(not installed("jax", "optax"), reason="jax/optax not installed")
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_jax_floor_is_the_plain_step_behind_a_flag_on_every_gradient(inner: str) -> None:
    """The ``floor`` variant computes the plain step bit for bit on finite gradients, and its
    flag depends on every leaf: a NaN in the first element of the *last* leaf's gradient
    leaves the parameters and the optimizer state as they were (were the flag to read fewer
    leaves, or none, the barrier it stands for would not be measured)."""
    _, xs, plain, floor, step = _three_steps(inner, "floor")
    assert _bitwise_equal(plain, floor)
    # the last leaf's gradient is xs[-1]^T (xs[-1] @ p) * c: a NaN in xs[-1][0, 0] reaches
    # its first element (and no other leaf's)
    bad = [*xs[:-1], xs[-1].at[0, 0].set(float("nan"))]
    assert _bitwise_equal(floor, step(floor, bad))


@pytest.mark.skipif(not installed("jax", "optax"), reason="jax/optax not installed")
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_jax_read_is_the_plain_step_plus_a_sum_of_every_gradient(inner: str) -> None:
    """The ``read`` variant's parameters and optimizer state are the plain step's, bit for bit,
    and its extra output sums every leaf of the gradients: the last leaf's gradient changes it
    (were the sum to read fewer leaves, the pass it stands for would not be measured)."""
    import jax
    import jax.numpy as jnp

    jax_bench, xs, plain, read, step = _three_steps(inner, "read")
    assert _bitwise_equal(plain, read[:2])
    grads = jax.grad(jax_bench.loss_fn)(read[0], xs)
    expected = sum(float(jnp.sum(g)) for g in jax.tree_util.tree_leaves(grads))
    assert float(step(read, xs)[2]) == pytest.approx(expected, rel=1e-4, abs=1e-6)
    # the last leaf's gradient is xs[-1]^T (xs[-1] @ p) * c: a NaN in xs[-1] reaches only it
    bad = [*xs[:-1], xs[-1].at[0, 0].set(jnp.nan)]
    assert jnp.isnan(step(read, bad)[2])


def _quick_run(module: str) -> str:
    """``python -m <module> --quick`` from the repository: its standard output (it must exit 0)."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(not installed("torch"), reason="the numerics benchmark needs torch")
def test_numerics_bench_quick_runs_and_reports_both_scales() -> None:
    """``python -m benchmarks.numerics_bench --quick``: timings, the report at the scale the
    run settled on and at scale 1 (docs/performance.md quotes the full run)."""
    out = _quick_run("benchmarks.numerics_bench")
    assert "unsampled step:" in out and "sampled step:" in out
    assert "loss scale 2^0, float16:" in out  # the report at scale 1
    assert "one loss scale covers all" in out or "no single loss scale covers all" in out


@pytest.mark.skipif(not installed("transformers"), reason="the audit benchmark's models")
def test_audit_bench_quick_runs_and_reports_every_ratio() -> None:
    """``python -m benchmarks.audit_bench --quick``: a row per model, each with the plan's
    size, the six ratios as numbers, the host reads of an audit and no CUDA sync count off
    CUDA (docs/performance.md quotes the full run)."""
    rows = {
        line.split("|")[1].strip().removesuffix(" (noisy)"): line.split("|")[2:-1]
        for line in _quick_run("benchmarks.audit_bench").splitlines()
        if line.startswith("| ") and not line.startswith("| model")
    }
    assert set(rows) == {"massive activation", "clean"}
    assert rows["massive activation"][0].strip().startswith("1 of ")
    assert rows["clean"][0].strip().startswith("0 of ")
    for cells in rows.values():
        ratios = [float(c.strip().removesuffix("x")) for c in cells[4:10]]
        assert len(ratios) == 6 and all(math.isfinite(r) and r > 0 for r in ratios)
    # one read per batch and pass: the clean audit's two, more where the plan needs runs
    assert int(rows["clean"][10]) == 2
    assert 2 < int(rows["massive activation"][10]) <= 20
    assert {cells[11].strip() for cells in rows.values()} == {"-"}  # CUDA syncs: on CUDA only
