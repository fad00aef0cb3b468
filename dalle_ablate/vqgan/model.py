"""The taming-transformers VQGAN as nnx modules. Parameter paths follow the PyTorch state dict's
names (`encoder/down/0/block/1/norm1/scale` for `encoder.down.0.block.1.norm1.weight`), so that
conversion is a rename plus a kernel transpose."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dalle_ablate.registry import ConfigError
from dalle_ablate.weights import from_state_dict, open_weights, save_weights, to_state_dict, with_arrays


@dataclass(frozen=True)
class VQGANConfig:
    """Defaults: `vqgan_imagenet_f16_16384` (taming-transformers' ImageNet f16 config)."""

    ch: int = 128
    ch_mult: tuple = (1, 1, 2, 2, 4)  # one level per entry; a 2x downsample between levels: f = 2^(levels - 1)
    num_res_blocks: int = 2
    attn_resolutions: tuple = (16,)
    resolution: int = 256
    z_channels: int = 256
    embed_dim: int = 256
    n_embed: int = 16384
    in_channels: int = 3
    out_ch: int = 3
    extra: dict = field(default_factory=dict)  # unused keys of a config file, kept for the record

    @property
    def factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


def _norm(c: int, rngs) -> nnx.GroupNorm:
    return nnx.GroupNorm(c, num_groups=min(32, c), epsilon=1e-6, rngs=rngs)


def _conv(i: int, o: int, k: int, rngs, stride: int = 1, padding="SAME") -> nnx.Conv:
    return nnx.Conv(i, o, (k, k), strides=stride, padding=padding, rngs=rngs)


class ResnetBlock(nnx.Module):
    def __init__(self, i: int, o: int, rngs):
        self.norm1, self.conv1 = _norm(i, rngs), _conv(i, o, 3, rngs)
        self.norm2, self.conv2 = _norm(o, rngs), _conv(o, o, 3, rngs)
        self.nin_shortcut = _conv(i, o, 1, rngs) if i != o else None

    def __call__(self, x):
        h = self.conv1(jax.nn.swish(self.norm1(x)))
        h = self.conv2(jax.nn.swish(self.norm2(h)))
        return (self.nin_shortcut(x) if self.nin_shortcut is not None else x) + h


class AttnBlock(nnx.Module):
    def __init__(self, c: int, rngs):
        self.norm = _norm(c, rngs)
        self.q, self.k, self.v, self.proj_out = (_conv(c, c, 1, rngs) for _ in range(4))

    def __call__(self, x):
        b, hgt, w, c = x.shape
        h = self.norm(x)
        q, k, v = (f(h).reshape(b, hgt * w, c) for f in (self.q, self.k, self.v))
        a = jax.nn.softmax(jnp.einsum("bic,bjc->bij", q, k) / np.sqrt(c), axis=-1)
        return x + self.proj_out(jnp.einsum("bij,bjc->bic", a, v).reshape(b, hgt, w, c))


class Downsample(nnx.Module):
    def __init__(self, c: int, rngs):
        self.conv = _conv(c, c, 3, rngs, stride=2, padding="VALID")

    def __call__(self, x):
        return self.conv(jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0))))  # taming pads right and bottom only


class Upsample(nnx.Module):
    def __init__(self, c: int, rngs):
        self.conv = _conv(c, c, 3, rngs)

    def __call__(self, x):
        return self.conv(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))  # nearest neighbour x2


class Level(nnx.Module):
    """One resolution: ResNet blocks, each followed by attention at the attention resolutions,
    then the down- or upsampler (none at the last level)."""

    def __init__(self, blocks, attns, resample):
        self.block = nnx.List(blocks)
        self.attn = nnx.List(attns)
        self.resample = resample

    def __call__(self, h):
        for j, block in enumerate(self.block):
            h = block(h)
            if len(self.attn):
                h = self.attn[j](h)
        return self.resample(h) if self.resample is not None else h


