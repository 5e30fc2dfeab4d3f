"""Stand-ins for modules that sglang's import chain touches but RadixCache never uses.

torchvision: its PyPI wheels are built for torch 2.14 (CUDA); only sglang's multimodal configs
import it. Any attribute of a stub module is another stub (a class, so it can be subclassed).
"""
import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("torchvision",)


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        v = type(name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None})
        setattr(self, name, v)
        return v


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Stub(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def install():
    sys.meta_path.insert(0, _Finder())


def install_after_transformers():
    """transformers must see torchvision missing (it checks once, at import), sglang must find it."""
    import transformers.image_utils  # noqa: F401

    install()
