"""Collection of the front ends' tests that need an optional framework.

The JAX front end's tests need jax and optax (the ``jax`` extra), the Keras front end's keras
(the same holds for it). ``lossscale.jax`` itself
raises ``ImportError`` on import without them, and every module in ``src/lossscale/jax`` (a
conftest there too) is imported as part of that package, so the check cannot live there. Here,
where either does not import, each test module of the ``jax`` folder is collected as one
skipped item with the reason (``SKIPPED [13] ...: the tests of lossscale.jax need jax and
optax: ...`` in pytest's summary), without being imported. Where both import, collection is
pytest's own and the modules import jax and optax plainly. A test that needs more (flax,
orbax) skips itself.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

import pytest

from lossscale import _extras


def needs() -> dict[str, tuple[str, ...]]:
    """A test folder of this package -> the modules its tests cannot run without (the engine
    adapters' from ``lossscale._extras.ADAPTERS``)."""
    folders = {"jax": ("jax", "optax"), "keras": ("keras",)}
    return folders | {adapter.name: adapter.imports for adapter in _extras.ADAPTERS}


NEEDS = needs()


@functools.cache
def _missing(folder: str) -> str | None:
    """Why the tests in ``folder`` cannot run here, or None."""
    for name in NEEDS[folder]:
        try:
            importlib.import_module(name)
        except ImportError as error:
            return f"the tests of lossscale.{folder} need {' and '.join(NEEDS[folder])}: {error}"
    return None


class _Unavailable(pytest.Module):
    """A test module that is not imported: its collection is one skip, with why."""

    reason = ""

    def collect(self) -> Any:
        pytest.skip(self.reason, allow_module_level=True)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    folder = module_path.parent
    if folder.parent != Path(__file__).parent or folder.name not in NEEDS:
        return None
    reason = _missing(folder.name)
    if reason is None:
        return None
    module = _Unavailable.from_parent(parent, path=module_path)
    module.reason = reason
    return module
