"""Without an optional framework, its front end's test folder is collected as one skipped item
per module, with the reason, not a collection error (``src/lossscale/conftest.py``).

Each case runs pytest on one folder in a fresh interpreter where the framework cannot be
imported: a package of the same name placed first on the path raises ``ImportError``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_framework_skips_its_folder_with_the_reason(tmp_path: Path) -> None:
    """keras and optax blocked; one pytest run over both folders."""
    for missing in ("keras", "optax"):
        blocked = tmp_path / missing
        blocked.mkdir()
        (blocked / "__init__.py").write_text(f"raise ImportError('no {missing} here')\n")
    env = dict(os.environ, KERAS_BACKEND="numpy")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT / "src")])
    folders = ["src/lossscale/keras", "src/lossscale/jax"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *folders, "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 5, done.stdout + done.stderr  # 5: every module skipped
    assert "error" not in done.stdout.lower(), done.stdout
    for folder, missing in (("keras", "keras"), ("jax", "optax")):
        modules = list((ROOT / "src" / "lossscale" / folder).glob("*_test.py"))
        reason = f"the tests of lossscale.{folder} need"
        assert f"SKIPPED [{len(modules)}]" in done.stdout, done.stdout
        assert reason in done.stdout and f"no {missing} here" in done.stdout, done.stdout
