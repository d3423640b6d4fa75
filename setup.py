"""Build hook: ship the top-level registry, models.toml, inside the package.

The registry lives next to pyproject.toml (where people look for it and edit it); setuptools'
package-data cannot reach outside the package directory, so build_py copies it into the build's
ggufspec/ directory. Everything else is configured in pyproject.toml. A checkout (editable
install) reads the top-level file directly: see ggufspec.registry.shipped_registry_path.
"""
import warnings
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

REGISTRY = "models.toml"


class build_py_with_registry(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:  # an editable install reads the checkout's file itself
            target = Path(self.build_lib, "ggufspec", REGISTRY)
            self.mkpath(str(target.parent))
            self.copy_file(REGISTRY, str(target), preserve_mode=False)


# `pip install -e .` would print setuptools' note that a folder named like the package in the
# working directory may shadow it: true of every flat layout, and nothing to act on. Keep installs quiet.
warnings.filterwarnings("ignore", message="Editable installation")

setup(cmdclass={"build_py": build_py_with_registry})
