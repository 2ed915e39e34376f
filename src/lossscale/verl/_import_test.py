"""The swap on ``import verl``: verl imports ``lossscale.verl`` when a user names it
(``VERL_USE_EXTERNAL_MODULES``, ``actor_rollout_ref.model.external_lib``), each in a fresh
interpreter, as in a Ray worker; and the refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import lossscale.verl as lv
from lossscale.verl import _patch

#: What a fresh interpreter prints about verl's FSDPEngine after the snippet it runs.
REPORT = """
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
def where(method):
    return "/".join(method.__code__.co_filename.split("/")[-2:])
print("lossscale.verl" in sys.modules,
      where(FSDPEngine.optimizer_step), where(FSDPEngine.save_checkpoint))
"""
OURS = "verl/_patch.py"
VERL_S = "fsdp/transformer_impl.py"


def _where(method: object) -> str:
    return "/".join(method.__code__.co_filename.split("/")[-2:])  # type: ignore[attr-defined]


def _run(*snippets: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the snippets (each dedented) in a fresh interpreter, with ``env`` and no VERL_ or
    LOSSSCALE_ variable of this process."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "LOSSSCALE_"))}
    code = "\n".join(["import sys", *(textwrap.dedent(s) for s in snippets)])
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _last_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


#: Build verl's FSDP2 engine on the CPU (after ``import verl``) and print its scaler's class.
BUILD = """
import tempfile
from lossscale.verl import _testing
_testing.cpu_platform()
with _testing.process_group():
    built = _testing.engine(_testing.tiny_llama(tempfile.mkdtemp()), "fsdp2")
    scaler = built.scaler
    enabled = scaler.is_enabled()  # torch's, on its default device "cuda": off on a CPU
    print(type(scaler).__module__, type(scaler).__name__, enabled,
          scaler.get_growth_interval() if enabled else "-")
"""


def test_import_verl_with_the_module_named_patches_verl_s_engine() -> None:
    named = _run("import verl", REPORT, VERL_USE_EXTERNAL_MODULES="lossscale.verl")
    assert _last_line(named) == f"True {OURS} {OURS}"
    # side by side: verl on its own keeps its methods
    alone = _run("import verl", REPORT)
    assert _last_line(alone) == f"False {VERL_S} {VERL_S}"


def test_the_engine_verl_builds_after_import_verl_holds_lossscale_s_scaler() -> None:
    named = _run("import verl", BUILD, VERL_USE_EXTERNAL_MODULES="lossscale.verl")
    assert _last_line(named) == "lossscale.verl._scaler ShardedGradScaler True 400"
    # side by side: verl on its own builds torch's (importing lossscale.verl._testing there
    # imports lossscale.verl, so its patch is taken off first)
    alone = _run("import verl, lossscale.verl", "lossscale.verl.unpatch()", BUILD)
    torch_s = "torch.distributed.fsdp.sharded_grad_scaler ShardedGradScaler"
    assert _last_line(alone) == f"{torch_s} False -"


def test_external_lib_in_verl_s_model_config_patches_it_too() -> None:
    snippet = """
    import verl
    from verl.workers.config import HFModelConfig
    try:
        HFModelConfig(path="/nonexistent", external_lib="lossscale.verl")
    except Exception:
        pass  # the model path is not there; external_lib is imported first
    """
    assert _last_line(_run(snippet, REPORT)) == f"True {OURS} {OURS}"


def test_a_malformed_setting_fails_import_verl_naming_it() -> None:
    out = _run(
        "import verl", VERL_USE_EXTERNAL_MODULES="lossscale.verl", LOSSSCALE_GROWTH_INTERVAL="x"
    )
    assert out.returncode != 0
    assert "ValueError: LOSSSCALE_GROWTH_INTERVAL='x' is not an integer" in out.stderr


def test_an_unsupported_verl_is_refused_and_nothing_is_patched() -> None:
    snippet = """
    import verl
    verl.__version__ = "0.10.0"
    try:
        import lossscale.verl
    except ImportError as error:
        print(error)
    """
    out = _run(snippet, REPORT)
    lines = out.stdout.strip().splitlines()
    assert lines[-2].startswith("lossscale.verl supports verl 0.9.x, not verl 0.10.0: it wraps")
    assert _last_line(out) == f"False {VERL_S} {VERL_S}"


@pytest.mark.parametrize("version", ["0.8.2", "1.9.0", "0.10.0", "dev", ""])
def test_check_version_refuses_other_releases(version: str) -> None:
    with pytest.raises(ImportError, match=rf"supports verl 0\.9\.x, not verl {version}:"):
        _patch.check_version(version)
    for supported in ("0.9.0", "0.9.1", "0.9.2.dev0"):
        _patch.check_version(supported)


def test_patch_is_idempotent_and_unpatch_restores_verl_s_methods() -> None:
    engine = _patch.engine_class()
    assert lv.is_patched()
    wrapped = {name: engine.__dict__[name] for name in _patch.METHODS}
    lv.patch()
    assert {name: engine.__dict__[name] for name in _patch.METHODS} == wrapped
    lv.unpatch()
    try:
        assert not lv.is_patched()
        for name in _patch.METHODS:
            assert _where(engine.__dict__[name]) == VERL_S
    finally:
        lv.patch()
    assert all(_where(engine.__dict__[name]) == OURS for name in _patch.METHODS)
