"""DALL·E's discrete VAE as an image tokenizer (`data.tokenizer=dvae`): Ramesh et al. 2021,
arXiv 2102.12092, section 2.1 and appendix A.

A convolutional encoder maps an image to logits over `data.codebook_size` codes (null: 512, see
`DVAEOption.default_size`) at every cell of a grid `data.patch_size` times smaller than the image;
training decodes a Gumbel-softmax relaxation of those logits (Jang et al. 2016, Maddison et al.
2016) with the temperature annealed from 1 to 1/16, and pulls each cell's distribution towards the
uniform prior by a KL term whose weight rises to β. Tokenizing takes each cell's argmax; decoding
feeds the one-hot codes to the decoder.

As in the paper: resblocks whose residual branch is multiplied by 1 / L^p for L resblocks (the
paper's p = 2 makes it a small constant so the identity path dominates at initialisation; our
default is p = 0, no scaling, for reasons measured at `DVAEConfig.gain_power`), 1 x 1
convolutions next to the relaxation, max pooling down and nearest upsampling up, one group of
resblocks per scale with widths doubling downwards, Adam, and an exponential moving average of
the weights used for encoding and decoding. The reconstruction term is a Gaussian (MSE) one, not
the paper's logit-Laplace: the built-in renders are flat palette colours on white, what the
evaluation parses is the colour of each pixel, and MSE penalises a colour's error directly;
logit-Laplace exists for natural images' bounded pixel range, which the sigmoid output here
already respects.

Training is seeded and runs once per settings hash; the weights (the moving average) are cached
under `<data.cache_dir>/dvae/`. `train/tokenizer.py` runs it with a run store and a tracker
(`dalle-ablate train-tokenizer`); `fit` itself only reports through a callback.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dalle_ablate import interrupts
from dalle_ablate.data.image_tokenizer import IMAGE_TOKENIZERS, TokenizerOption
from dalle_ablate.fileio import atomic_savez
from dalle_ablate.registry import ConfigError, OptionConfig, RunFailed
from dalle_ablate.vqgan.codes import decode_codes, encode_images

TAU_END = 1 / 16  # the paper's final temperature


@dataclass
class DVAEConfig(OptionConfig):
    """data.dvae: the dVAE's shape and training (its hash, with the data's settings that shape the
    images and codes, names the cached weights)."""

    RANGES = {
        "width": "[4, inf)",
        "blocks": "[1, inf)",
        "steps": "[1, inf)",
        "batch": "[1, inf)",
        "lr": "(0, inf)",
        "kl_weight": "[0, inf)",
        "kl_warmup": "[0, 1]",
        "tau_anneal": "[0, 1]",
        "ema": "[0, 1)",
        "sigma": "(0, inf)",
        "gain_power": "[0, inf)",
    }

    width: int = 16  # channels of the finest group; each coarser group doubles it (the paper: 256)
    blocks: int = 1  # resblocks per group (the paper: 2)
    steps: int = 4000  # training updates of the dVAE
    batch: int = 32  # images per update
    lr: float = 1e-3  # Adam, cosine-annealed to 1 % (the paper: 1e-4 to 1.25e-6 over 1.2 M updates)
    kl_weight: float = 1.0  # β, reached after kl_warmup of the steps (the paper: 6.6 after 5000 updates)
    kl_warmup: float = 0.05  # fraction of the steps over which β rises from 0 (cosine)
    tau_anneal: float = 0.5  # fraction of the steps over which τ falls from 1 to 1/16 (cosine)
    ema: float = 0.999  # decay of the weights' moving average (the paper's iterate averaging)
    # The Gaussian decoder's pixel scale, which weighs reconstruction against the KL term: at 1.0
    # the KL won (every cell uniform, the decoder drew the mean image), at 0.1 and 0.3 it did not.
    sigma: float = 0.3
    # Each resblock's branch is multiplied by 1 / L^gain_power, L = resblocks in the encoder (or the
    # decoder); the paper's power 2 gives 1/16 here. The decoder's branches are the only part that
    # can carve a shape out of the 8 x 8 blocks its nearest upsampling makes, and through Adam's
    # unit-size steps a branch scaled by 1/16 changes its output 16x slower: after 2000 steps (512
    # codes, one seed) the parser read 38.7 % of reconstructions right at power 2, 78.3 % at 1 and
    # 96.9 % at 0 (MSE 1.0e-3, 3.4e-4, 2.5e-4). The paper's 1.2 M updates leave time for a small
    # gain; a few thousand do not. At 0 the branch is not scaled at all (gain 1).
    gain_power: float = 0.0
    seed: int = 0  # the dVAE's initialisation and batches


def groups(patch_size: int) -> int:
    """Resolutions the encoder works at: a grid patch_size times smaller needs log2(patch_size)
    halvings (the paper: 256 px to 32 x 32 in 4 groups, 3 poolings)."""
    n = int(round(math.log2(patch_size)))
    if patch_size < 2 or 2**n != patch_size:
        raise ConfigError(
            f"data.patch_size={patch_size}: data.tokenizer=dvae halves the image per group, so it needs a power of 2 >= 2"
        )
    return n + 1


class ResBlock(nnx.Module):
    """x -> id(x) + gain * branch(x); the branch narrows to a quarter of the output width (the
    paper's n_hid / 4) and ends (encoder) or starts (decoder) with a 1 x 1 convolution."""

    def __init__(self, n_in: int, n_out: int, gain: float, decoder: bool, rngs: nnx.Rngs):
        hid = max(n_out // 4, 1)
        conv = lambda a, b, k: nnx.Conv(a, b, (k, k), padding="SAME", rngs=rngs)  # noqa: E731
        kernels = (1, 3, 3, 3) if decoder else (3, 3, 3, 1)
        widths = (n_in, hid, hid, hid, n_out)
        self.convs = nnx.List([conv(widths[i], widths[i + 1], kernels[i]) for i in range(4)])
        self.id = conv(n_in, n_out, 1) if n_in != n_out else None
        self.gain = gain

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x
        for c in self.convs:
            h = c(jax.nn.relu(h))
        return (x if self.id is None else self.id(x)) + self.gain * h


class DVAE(nnx.Module):
    def __init__(self, vocab: int, n_groups: int, width: int, blocks: int, gain_power: float, rngs: nnx.Rngs):
        gain = 1.0 / (n_groups * blocks) ** gain_power  # the paper's post_gain (power 2), per encoder or decoder
        widths = [width * 2**g for g in range(n_groups)]
        conv = lambda a, b, k: nnx.Conv(a, b, (k, k), padding="SAME", rngs=rngs)  # noqa: E731
        self.enc_in = conv(3, widths[0], 3)
        self.enc = nnx.List(
            [
                ResBlock(widths[max(g - 1, 0)] if b == 0 else widths[g], widths[g], gain, False, rngs)
                for g in range(n_groups)
                for b in range(blocks)
            ]
        )
        self.enc_out = conv(widths[-1], vocab, 1)  # 1 x 1 next to the relaxation
        self.dec_in = conv(vocab, widths[-1], 1)
        rev = widths[::-1]
        self.dec = nnx.List(
            [
                ResBlock(rev[max(g - 1, 0)] if b == 0 else rev[g], rev[g], gain, True, rngs)
                for g in range(n_groups)
                for b in range(blocks)
            ]
        )
        self.dec_out = conv(widths[0], 3, 1)
        self.n_groups, self.blocks, self.vocab = n_groups, blocks, vocab

    def logits(self, images: jax.Array) -> jax.Array:
        """uint8 [B, H, W, 3] -> float32 [B, H/p, W/p, vocab]."""
        x = self.enc_in(images.astype(jnp.float32) / 127.5 - 1.0)
        for i, block in enumerate(self.enc):
            if i and i % self.blocks == 0:
                x = nnx.max_pool(x, (2, 2), (2, 2))
            x = block(x)
        return self.enc_out(jax.nn.relu(x))

    def pixels(self, z: jax.Array) -> jax.Array:
        """[B, h, w, vocab] (one-hot or relaxed) -> [B, h*p, w*p, 3] in (0, 1)."""
        x = self.dec_in(z)
        for i, block in enumerate(self.dec):
            if i and i % self.blocks == 0:
                b, h, w, c = x.shape
                x = jax.image.resize(x, (b, 2 * h, 2 * w, c), "nearest")
            x = block(x)
        return jax.nn.sigmoid(self.dec_out(jax.nn.relu(x)))

    def encode(self, images: jax.Array) -> jax.Array:
        logits = self.logits(images)
        return jnp.argmax(logits, -1).reshape(logits.shape[0], -1).astype(jnp.int32)

    def decode(self, codes: jax.Array) -> jax.Array:
        g = int(round(codes.shape[1] ** 0.5))
        z = jax.nn.one_hot(codes.reshape(-1, g, g), self.vocab)
        return jnp.clip(jnp.round(self.pixels(z) * 255.0), 0, 255).astype(jnp.uint8)


def create(vocab: int, patch_size: int, settings: DVAEConfig, abstract: bool = False) -> DVAE:
    """A freshly initialised DVAE, or its abstract shapes only. Kernels are drawn as the paper's
    dVAE draws them, N(0, 1 / (k^2 n_in)), biases 0, with NumPy: JAX's initialisers took 16-24 s
    to compile for these few dozen convolutions on this machine (eagerly or in one jit)."""
    shapes = nnx.eval_shape(
        lambda: DVAE(vocab, groups(patch_size), settings.width, settings.blocks, settings.gain_power, nnx.Rngs(0))
    )
    if abstract:
        return shapes
    graphdef, state = nnx.split(shapes)
    rng = np.random.default_rng(settings.seed)

    def draw(path, x):
        if path[-1].key == "kernel":  # [k, k, n_in, n_out]
            return jnp.asarray(rng.normal(0.0, 1.0 / np.sqrt(np.prod(x.shape[:-1])), x.shape), jnp.float32)
        return jnp.zeros(x.shape, jnp.float32)

    pure = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def relaxed_sample(key: jax.Array, logits: jax.Array, tau: jax.Array) -> jax.Array:
    """Gumbel-softmax: softmax((logits + g) / τ), g ~ Gumbel(0, 1); as τ -> 0 the one-hot of
    argmax(logits + g), a sample of softmax(logits) (the Gumbel-max trick)."""
    return jax.nn.softmax((logits + jax.random.gumbel(key, logits.shape)) / tau, axis=-1)


def kl_to_uniform(logits: jax.Array) -> jax.Array:
    """KL(q || uniform over the K codes) = log K - H(q), per cell (nats), q = softmax(logits)."""
    logq = jax.nn.log_softmax(logits, axis=-1)
    return jnp.log(logits.shape[-1]) + jnp.sum(jnp.exp(logq) * logq, axis=-1)


def cosine(start: float, end: float, frac: jax.Array) -> jax.Array:
    """start -> end along half a cosine as frac goes 0 -> 1 (held at end after)."""
    frac = jnp.clip(frac, 0.0, 1.0)
    return end + (start - end) * 0.5 * (1 + jnp.cos(jnp.pi * frac))


def schedules(settings: DVAEConfig, step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(τ, β) at a step."""
    s = step / settings.steps
    tau = cosine(1.0, TAU_END, s / settings.tau_anneal if settings.tau_anneal else 1.0)
    beta = cosine(0.0, settings.kl_weight, s / settings.kl_warmup if settings.kl_warmup else 1.0)
    return tau, beta


def perplexity(codes: np.ndarray, vocab: int) -> float:
    """exp(entropy of the code histogram): the number of codes in effective use."""
    p = np.bincount(np.asarray(codes).ravel(), minlength=vocab).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


def _train_step(graphdef, tx: optax.GradientTransformation, settings: DVAEConfig, dims: float) -> Callable:
    """The jitted step of `fit`: (params, their moving average, optimiser state, uint8 batch, key,
    step) -> the same three updated and the step's metrics (with each cell's arg-max code)."""

    def loss_fn(p, x, key, step):
        m = nnx.merge(graphdef, p)
        logits = m.logits(x)
        tau, beta = schedules(settings, step)
        recon = m.pixels(relaxed_sample(key, logits, tau))
        target = x.astype(jnp.float32) / 255.0
        # Per image, in nats per pixel channel: -log N(x; x̂, σ²) up to a constant, and the KL
        # summed over the cells, both divided by the number of pixel channels.
        rec = jnp.sum((recon - target) ** 2, axis=(1, 2, 3)) / (2 * settings.sigma**2) / dims
        kl = jnp.sum(kl_to_uniform(logits), axis=(1, 2)) / dims
        total = jnp.mean(rec + beta * kl)
        return total, {
            "tokenizer/loss": total,
            "tokenizer/recon": jnp.mean(rec),
            "tokenizer/kl": jnp.mean(kl),
            "tokenizer/mse": jnp.mean((recon - target) ** 2),
            "tokenizer/tau": tau,
            "tokenizer/beta": beta,
            "codes": jnp.argmax(logits, -1),
        }

    @jax.jit
    def step_fn(p, ema, opt_state, x, key, step):
        (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, x, key, step)
        updates, opt_state = tx.update(grads, opt_state, p)
        p = optax.apply_updates(p, updates)
        # The decay warms up as (1 + t) / (10 + t) (TensorFlow's num_updates): a fixed 0.999 from
        # the start keeps e^-1.5 = 22 % of the random initial weights after 1500 steps, and that
        # average decoded nothing the parser could read (0 %, MSE 0.021); with the warm-up the
        # average scores as the raw weights do (800 steps: 9.6 % vs 10.7 %, MSE 0.0035 both).
        decay = jnp.minimum(settings.ema, (1.0 + step) / (10.0 + step))
        ema = jax.tree.map(lambda e, q: decay * e + (1 - decay) * q, ema, p)
        return p, ema, opt_state, aux

    return step_fn


def fit(
    images: np.ndarray,
    vocab: int,
    patch_size: int,
    settings: DVAEConfig,
    log: Optional[Callable[[int, dict], None]] = None,
    log_every: int = 100,
) -> DVAE:
    """Train on uint8 [N, H, W, 3] images; returns the moving average of the weights. `log(step,
    metrics)` hears the loss, its two terms, τ, β and the batch's code perplexity."""
    model = create(vocab, patch_size, settings)
    # The output starts at the mean colour of each channel: otherwise the first updates whiten every
    # pixel, and the quickest way the encoder helps with that is to send every cell to one code,
    # saturated (seen here: one code in use after 20 steps, for good).
    mean = np.clip(images.reshape(-1, 3).mean(0) / 255.0, 0.01, 0.99)
    model.dec_out.bias[...] = jnp.asarray(np.log(mean / (1 - mean)), jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    lr = optax.warmup_cosine_decay_schedule(
        0.0, settings.lr, min(100, settings.steps // 10), settings.steps, end_value=settings.lr / 100
    )
    tx = optax.adam(lr)
    opt_state = tx.init(params)
    dims = float(np.prod(images.shape[1:]))
    step_fn = _train_step(graphdef, tx, settings, dims)
    rng = np.random.default_rng(settings.seed)
    key = jax.random.key(settings.seed)
    ema = params
    batch = min(settings.batch, len(images))
    last_finite = None
    for step in range(settings.steps):
        interrupts.check("while fitting the image tokenizer (data.tokenizer=dvae)")
        x = jnp.asarray(images[rng.choice(len(images), batch, replace=False)])
        params, ema, opt_state, aux = step_fn(params, ema, opt_state, x, jax.random.fold_in(key, step), step)
        if (step + 1) % log_every == 0 or step + 1 == settings.steps:
            aux = jax.device_get(aux)
            row = {k: float(v) for k, v in aux.items() if k != "codes"}
            row["tokenizer/perplexity"] = perplexity(aux["codes"], vocab)
            if log is not None:
                log(step + 1, row)
            loss = row["tokenizer/loss"]
            if not math.isfinite(loss):  # as stage 2 stops: never a cached tokenizer of broken weights
                raise diverged(step + 1, f"tokenizer/loss={loss}", last_finite)
            last_finite = (step + 1, loss)
    if not all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(ema)):
        raise diverged(settings.steps, "non-finite weights", last_finite)
    return nnx.merge(graphdef, ema)


def diverged(step: int, what: str, last_finite: Optional[tuple[int, float]]) -> RunFailed:
    before = (
        f"last finite loss {last_finite[1]:.4f} at step {last_finite[0]}" if last_finite else "no finite loss before it"
    )
    return RunFailed(
        f"data.tokenizer=dvae diverged at step {step}: {what}; {before}; nothing cached; lower data.dvae.lr",
        RunFailed.DIVERGED,
    )


class DVAETokenizer:
    """The ImageTokenizer interface (data/image_tokenizer.py) over a trained DVAE."""

    def __init__(self, model: DVAE, grid: tuple[int, int], batch: int = 256):
        self.model, self.grid, self.batch = model, grid, batch

    @property
    def size(self) -> int:
        return self.model.vocab

    def encode(self, images: np.ndarray) -> np.ndarray:
        return encode_images(self.model, np.asarray(images, np.uint8), self.batch).astype(np.int32)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        codes = np.asarray(codes)
        if codes.min() < 0 or codes.max() >= self.size:
            raise ValueError(f"codes outside the codebook [0, {self.size})")
        return decode_codes(self.model, codes, self.batch)


def save(model: DVAE, path: Path) -> None:
    leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_savez(path, **{f"p{i}": np.asarray(x) for i, x in enumerate(leaves)})  # a kill never leaves half a file


def load(path: Path, vocab: int, patch_size: int, settings: DVAEConfig) -> DVAE:
    graphdef, state = nnx.split(create(vocab, patch_size, settings, abstract=True))
    leaves, treedef = jax.tree_util.tree_flatten(nnx.to_pure_dict(state))
    with np.load(path) as f:
        nnx.replace_by_pure_dict(
            state, jax.tree_util.tree_unflatten(treedef, [jnp.asarray(f[f"p{i}"]) for i in range(len(leaves))])
        )
    return nnx.merge(graphdef, state)


class DVAEOption(TokenizerOption):
    name = "dvae"

    def default_size(self, cfg) -> int:
        # More codes than the renders' 145 distinct patches: the KL to the uniform prior spreads each
        # cell over several codes that decode alike (valid perplexity ~40 where k-means needs 5), and
        # at 145 codes distinct patches end up sharing one. After 2000 steps (one seed, gain power 0)
        # the parser read 67.4 % of reconstructions right with 145 codes and 96.9 % with 512 (MSE
        # 8.5e-4 vs 2.5e-4); the paper's 8192 is for 256 px photographs.
        return 512

    def key(self, cfg, data_key: str) -> str:
        fields = {
            "version": 3,
            "data": data_key,
            "vocab": cfg.vocab(),
            "patch_size": cfg.patch_size,
            **asdict(cfg.dvae),
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    def build(self, cfg, images, data_key: str, log=None) -> DVAETokenizer:
        path = self.path(cfg, data_key)
        if path.is_file():
            model = load(path, cfg.vocab(), cfg.patch_size, cfg.dvae)
        else:
            model = fit(images(), cfg.vocab(), cfg.patch_size, cfg.dvae, log)
            save(model, path)
        g = cfg.image_size // cfg.patch_size
        return DVAETokenizer(model, (g, g))


IMAGE_TOKENIZERS.register("dvae", DVAEOption())
