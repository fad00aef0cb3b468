"""Pretrained weights of ported PyTorch networks (VQGAN, FID Inception, CLIP) as `.npz` files:
one array per parameter path (`a/0/b/kernel`) plus JSON entries (`__config__`, ...), read back
into an nnx module with every path and shape checked, and PyTorch checkpoints read for the
converters. No network access anywhere: weights come from local files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dalle_ablate.fileio import atomic_savez
from dalle_ablate.registry import ConfigError


def flat_arrays(model: nnx.Module) -> dict[str, np.ndarray]:
    """Parameter and statistics path -> array (ShapeDtypeStructs for an abstract model)."""
    out = {}
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))):
        value = v.get_value()
        out["/".join(str(k) for k in path)] = value if isinstance(value, jax.ShapeDtypeStruct) else np.asarray(value)
    return out


def save_weights(model: nnx.Module | dict[str, np.ndarray], path: str | Path, **meta) -> None:
    """`.npz` of the arrays by path (of a module, or path -> array) and each `meta` entry as JSON
    under `__<key>__`; written to a temporary name first, so a failure never leaves a torn file
    where good weights were."""
    arrays = model if isinstance(model, dict) else flat_arrays(model)
    atomic_savez(path, **{f"__{k}__": np.array(json.dumps(v)) for k, v in meta.items()}, **arrays)


def existing(path: str | Path, field: str, hint: str) -> Path:
    """`path` (user-expanded) if it exists, else a ConfigError naming `field`, with how to make one."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"{field}: {path} does not exist ({hint})")
    return path


