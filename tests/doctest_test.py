"""Run the docstring examples of every module of :mod:`lossscale.core` and
:mod:`lossscale.stateful` (test modules, ``*_test``, excepted)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from types import ModuleType

import pytest

import lossscale.core
import lossscale.stateful

PACKAGES: tuple[ModuleType, ...] = (lossscale.core, lossscale.stateful)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def module_names() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
            if not info.name.rsplit(".", 1)[-1].endswith("_test"):
                names.append(info.name)
    return sorted(names)


MODULES = module_names()


def test_every_module_is_found() -> None:
    assert "lossscale.core._rule" in MODULES
    assert "lossscale.stateful._loss_scale" in MODULES
    assert "lossscale.stateful._serialization" in MODULES
    assert not [name for name in MODULES if name.endswith("_test")]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=FLAGS, report=False, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_doctests_exist() -> None:
    attempted = failed = 0
    for name in MODULES:
        result = doctest.testmod(importlib.import_module(name), optionflags=FLAGS, report=False)
        attempted += result.attempted
        failed += result.failed
    assert failed == 0
    assert attempted >= 1
