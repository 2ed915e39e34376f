"""Importing a front end's framework, with the extra that installs it named when it is missing;
and the table of engine adapters (:data:`ADAPTERS`), which the tests read."""

from __future__ import annotations

import importlib
import re
import warnings
from typing import NamedTuple


def require(front_end: str, what: str, extra: str, *modules: str) -> None:
    """Import ``modules``; when one of them is not installed, raise ``ModuleNotFoundError`` (an
    ``ImportError``) saying ``lossscale.<front_end> needs <what>: pip install
    "lossscale[<extra>]"``. Any other import failure comes through unchanged."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as missing:
            if missing.name != name:
                raise
            raise ModuleNotFoundError(
                f'lossscale.{front_end} needs {what}: pip install "lossscale[{extra}]"',
                name=name,
            ) from missing


def _release(text: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        return ()
    return tuple(int(part or 0) for part in match.groups())


def check_version(
    call: str,
    framework: str,
    version: str,
    supported: tuple[str, str],
    *,
    span: str = "",
    why: str = "",
) -> None:
    """Check an engine's ``version`` against ``supported`` = ``(first, first unsupported)``
    for ``call`` (``"lossscale.deepspeed.install"``); ``span`` says the supported versions in
    words (default ``"<framework> <first> to below <first unsupported>"``).

    Raises:
      RuntimeError: older than ``first`` (or unreadable), naming both and the pip line.

    Warns:
      UserWarning: at or above the first unsupported version (``why``: what may have changed).
    """
    low, high = supported
    span = span or f"{framework} {low} to below {high}"
    found = _release(version)
    if not found or found < _release(low):
        raise RuntimeError(
            f"{call} supports {span}; this is {framework} {version}: "
            f'pip install "{framework.lower()}>={low},<{high}"'
        )
    if found >= _release(high):
        warnings.warn(
            f"{call} supports {span} and was not tested with {framework} {version}{why}",
            UserWarning,
            stacklevel=3,
        )


class Adapter(NamedTuple):
    """An engine adapter: a subpackage ``lossscale.<name>`` that puts lossscale's rule into a
    training engine, built on front ends (never on another adapter).

    Attributes:
      name: the subpackage (``lossscale.<name>``) and its test folder.
      extra: the pip extra that installs what it needs (``pip install "lossscale[<extra>]"``).
      imports: the modules it cannot be imported without (its tests neither), in order.
      framework: the engine's own import name (``import lossscale`` never imports it).
      requirements: the extra's requirements in ``pyproject.toml``.
      builds_on: the front ends it may import.
      docs_page: its guide, ``docs/<docs_page>``, in the site's navigation as ``title``.
      title: the guide's title in the navigation.
      constraints: the pins its tests are installed with: ``constraints.txt`` (the main test
        environment) or a file of its own, when the engine's requirements cannot meet the main
        pins (``scripts/dev.sh test`` then runs its tests in an environment of their own).
    """

    name: str
    extra: str
    imports: tuple[str, ...]
    framework: str
    requirements: tuple[str, ...]
    builds_on: tuple[str, ...]
    docs_page: str
    title: str
    constraints: str = "constraints.txt"

    @property
    def package(self) -> str:
        """The subpackage's import name."""
        return f"lossscale.{self.name}"

    @property
    def api_page(self) -> str:
        """Its API reference page, ``docs/<api_page>``."""
        return f"api/{self.name}.md"


#: The engine adapters. Adding one is a row here: the tests that name adapters (the layers of
#: the architecture test, test collection, the doctests, import isolation, packaging, the
#: docs and the site's navigation) read this table; see CONTRIBUTING.md.
ADAPTERS: tuple[Adapter, ...] = (
    Adapter(
        "deepspeed",
        "deepspeed",
        ("torch", "deepspeed"),
        "deepspeed",
        ("torch>=2.1", "deepspeed>=0.19.8"),
        ("torch",),
        "deepspeed.md",
        "DeepSpeed",
    ),
    Adapter(
        "megatron",
        "megatron",
        ("torch",),
        "megatron",
        ("torch>=2.1",),
        ("torch",),
        "megatron.md",
        "Megatron-core",
    ),
    Adapter(
        "accelerate",
        "accelerate",
        ("torch", "accelerate"),
        "accelerate",
        ("torch>=2.1", "accelerate>=1.0"),
        ("torch",),
        "rl.md",
        "float16 RL: TRL, verl, OpenRLHF",
    ),
    Adapter(
        "verl",
        "verl",
        ("torch", "verl"),
        "verl",
        ("torch>=2.1", "verl>=0.9,<0.10"),
        ("torch",),
        "verl.md",
        "verl",
        "constraints-verl.txt",  # verl 0.9 needs transformers<5.11
    ),
    Adapter(
        "vllm",
        "vllm",
        ("torch", "vllm"),
        "vllm",
        ("torch>=2.1", "vllm>=0.32,<0.33"),
        ("torch",),
        "rollouts.md",
        "float16 rollouts: vLLM",
        "constraints-vllm.txt",  # vLLM 0.32 pins transformers<5.20
    ),
)