class Encoder(nnx.Module):
    def __init__(self, cfg: VQGANConfig, rngs):
        self.conv_in = _conv(cfg.in_channels, cfg.ch, 3, rngs)
        res, mults = cfg.resolution, (1, *cfg.ch_mult)
        levels = []
        for i in range(len(cfg.ch_mult)):
            cin, cout = cfg.ch * mults[i], cfg.ch * cfg.ch_mult[i]
            blocks = [ResnetBlock(cin if j == 0 else cout, cout, rngs) for j in range(cfg.num_res_blocks)]
            attns = [AttnBlock(cout, rngs) for _ in range(cfg.num_res_blocks)] if res in cfg.attn_resolutions else []
            last = i == len(cfg.ch_mult) - 1
            levels.append(Level(blocks, attns, None if last else Downsample(cout, rngs)))
            res = res if last else res // 2
        self.down = nnx.List(levels)
        c = cfg.ch * cfg.ch_mult[-1]
        self.mid_block_1, self.mid_attn_1, self.mid_block_2 = (
            ResnetBlock(c, c, rngs),
            AttnBlock(c, rngs),
            ResnetBlock(c, c, rngs),
        )
        self.norm_out, self.conv_out = _norm(c, rngs), _conv(c, cfg.z_channels, 3, rngs)

    def __call__(self, x):
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        h = self.mid_block_2(self.mid_attn_1(self.mid_block_1(h)))
        return self.conv_out(jax.nn.swish(self.norm_out(h)))


class Decoder(nnx.Module):
    def __init__(self, cfg: VQGANConfig, rngs):
        c = cfg.ch * cfg.ch_mult[-1]
        res = cfg.resolution // cfg.factor
        self.conv_in = _conv(cfg.z_channels, c, 3, rngs)
        self.mid_block_1, self.mid_attn_1, self.mid_block_2 = (
            ResnetBlock(c, c, rngs),
            AttnBlock(c, rngs),
            ResnetBlock(c, c, rngs),
        )
        levels = {}
        for i in reversed(range(len(cfg.ch_mult))):
            cout = cfg.ch * cfg.ch_mult[i]
            blocks = [ResnetBlock(c if j == 0 else cout, cout, rngs) for j in range(cfg.num_res_blocks + 1)]
            attns = (
                [AttnBlock(cout, rngs) for _ in range(cfg.num_res_blocks + 1)] if res in cfg.attn_resolutions else []
            )
            levels[i] = Level(blocks, attns, Upsample(cout, rngs) if i != 0 else None)
            c = cout
            res = res * 2 if i != 0 else res
        self.up = nnx.List([levels[i] for i in range(len(cfg.ch_mult))])  # indexed as taming's up[i]
        self.norm_out, self.conv_out = _norm(c, rngs), _conv(c, cfg.out_ch, 3, rngs)

    def __call__(self, z):
        h = self.mid_block_2(self.mid_attn_1(self.mid_block_1(self.conv_in(z))))
        for level in reversed(list(self.up)):
            h = level(h)
        return self.conv_out(jax.nn.swish(self.norm_out(h)))


