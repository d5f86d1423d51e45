"""The start-up hook: transformers knows the ``megamoe`` method without ``import megamoe_runtime...``.

transformers 5.17 finds a third-party quantization method only in its own registries, filled by an import
(it reads no entry point), so ``from_pretrained(OUT)`` in a process that never imported the integration
skipped OUT's ``quantization_config`` with a warning and ran the model with randomly initialised experts.
Installing megamoe puts ``megamoe-autoregister.pth`` into site-packages (setup.py); Python's `site` runs its
one line at every interpreter start, and that line imports this module (docs/ENGINES.md#transformers).

Start-up cost is the point of the design: this module imports nothing but `sys` and does one thing, put a
finder first on ``sys.meta_path``. The finder answers for one module only, ``transformers.modeling_utils``
(the module that defines ``from_pretrained`` and calls ``get_hf_quantizer``, so every load imports it
first); it lets the other finders locate it and wraps the loader. When that module has executed, the loader
imports `megamoe_runtime.integrations.transformers`, whose import registers the method (config, quantizer
and the ``get_hf_quantizer`` checks of its ``hooks``), then takes itself and the finder out of the way. A
process that never imports transformers pays one string comparison per import and nothing else.

Failures: nothing here may break an interpreter start or a transformers import that does not concern
megamoe. A failure of the hook itself is swallowed with one warning line naming the explicit import;
``MEGAMOE_AUTOREGISTER=0`` (read when transformers loads, through `megamoe_runtime.knobs`) turns the
registration off, and transformers then behaves as if megamoe were not installed.
"""
import sys

__all__ = ["TARGET", "INTEGRATION", "KNOB", "PTH_NAME", "install", "installed", "pth_file"]

#: the module whose execution the hook waits for
TARGET = "transformers.modeling_utils"
#: the module whose import registers the megamoe method with transformers
INTEGRATION = "megamoe_runtime.integrations.transformers"
#: the environment variable that turns the registration off (docs/ENVIRONMENT.md)
KNOB = "MEGAMOE_AUTOREGISTER"
#: the name setup.py installs the line under, in site-packages
PTH_NAME = "megamoe-autoregister.pth"


class _Finder:
    """First on ``sys.meta_path``; finds nothing itself, it only wraps the loader of `TARGET`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        try:
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader)
        except Exception as e:  # noqa: BLE001 -- the spec as found still imports transformers
            _warn("could not wrap the loader of " + TARGET, e)
        return spec


class _Loader:
    """The real loader of `TARGET`, plus the registration once the module has executed."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # get_source, get_filename, is_package, ...: the real loader's
        if name == "loader":  # not set (a copy made without __init__): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            module.__loader__ = self.loader  # the executed module keeps no trace of the hook
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self.loader
            _uninstall()
        except Exception as e:  # noqa: BLE001 -- transformers imported fine: never fail its import
            _warn("could not step out of the import system", e)
        _register()


def _register():
    """Import the integration (its import registers the method), unless the knob says no; never raises."""
    if INTEGRATION in sys.modules:  # imported or being imported by the user: that import registers itself
        return
    try:
        from .. import knobs

        if (knobs.get(KNOB) or "").strip() == "0":
            return
        __import__(INTEGRATION)
    except Exception as e:  # noqa: BLE001 -- a broken hook must not break transformers for other models
        _warn("could not register the megamoe quantization method with transformers", e)


def _warn(what, e):
    import warnings

    warnings.warn(f"megamoe start-up hook: {what} ({type(e).__name__}: {e}); from_pretrained on a megamoe "
                  f"output needs `import {INTEGRATION}` first (or {KNOB}=0 silences this)", RuntimeWarning,
                  stacklevel=2)


def pth_file():
    """The installed ``megamoe-autoregister.pth`` this interpreter's `site` runs at start-up, or None (megamoe
    used from PYTHONPATH without being installed: then nothing imports this module by itself)."""
    import os
    import site

    dirs = list(site.getsitepackages()) + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    return next((os.path.join(d, PTH_NAME) for d in dirs if os.path.isfile(os.path.join(d, PTH_NAME))), None)


def installed():
    """The hook's finder on ``sys.meta_path``, or None."""
    return next((f for f in sys.meta_path if isinstance(f, _Finder)), None)


def install():
    """Put the finder first on ``sys.meta_path`` (idempotent). Where transformers' models are already
    imported there is nothing to wait for: the integration is imported now."""
    try:
        if TARGET in sys.modules:
            _register()
        elif installed() is None:
            sys.meta_path.insert(0, _Finder())
    except Exception as e:  # noqa: BLE001 -- runs at interpreter start: warn, never raise
        _warn("could not install its import finder", e)


def _uninstall():
    """Take the finder off ``sys.meta_path`` (it is needed once)."""
    finder = installed()
    while finder is not None:
        sys.meta_path.remove(finder)
        finder = installed()


install()
