"""Empty stand-ins for torchvision and transformers, which the peers import but the benchmark never uses.

mosaicml-streaming imports both at import time (its vision and text dataset classes), and
installing them would replace the CPU build of torch with a multi-GB CUDA build. Any
``import torchvision...`` or ``import transformers...`` gets an empty module whose
attributes are placeholder classes. Call ``install()`` before importing a peer.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

STUBBED = ("torchvision", "transformers")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (), {"__module__": self.__name__})
        setattr(self, name, placeholder)
        return placeholder


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Stub torchvision and transformers unless the real ones are importable. The stubs come
    first on ``sys.meta_path``: a torchvision installed but failing to import (a CUDA build
    beside CPU torch) must not be found again by the path finder."""
    finder = next((f for f in sys.meta_path if isinstance(f, _StubFinder)), None)
    if finder is None:
        finder = _StubFinder()
        sys.meta_path.insert(0, finder)
    for name in STUBBED:
        if name in sys.modules or name in finder.names:
            continue
        try:
            __import__(name)
        except Exception:  # missing, or a build that cannot load here (a CUDA torchvision beside CPU torch)
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            finder.names.add(name)
