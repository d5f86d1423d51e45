"""Everything about the package is in pyproject.toml; this file only adds the start-up hook's ``.pth``.

``megamoe-autoregister.pth`` must sit at the top of site-packages (Python's `site` reads ``.pth`` files
there only), which no pyproject.toml setting of setuptools places in both a wheel and an editable install:
``data-files`` reach site-packages through a wheel's ``.data/purelib`` but editable wheels leave data files
out. So `build_py` writes it: at the root of ``build_lib`` for a wheel (whose root is site-packages), and at
the root of the editable wheel, where setuptools' editable build points the ``install`` command, for
``pip install -e``. What the line does: megamoe_runtime/integrations/autoregister.py.
"""
from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

#: the line's source (package data, so an sdist carries it) and its installed name (the hook module's
#: ``PTH_NAME``; tests/runtime/integrations/test_autoregister.py keeps the two equal)
PTH_SOURCE = Path(__file__).resolve().parent / "megamoe_runtime" / "integrations" / "autoregister.pth"
PTH_NAME = "megamoe-autoregister.pth"


class build_py_with_pth(build_py):
    """`build_py`, plus the start-up hook's ``.pth`` at the root of what is installed."""

    def run(self) -> None:
        super().run()
        root = self._pth_root()
        if root is None:
            self.warn(f"{PTH_NAME} is not installed (no editable wheel folder found): transformers then needs "
                      "`import megamoe_runtime.integrations.transformers` before from_pretrained")
            return
        self.copy_file(str(PTH_SOURCE), os.path.join(root, PTH_NAME))

    def _pth_root(self) -> str | None:
        if not getattr(self, "editable_mode", False):
            return self.build_lib
        # an editable build installs the wheel's non-Python files with the `install` command pointed at the
        # unpacked editable wheel, whose root is site-packages; it holds the copied .dist-info already
        try:
            root = getattr(self.get_finalized_command("install"), "install_lib", None)
            if root and any(p.suffix == ".dist-info" for p in Path(root).iterdir()):
                return root
        except Exception:  # noqa: BLE001 -- another setuptools: install without the hook, never fail the install
            pass
        return None

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):  # an editable wheel gets it beside build_lib, not in it
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs


setup(cmdclass={"build_py": build_py_with_pth})