def open_weights(path: str | Path, field: str, convert_hint: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta entries, arrays) of a weights file written by save_weights; errors name `field`."""
    path = existing(path, field, convert_hint)
    data = np.load(path)
    if "__config__" not in data.files:
        raise ConfigError(
            f"{field}: {path} has no __config__ entry; it was not written by this project ({convert_hint})"
        )
    meta = {k[2:-2]: json.loads(str(data[k])) for k in data.files if k.startswith("__") and k.endswith("__")}
    return meta, {k: data[k] for k in data.files if not k.startswith("__")}


def with_arrays(make: Callable[[], nnx.Module], arrays: dict[str, np.ndarray], source: str) -> nnx.Module:
    """The module `make()` builds, with every parameter and statistic taken from `arrays`."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    flat = []
    for path_, var in nnx.to_flat_state(state):
        key = "/".join(str(p) for p in path_)
        if key not in arrays:
            raise ConfigError(f"{source} lacks the parameter {key}")
        if tuple(arrays[key].shape) != tuple(var.shape):
            raise ConfigError(
                f"{source}: {key} has shape {tuple(arrays[key].shape)}, the model needs {tuple(var.shape)}"
            )
        flat.append((path_, var.replace(jnp.asarray(arrays[key], var.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def random_arrays(make: Callable[[], nnx.Module], seed: int) -> dict[str, np.ndarray]:
    """Random weights in the layout of `make()`, drawn with NumPy from the abstract shapes (no
    initialiser runs: fast for big networks), for tests and benchmarks: He-normal kernels,
    embeddings and projections, identity norms and batch norms, so activations stay of order
    one through deep ReLU stacks."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, s in flat_arrays(nnx.eval_shape(make)).items():
        leaf = key.rsplit("/", 1)[-1]
        if leaf in ("scale", "var"):
            out[key] = np.ones(s.shape, np.float32)
        elif leaf in ("bias", "mean"):
            out[key] = np.zeros(s.shape, np.float32)
        else:
            fan_in = int(np.prod(s.shape[:-1])) if len(s.shape) > 1 else s.shape[0]
            out[key] = rng.standard_normal(s.shape, np.float32) * np.float32(np.sqrt(2.0 / fan_in))
    return out


def file_hash(path: str | Path) -> str:
    """First 16 hex digits of the file's SHA-256: names the weights behind a metric value."""
    h = hashlib.sha256()
    with open(Path(path).expanduser(), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def read_state_dict(path: str | Path) -> dict[str, np.ndarray]:
    """A checkpoint's name -> float32 array: PyTorch (.ckpt/.pt/.pth/.bin, including OpenAI's
    TorchScript CLIP archives: needs torch, the `ref` extra), .safetensors, or an .npz of the same
    names."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"{path}: no such file")
    if path.suffix == ".npz":
        data = np.load(path)
        return {k: data[k] for k in data.files}
    if path.suffix == ".safetensors":
        try:
            from safetensors.numpy import load_file
        except ImportError as e:
            raise ConfigError(
                f"{path}: reading .safetensors needs the safetensors package (pip install -e '.[ref]')"
            ) from e
        return {k: np.asarray(v, np.float32) for k, v in load_file(str(path)).items()}
    try:
        import torch
    except ImportError as e:
        raise ConfigError(
            f"{path}: reading a PyTorch checkpoint needs torch (pip install -e '.[ref]'), "
            "or give an .npz of its state dict"
        ) from e
    try:
        ckpt = torch.load(str(path), map_location="cpu", weights_only=False)
    except RuntimeError:  # a TorchScript archive (OpenAI's CLIP .pt files)
        ckpt = torch.jit.load(str(path), map_location="cpu").state_dict()
    sd = ckpt.get("state_dict", ckpt) if isinstance(ckpt, dict) else ckpt
    return {k: v.float().numpy() for k, v in sd.items() if hasattr(v, "numpy")}


def from_state_dict(
    make: Callable[[], nnx.Module],
    state_dict: dict[str, np.ndarray],
    torch_name: Callable[[str], tuple[str, str]],
    what: str,
) -> nnx.Module:
    """The module `make()` builds with the weights of a PyTorch state dict. `torch_name` maps our
    path to (state-dict name, how): how is `copy`, `conv` (OIHW -> HWIO) or `linear` (out, in ->
    in, out). Every parameter must be found; extra entries are ignored."""
    ours = {}
    for key in flat_arrays(nnx.eval_shape(make)):
        name, how = torch_name(key)
        if name not in state_dict:
            raise ConfigError(f"the checkpoint has no {name} (for {key}); is it {what}?")
        ours[key] = _to_ours(np.asarray(state_dict[name], np.float32), how)
    return with_arrays(make, ours, "the checkpoint")


def to_state_dict(model: nnx.Module, torch_name: Callable[[str], tuple[str, str]]) -> dict:
    """The inverse of from_state_dict: our weights under PyTorch's names and layouts (shapes only
    for an abstract model)."""
    out = {}
    for key, w in flat_arrays(model).items():
        name, how = torch_name(key)
        axes = _THEIRS[how](w.ndim)
        out[name] = (
            jax.ShapeDtypeStruct(tuple(w.shape[a] for a in axes), w.dtype)
            if isinstance(w, jax.ShapeDtypeStruct)
            else w.transpose(axes)
        )
    return out


# Axis orders from our layout to PyTorch's (HWIO -> OIHW, [in, out] -> [out, in]) and back.
_THEIRS = {"copy": lambda n: tuple(range(n)), "conv": lambda n: (3, 2, 0, 1), "linear": lambda n: (1, 0)}
_OURS = {"copy": lambda n: tuple(range(n)), "conv": lambda n: (2, 3, 1, 0), "linear": lambda n: (1, 0)}


def _to_ours(w: np.ndarray, how: str) -> np.ndarray:
    return w.transpose(_OURS[how](w.ndim))


def apply_batched(fn: Callable, state, x: np.ndarray, batch_size: int) -> np.ndarray:
    """`fn(state, batch)` over `x` in batches of one fixed size, min(batch_size, len(x)) (the last
    one padded by repeating its final row, so a jitted `fn` compiles once per N), concatenated."""
    batch_size = min(batch_size, len(x))
    outs = []
    for start in range(0, len(x), batch_size):
        chunk = x[start : start + batch_size]
        pad = np.repeat(chunk[-1:], batch_size - len(chunk), 0)
        outs.append(np.asarray(fn(state, jnp.asarray(np.concatenate([chunk, pad]))))[: len(chunk)])
    return np.concatenate(outs)
