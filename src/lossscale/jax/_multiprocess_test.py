"""Multi-process JAX: ``jax.distributed`` with 2 processes x 2 CPU devices (gloo collectives on
127.0.0.1). The optimizer runs under ``jax.jit`` on globally sharded arrays (GSPMD), and under
``shard_map`` with ``axis_name`` spanning both processes; an overflow on one device of one
process makes every device of every process skip, and all hold the same scale."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TIMEOUT_S = 180
STEPS = 8
OVERFLOW = {2: 3, 5: 0}  # step -> global device index whose gradient shard holds an inf

WORKER = textwrap.dedent(
    """
    import json, os, sys
    pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
        initialization_timeout=60,
    )
    import numpy as np, optax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from lossscale.jax import current_scale, last_step_applied, loss_scale_optimizer

    STEPS, OVERFLOW = int(sys.argv[4]), {int(k): v for k, v in json.loads(sys.argv[5]).items()}
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))

    def global_array(values):
        return jax.make_array_from_callback(values.shape, sharding, lambda idx: values[idx])

    def grads_at(step):
        g = np.tile(np.linspace(1.0, 2.0, 4, dtype=np.float32), (n, 1)) * 8.0
        if step in OVERFLOW:
            g[OVERFLOW[step], 1] = np.inf
        return global_array(g)

    opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=8.0, dynamic_growth_steps=2)

    @jax.jit
    def gspmd_step(g, s, p):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    sharded_opt = loss_scale_optimizer(
        optax.sgd(0.1), initial_scale=8.0, dynamic_growth_steps=2, axis_name="d"
    )

    def local_step(g, s, p):
        u, s = sharded_opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    shard_step = jax.jit(
        jax.shard_map(local_step, mesh=mesh, in_specs=(P("d"), P(), P("d")),
                      out_specs=(P("d"), P())),
    )

    result = {}
    for name, step_fn, o in (("gspmd", gspmd_step, opt), ("shard_map", shard_step, sharded_opt)):
        params = global_array(np.ones((n, 4), np.float32))
        state = jax.jit(o.init)(params)
        trajectory = []
        for step in range(STEPS):
            params, state = step_fn(grads_at(step), state, params)
            trajectory.append([float(current_scale(state)), bool(last_step_applied(state))])
        full = multihost_utils.process_allgather(params, tiled=True)
        result[name] = {"trajectory": trajectory, "params": np.asarray(full).tolist()}
    result["devices"] = [n, jax.local_device_count()]
    with open(out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _expected() -> list[list[object]]:
    """The core rule for the same finite/non-finite sequence (growth every 2 finite steps)."""
    import numpy as np

    from lossscale import DynamicLossScale

    ls = DynamicLossScale(8.0, 2)
    out: list[list[object]] = []
    for step in range(STEPS):
        _, applied = ls.update([np.float32(np.inf if step in OVERFLOW else 1.0)])
        out.append([float(ls()), bool(applied)])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    tmp = tmp_path_factory.mktemp("jax_multiprocess")
    script = tmp / "worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(pid), port, str(tmp / f"out{pid}.json"),
             str(STEPS), json.dumps(OVERFLOW)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"the 2-process jax.distributed job did not finish in {TIMEOUT_S} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-4000:]
    return [json.loads(Path(tmp / f"out{pid}.json").read_text()) for pid in range(2)]


def test_two_processes_with_two_devices_each(results: list[dict[str, object]]) -> None:
    assert [r["devices"] for r in results] == [[4, 2], [4, 2]]


@pytest.mark.parametrize("mode", ["gspmd", "shard_map"])
def test_every_process_skips_together_and_follows_the_rule(
    results: list[dict[str, object]], mode: str
) -> None:
    runs = [r[mode] for r in results]
    assert runs[0]["trajectory"] == _expected()  # type: ignore[index]
    assert runs[1] == runs[0]  # same trajectory and the same (gathered) parameters
    # only the applied steps moved the parameters: p -= lr * grad / (the scale before the step)
    import numpy as np

    grad = np.linspace(1.0, 2.0, 4, dtype=np.float32) * 8.0
    scale_before = [8.0, *[scale for scale, _ in _expected()][:-1]]
    want = np.ones(4, np.float32)
    for (_, applied), scale in zip(_expected(), scale_before, strict=True):
        if applied:
            want = want - 0.1 * grad / scale
    params = np.asarray(runs[0]["params"])  # type: ignore[index]
    assert params.shape == (4, 4)
    np.testing.assert_allclose(params, np.tile(want, (4, 1)), rtol=1e-6, atol=1e-6)
