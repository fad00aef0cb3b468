"""The independent PyTorch implementations the ports are checked against (the `ref` extra):
torch-fidelity's FID Inception and open_clip's CLIP and tokenizer.

Both packages import torchvision (and open_clip timm) at package import, for parts these tests
do not use; the `ref` extra pins the small CPU torch 2.13.0, beside which PyPI's torchvision
fails to import ("operator torchvision::nms does not exist"). When the packages import, they are
used as they are; otherwise their modules are imported from the installed files without running
the packages' `__init__`, with torchvision's one name that open_clip's utils import
(`FrozenBatchNorm2d`, used only to freeze ResNet towers) standing in as torch's BatchNorm2d, and
timm reported absent (open_clip's own optional-import path). The modules under test -- the
networks and the tokenizer -- are the packages' own code either way."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest


def _bare_package(name: str) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[ref]')")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec  # its files stay findable (importlib.resources, find_spec)
    sys.modules[name] = module


def _torchvision_works() -> bool:
    try:
        import torchvision  # noqa: F401

        return True
    except Exception:  # noqa: BLE001 - RuntimeError from its C++ ops beside a mismatched torch
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False


def torch_fidelity_inception():
    """torch_fidelity.feature_extractor_inceptionv3 (skips only when torch is absent)."""
    pytest.importorskip("torch")
    try:
        return importlib.import_module("torch_fidelity.feature_extractor_inceptionv3")
    except ImportError:
        pytest.skip("torch-fidelity is not installed (pip install -e '.[ref]')")
    except RuntimeError:
        _bare_package("torch_fidelity")
        return importlib.import_module("torch_fidelity.feature_extractor_inceptionv3")


def open_clip_modules():
    """(open_clip.model, open_clip.tokenizer) (skips only when torch is absent)."""
    torch = pytest.importorskip("torch")
    if importlib.util.find_spec("open_clip") is None:
        pytest.skip("open_clip_torch is not installed (pip install -e '.[ref]')")
    if not _torchvision_works():
        misc = types.ModuleType("torchvision.ops.misc")
        misc.FrozenBatchNorm2d = torch.nn.BatchNorm2d
        sys.modules.update(
            {
                "torchvision": types.ModuleType("torchvision"),
                "torchvision.ops": types.ModuleType("torchvision.ops"),
                "torchvision.ops.misc": misc,
                "timm": None,
            }
        )
        _bare_package("open_clip")
    return importlib.import_module("open_clip.model"), importlib.import_module("open_clip.tokenizer")
