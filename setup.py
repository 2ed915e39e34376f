"""The wheel holds the library only: the tests that sit beside its modules (``*_test.py``,
``conftest.py``, the toolbox ``_testing.py``) stay in the repository and the sdist.
Everything else is in pyproject.toml.

setuptools has no declarative way to leave a package's modules out of a wheel
(``exclude-package-data`` applies to data files only), hence this one command class.
"""

from __future__ import annotations

from setuptools import setup
from setuptools.command.build_py import build_py


def _is_test(module: str) -> bool:
    # lossscale._testing: the test suite's private toolbox
    return module.endswith("_test") or module in ("conftest", "_testing")


class BuildPyWithoutTests(build_py):
    _keep_tests = False

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if self._keep_tests or not _is_test(m[1])]

    def get_source_files(self) -> list[str]:
        # The sdist's file list: it keeps the tests, so a source tree can run them.
        self._keep_tests = True
        try:
            return list(super().get_source_files())
        finally:
            self._keep_tests = False


setup(cmdclass={"build_py": BuildPyWithoutTests})