class VQGAN(nnx.Module):
    def __init__(self, cfg: VQGANConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.encoder, self.decoder = Encoder(cfg, rngs), Decoder(cfg, rngs)
        self.quant_conv = _conv(cfg.z_channels, cfg.embed_dim, 1, rngs)
        self.post_quant_conv = _conv(cfg.embed_dim, cfg.z_channels, 1, rngs)
        init = nnx.initializers.uniform(2.0 / cfg.n_embed)
        self.embedding = nnx.Param(init(rngs.params(), (cfg.n_embed, cfg.embed_dim)) - 1.0 / cfg.n_embed)

    def encode(self, images: jax.Array) -> jax.Array:
        """[B, H, W, 3] uint8 -> [B, H/f * W/f] int32 codes, raster order (nearest codebook entry)."""
        x = images.astype(jnp.float32) / 127.5 - 1.0
        z = self.quant_conv(self.encoder(x))
        e = self.embedding[...]
        d = jnp.sum(z**2, -1, keepdims=True) - 2 * z @ e.T + jnp.sum(e**2, -1)
        return jnp.argmin(d, -1).reshape(images.shape[0], -1).astype(jnp.int32)

    def decode(self, codes: jax.Array) -> jax.Array:
        """[B, n] codes (n a square) -> [B, H, W, 3] uint8."""
        side = int(round(codes.shape[1] ** 0.5))
        if side * side != codes.shape[1]:
            raise ValueError(f"{codes.shape[1]} codes are not a square grid")
        z = self.embedding[...][codes].reshape(codes.shape[0], side, side, -1)
        x = self.decoder(self.post_quant_conv(z))
        return jnp.clip(jnp.round((x + 1.0) * 127.5), 0, 255).astype(jnp.uint8)


# -- weights ------------------------------------------------------------------------------------
def save_vqgan(model: VQGAN, path: str | Path) -> None:
    """`.npz` of the parameters by path, and the config as JSON under `__config__`."""
    save_weights(model, path, config=asdict(model.cfg))


def load_vqgan(path: str | Path, field: str = "vqgan weights") -> VQGAN:
    meta, arrays = open_weights(path, field, "convert the PyTorch checkpoint with `dalle-ablate convert-vqgan`")
    raw = meta["config"]
    cfg = VQGANConfig(**{**raw, "ch_mult": tuple(raw["ch_mult"]), "attn_resolutions": tuple(raw["attn_resolutions"])})
    return with_arrays(lambda: VQGAN(cfg, nnx.Rngs(0)), arrays, f"{field} {Path(path).expanduser()}")


def _torch_name(key: str) -> tuple[str, str]:
    """Our parameter path -> (taming state-dict name, how to convert the array)."""
    parts = key.split("/")
    leaf = parts[-1]
    mods = parts[:-1]
    # nnx.List levels: `down/0/block/1` is taming's `down.0.block.1`; the resampler is
    # `downsample` / `upsample` there; mid blocks are `mid.block_1` etc.
    out = []
    for i, p in enumerate(mods):
        if p == "resample":
            out.append("downsample" if "down" in mods[:i] else "upsample")
        elif p.startswith("mid_"):
            out.extend(["mid", p[4:]])
        else:
            out.append(p)
    if leaf == "embedding":
        return "quantize.embedding.weight", "copy"
    if leaf == "kernel":
        return ".".join(out + ["weight"]), "conv"
    if leaf == "scale":
        return ".".join(out + ["weight"]), "copy"
    return ".".join(out + [leaf]), "copy"  # bias


def convert_state_dict(state_dict: dict[str, np.ndarray], cfg: VQGANConfig) -> VQGAN:
    """A VQGAN with the weights of a taming-transformers state dict (name -> array). Extra
    entries (the loss's discriminator, LPIPS) are ignored."""
    return from_state_dict(
        lambda: VQGAN(cfg, nnx.Rngs(0)), state_dict, _torch_name, "a taming-transformers VQGAN with this config"
    )


def torch_names(model: VQGAN) -> dict[str, np.ndarray]:
    """The inverse of convert_state_dict: our weights under taming's names and layouts."""
    return to_state_dict(model, _torch_name)


def config_from_taming_yaml(path: str | Path) -> VQGANConfig:
    """The VQGANConfig of a taming-transformers model config (model.params.ddconfig, embed_dim,
    n_embed), as shipped next to its checkpoints."""
    import yaml

    raw = yaml.safe_load(Path(path).expanduser().read_text())
    try:
        params = raw["model"]["params"]
        dd = params["ddconfig"]
        return VQGANConfig(
            ch=dd["ch"],
            ch_mult=tuple(dd["ch_mult"]),
            num_res_blocks=dd["num_res_blocks"],
            attn_resolutions=tuple(dd["attn_resolutions"]),
            resolution=dd["resolution"],
            z_channels=dd["z_channels"],
            embed_dim=params["embed_dim"],
            n_embed=params["n_embed"],
            in_channels=dd["in_channels"],
            out_ch=dd["out_ch"],
        )
    except (KeyError, TypeError) as e:
        raise ConfigError(f"--config {path}: not a taming-transformers VQGAN config (missing {e})") from e
