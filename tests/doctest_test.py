"""Docstring examples: every module's examples run, and every public class and function has one.

* :func:`test_doctests` runs the ``>>>`` examples of every non-test module (``*_test``
  excepted) of every package of lossscale: the top-level package, ``core``, ``stateful``,
  ``jax``, ``torch`` and ``demo``, with ``ELLIPSIS | NORMALIZE_WHITESPACE``. The modules are
  found from the files, without importing them, so a module whose framework is not installed
  is skipped with a reason (``pytest.importorskip``) instead of silently disappearing.
* :func:`test_public_names_have_examples` walks the ``__all__`` of the public modules and
  fails naming every public class or function whose own ``__doc__`` holds no ``>>>`` example
  (or whose examples would not run, being defined outside the modules above). The public names
  that are neither a class nor a function (constants, type aliases, submodules) must be listed
  in :data:`EXEMPT`.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import os
import pkgutil
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

import lossscale
from lossscale import _extras as extras

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def requires() -> dict[str, tuple[str, ...]]:
    """Optional libraries a subpackage needs; its modules are skipped when one is missing (the
    engine adapters' from ``lossscale._extras.ADAPTERS``)."""
    return {
        "lossscale.jax": ("jax", "optax"),
        "lossscale.torch": ("torch",),
        "lossscale.keras": ("keras",),
        **{adapter.package: adapter.imports for adapter in extras.ADAPTERS},
        "lossscale.deepspeed.hf": ("torch", "deepspeed", "transformers"),
        "lossscale.deepspeed.lightning": ("torch", "deepspeed", "lightning"),
        "lossscale.accelerate.hf": ("torch", "accelerate", "transformers"),
    }


def public_modules() -> tuple[str, ...]:
    """The modules whose ``__all__`` is the public API (each engine adapter's package among
    them)."""
    return (
        "lossscale",
        "lossscale.core",
        "lossscale.stateful",
        "lossscale.jax",
        "lossscale.demo",
        "lossscale.numerics",
        "lossscale.torch",
        "lossscale.torch.experimental",
        "lossscale.torch.lightning",
        "lossscale.keras",
        "lossscale.keras.experimental",
        *(adapter.package for adapter in extras.ADAPTERS),
        "lossscale.deepspeed.hf",
        "lossscale.deepspeed.lightning",
        "lossscale.accelerate.hf",
    )


REQUIRES = requires()
PUBLIC_MODULES = public_modules()

#: The public names of a public module that defines no ``__all__``.
PUBLIC_WITHOUT_ALL: dict[str, tuple[str, ...]] = {
    "lossscale.torch.experimental": ("LossScaleOptimizer",),
}

#: Public names that are neither classes nor functions, so need no example, and why.
EXEMPT: dict[str, str] = {
    "lossscale.__version__": "the version string",
    "lossscale.core": "a subpackage (its own __all__ is checked)",
    "lossscale.core.FLOAT32_MAX": "a constant",
    "lossscale.core.HYSTERESIS_REFILLS": "a constant",
    "lossscale.core.DEFAULT_STALL_STEPS": "a constant",
    "lossscale.stateful.STATE_VERSION": "a constant",
    "lossscale.jax.LossScale": "a type alias (DynamicLossScale | FixedLossScale)",
    "lossscale.torch.experimental": "a submodule (its own __all__ is checked)",
    "lossscale.keras.experimental": "a submodule (its own __all__ is checked)",
}


def _walk(path: str, prefix: str) -> Iterator[str]:
    for info in pkgutil.iter_modules([path], prefix):
        short = info.name.rsplit(".", 1)[-1]
        if short.endswith("_test"):
            continue
        yield info.name
        if info.ispkg:
            yield from _walk(os.path.join(path, short), info.name + ".")


def module_names() -> list[str]:
    """Every non-test module of lossscale, found from the files (nothing is imported)."""
    names = ["lossscale"]
    for path in lossscale.__path__:
        names.extend(_walk(path, "lossscale."))
    return sorted(set(names))


MODULES = module_names()


def import_or_skip(name: str) -> ModuleType:
    """Import module ``name``, skipping the test when a library it needs is missing."""
    for package, libraries in REQUIRES.items():
        if name == package or name.startswith(package + "."):
            for library in libraries:
                pytest.importorskip(library)
    return importlib.import_module(name)


def test_every_module_is_found() -> None:
    for name in (
        "lossscale",
        "lossscale.__main__",
        "lossscale.core._backends",
        "lossscale.core._rule",
        "lossscale.core._tree",
        "lossscale.stateful._loss_scale",
        "lossscale.stateful._serialization",
        "lossscale.jax._values",
        "lossscale.jax._transform",
        "lossscale.jax._grad",
        "lossscale.torch._optimizer",
        "lossscale.torch.experimental",
        "lossscale.demo._cli",
        "lossscale.demo._train",
    ):
        assert name in MODULES
    assert not [name for name in MODULES if name.endswith("_test")]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    module = import_or_skip(name)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    failed = attempted = 0
    for test in doctest.DocTestFinder().find(module, name):
        result = runner.run(test, out=report.append)
        failed += result.failed
        attempted += result.attempted
    assert failed == 0, f"{failed} of {attempted} examples failed in {name}:\n" + "".join(report)


def _public_names(module: ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = PUBLIC_WITHOUT_ALL.get(module.__name__)
    assert names is not None, (
        f"{module.__name__} defines no __all__; add its public names to PUBLIC_WITHOUT_ALL"
    )
    return list(names)


def _own_doc(obj: Any) -> str:
    """The object's own docstring (a class's, never one inherited from a base class)."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) else ""


def _has_example(obj: Any) -> bool:
    return bool(doctest.DocTestParser().get_examples(_own_doc(obj)))


def _kind(obj: Any) -> str:
    return "class" if inspect.isclass(obj) else "function"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_names_have_examples(module_name: str) -> None:
    module = import_or_skip(module_name)
    public = _public_names(module)
    problems: list[str] = []
    for exempt in sorted(EXEMPT):
        parent, _, attr = exempt.rpartition(".")
        if parent == module_name and attr not in public:
            problems.append(f"{exempt}: listed in EXEMPT but not in {module_name}.__all__")
    for attr in public:
        full = f"{module_name}.{attr}"
        obj = getattr(module, attr)
        is_code = inspect.isclass(obj) or inspect.isroutine(obj)
        if full in EXEMPT:
            if is_code:
                problems.append(f"{full}: a {_kind(obj)}, it needs an example, not an exemption")
            continue
        if not (is_code or (callable(obj) and not isinstance(obj, ModuleType))):
            problems.append(
                f"{full}: neither a class nor a function ({type(obj).__name__}); list it in EXEMPT"
            )
            continue
        where = getattr(obj, "__module__", None)
        if not _has_example(obj):
            problems.append(f"{full}: {_kind(obj)} (defined in {where}) has no >>> example")
        elif where not in MODULES:
            problems.append(f"{full}: its examples do not run (defined in {where})")
    assert not problems, (
        f"{len(problems)} public name(s) of {module_name} lack a docstring example "
        "(add one with >>> to the object's own docstring):\n  " + "\n  ".join(problems)
    )
