"""Lets torchvision import beside a torch its C++ library was not built for.

On Linux, the torchvision wheel an index offers may be a CUDA build, whose C++ library
(``torchvision/_C.so``) cannot load beside a CPU torch. torchvision's Python goes on without
it, then registers fake kernels for ``torchvision::nms`` and ``qnms``, two operators only that
library defines, and ``import torchvision`` fails: ``operator torchvision::nms does not exist``.

``make`` copies this module into the virtual environment, with a ``.pth`` file that imports
it, only where ``import torchvision`` fails there. At interpreter start it puts a finder on
``sys.meta_path`` and imports nothing else (torch would cost every Python process seconds).
When torchvision first imports the module of those registrations, after trying its C++
library, the finder declares the two operators if that library did not, without kernels, and
leaves ``sys.meta_path``: datasets, tv_tensors and ``transforms.v2`` then work;
``torchvision.ops.nms`` says it has no kernel for the CPU. A torchvision whose library loads
is left as it is.
"""

from __future__ import annotations

import sys  # and nothing more at interpreter start: typing alone would be a cost to every process

TRIGGER = "torchvision._meta_registrations"
"""The module of torchvision that needs the operators; it is imported after the library is tried."""

SCHEMAS = {name: f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor" for name in ("nms", "qnms")}

_declared: list[object] = []  # the torch.library.Library: its operators live as long as it does


def declare_missing_operators() -> None:
    """Declare ``torchvision::nms`` and ``qnms`` (no kernels) where torchvision's library did not."""
    import torch

    if hasattr(torch.ops.torchvision, "nms"):
        return
    library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS.values():
        library.define(schema)
    _declared.append(library)


class _FirstImport:
    """A meta path finder that acts on the first import of ``TRIGGER``, then leaves; it finds nothing."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name != TRIGGER:
            return None
        # A new list, not an edit of the one the import system is walking now.
        sys.meta_path = [finder for finder in sys.meta_path if finder is not self]
        declare_missing_operators()
        return None


if not any(isinstance(finder, _FirstImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _FirstImport())
