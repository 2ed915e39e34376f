"""``import lossscale`` never imports torch, jax or tensorflow, and a front end imported without
its framework names the extra that installs it.

Each check runs in a fresh interpreter: the test process itself has imported the frameworks.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from lossscale import _extras as extras


def frameworks() -> tuple[str, ...]:
    """The frameworks ``import lossscale`` never imports (each engine adapter's engine among
    them, from ``lossscale._extras.ADAPTERS``)."""
    engines = dict.fromkeys(adapter.framework for adapter in extras.ADAPTERS)
    return ("torch", "jax", "jaxlib", "tensorflow", "keras", "tf_keras", "optax", *engines)


def own_framework_cases() -> list[tuple[str, str]]:
    """(package, the framework it needs last): the packages that import no Keras."""
    adapters = [(adapter.package, adapter.imports[-1]) for adapter in extras.ADAPTERS]
    return [("lossscale.torch", "torch"), ("lossscale.jax", "jax"), *adapters]


def extra_cases() -> list[tuple[str, str, str]]:
    """(package, a module it needs, the extra that installs it)."""
    adapters = [
        (adapter.package, module, adapter.extra)
        for adapter in extras.ADAPTERS
        for module in adapter.imports
    ]
    return [
        ("lossscale.torch", "torch", "torch"),
        *adapters,
        ("lossscale.jax", "jax", "jax"),
        ("lossscale.jax", "optax", "jax"),
        ("lossscale.keras", "keras", "keras"),
    ]


FRAMEWORKS = frameworks()


def run_python(code: str) -> dict[str, object]:
    """Run ``code`` in a new interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_import_leaves_frameworks_out_of_sys_modules() -> None:
    result = run_python(
        f"""
        import json, sys
        import lossscale
        import lossscale.core
        import lossscale.stateful
        print(json.dumps({{"loaded": [m for m in {FRAMEWORKS!r} if m in sys.modules]}}))
        """
    )
    assert result == {"loaded": []}


def test_numpy_use_leaves_frameworks_out_of_sys_modules() -> None:
    result = run_python(
        f"""
        import json, sys
        import numpy as np
        import lossscale
        from lossscale.core import all_finite, dynamic_rule, dynamic_state, dynamic_update
        ls = lossscale.DynamicLossScale(8, 1)
        ls.update([np.ones(2, np.float16), None, 1.0])
        ls.update({{"w": np.array([np.nan])}})
        ls.load_state_dict(ls.state_dict())
        lossscale.deserialize(lossscale.serialize(ls))
        lossscale.get("dynamic"), lossscale.get(8), repr(ls)
        try:
            ls.update([object()])
        except TypeError:
            pass
        rule = dynamic_rule()
        dynamic_update(dynamic_state(2.0, rule), all_finite([np.ones(1)]), rule)
        print(json.dumps({{
            "loaded": [m for m in {FRAMEWORKS!r} if m in sys.modules],
            "scale": float(ls()),
        }}))
        """
    )
    assert result == {"loaded": [], "scale": 8.0}


def test_the_numerics_report_on_numpy_leaves_frameworks_and_matplotlib_out() -> None:
    """``lossscale.numerics`` (and the demo's report) needs NumPy only; matplotlib is imported
    only to draw the heatmap."""
    result = run_python(
        f"""
        import json, sys
        import numpy as np
        from lossscale.numerics import Report, recommend, tensor_stats
        tensor_stats(np.ones(3, np.float32), formats=("float16", "float8_e4m3fn"))
        report = Report()
        report.record(0, {{"w": np.full(4, 1e-9, np.float32)}})
        report.table(), str(recommend(report))
        from lossscale.demo import run
        run(scaled=True, steps=2, report_every=1)
        print(json.dumps({{
            "loaded": [m for m in {(*FRAMEWORKS, "matplotlib")!r} if m in sys.modules],
            "underflow": report.rows[0].underflow,
        }}))
        """
    )
    assert result == {"loaded": [], "underflow": 1.0}


def test_torch_imported_after_lossscale_is_recognised() -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    result = run_python(
        """
        import json
        import lossscale
        import torch  # after lossscale: recognised lazily from sys.modules
        ls = lossscale.DynamicLossScale(8, 1)
        _, ok = ls.update([torch.ones(2, dtype=torch.float16)])
        print(json.dumps({"state": type(ls()).__module__, "ok": type(ok).__name__}))
        """
    )
    assert result == {"state": "torch", "ok": "Tensor"}


@pytest.mark.parametrize(("package", "own"), own_framework_cases())
def test_framework_packages_import_no_keras_or_tensorflow(package: str, own: str) -> None:
    # issue 17: lossscale.torch / lossscale.jax import no Keras (and no TensorFlow)
    if importlib.util.find_spec(own) is None:
        pytest.skip(f"{own} is not installed")
    result = run_python(
        f"""
        import json, sys
        import {package}
        names = ("keras", "tensorflow", "tf_keras")
        print(json.dumps({{"loaded": [m for m in names if m in sys.modules]}}))
        """
    )
    assert result == {"loaded": []}


@pytest.mark.parametrize(("package", "blocked", "extra"), extra_cases())
def test_a_front_end_without_its_framework_names_the_extra(
    package: str, blocked: str, extra: str
) -> None:
    # The framework is made unimportable (None in sys.modules), as if it were not installed.
    result = run_python(
        f"""
        import json, sys
        sys.modules[{blocked!r}] = None
        try:
            import {package}
        except ImportError as error:
            print(json.dumps({{
                "type": type(error).__name__,
                "message": str(error),
                "name": error.name,
                "cause": type(error.__cause__).__name__,
            }}))
        else:
            print(json.dumps({{"type": None}}))
        """
    )
    assert result["type"] == "ModuleNotFoundError"  # an ImportError, as before
    assert result["name"] == blocked and result["cause"] == "ModuleNotFoundError"
    message = str(result["message"])
    assert message.startswith(f"{package} needs "), message
    assert f'pip install "lossscale[{extra}]"' in message, message
