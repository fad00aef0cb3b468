"""CLIP (Radford et al. 2021, arXiv 2103.00020) in Flax, for the CLIP score of samples: the
vision transformer and the causal text transformer of OpenAI's ViT models (ViT-B/32, ViT-L/14 and
any other size of that layout), and CLIP's byte-level BPE with its 77-token context.

Parameter paths follow the PyTorch state dict's names, which OpenAI's checkpoints and open_clip's
share (`visual/transformer/resblocks/3/attn/in_proj/kernel` for
`visual.transformer.resblocks.3.attn.in_proj_weight`); `dalle-ablate convert-clip` turns a
checkpoint and CLIP's `bpe_simple_vocab_16e6.txt.gz` into one `.npz` (weights, config, BPE).

Score convention (as torchmetrics' CLIPScore): 100 * cos(image embedding, caption embedding) per
sample, averaged over the samples, and the mean clamped at 0 (torchmetrics clamps the mean, not
each pair). Images are preprocessed as CLIP's own transform does:
PIL bicubic resize of the shorter side to the input size, centre crop, OpenAI's mean and std.
"""

from __future__ import annotations

import gzip
import html
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dalle_ablate.evaluate.evaluators import SamplesContext, evaluator
from dalle_ablate.metrics import Metric
from dalle_ablate.registry import ConfigError, OptionConfig, check
from dalle_ablate.weights import (
    apply_batched,
    existing,
    file_hash,
    from_state_dict,
    open_weights,
    save_weights,
    to_state_dict,
)
from dalle_ablate.weights import with_arrays

MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)  # OpenAI's preprocessing
STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
PREPROCESS = "pil-bicubic-shorter-side+center-crop"


@dataclass(frozen=True)
class CLIPConfig:
    """Defaults: ViT-B/32. Heads are width / 64 in every OpenAI model."""

    embed_dim: int = 512
    image_size: int = 224
    patch_size: int = 32
    vision_width: int = 768
    vision_layers: int = 12
    vision_heads: int = 12
    context_length: int = 77
    vocab_size: int = 49408
    text_width: int = 512
    text_heads: int = 8
    text_layers: int = 12
    act: str = "quick_gelu"  # OpenAI's weights were trained with QuickGELU; open_clip's own ViT-* with "gelu"


PRESETS = {
    "ViT-B/32": CLIPConfig(),
    "ViT-L/14": CLIPConfig(
        embed_dim=768,
        patch_size=14,
        vision_width=1024,
        vision_layers=24,
        vision_heads=16,
        text_width=768,
        text_heads=12,
    ),
}
ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def _ln(w: int, rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(w, epsilon=1e-5, rngs=rngs)  # PyTorch's default epsilon, not Flax's 1e-6


class Attention(nnx.Module):
    def __init__(self, w: int, heads: int, rngs):
        self.heads = heads
        self.in_proj = nnx.Linear(w, 3 * w, rngs=rngs)
        self.out_proj = nnx.Linear(w, w, rngs=rngs)

    def __call__(self, x, causal: bool):
        b, n, w = x.shape
        q, k, v = jnp.split(self.in_proj(x).reshape(b, n, 3 * self.heads, w // self.heads), 3, axis=2)
        mask = jnp.tril(jnp.ones((n, n), bool)) if causal else None
        return self.out_proj(jax.nn.dot_product_attention(q, k, v, mask=mask).reshape(b, n, w))


class MLP(nnx.Module):
    def __init__(self, w: int, act: str, rngs):
        self.c_fc, self.c_proj = nnx.Linear(w, 4 * w, rngs=rngs), nnx.Linear(4 * w, w, rngs=rngs)
        self.act = act

    def __call__(self, x):
        return self.c_proj(ACTIVATIONS[self.act](self.c_fc(x)))


class ResidualAttentionBlock(nnx.Module):
    def __init__(self, w: int, heads: int, act: str, rngs):
        self.ln_1, self.attn, self.ln_2, self.mlp = (
            _ln(w, rngs),
            Attention(w, heads, rngs),
            _ln(w, rngs),
            MLP(w, act, rngs),
        )

    def __call__(self, x, causal: bool):
        x = x + self.attn(self.ln_1(x), causal)
        return x + self.mlp(self.ln_2(x))


class Transformer(nnx.Module):
    def __init__(self, w: int, layers: int, heads: int, act: str, rngs):
        self.resblocks = nnx.List([ResidualAttentionBlock(w, heads, act, rngs) for _ in range(layers)])

    def __call__(self, x, causal: bool = False):
        for block in self.resblocks:
            x = block(x, causal)
        return x


def _param(rngs, shape, scale: float) -> nnx.Param:
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape))


class VisionTransformer(nnx.Module):
    def __init__(self, cfg: CLIPConfig, rngs):
        w, p = cfg.vision_width, cfg.patch_size
        grid = cfg.image_size // p
        self.conv1 = nnx.Conv(3, w, (p, p), strides=p, padding="VALID", use_bias=False, rngs=rngs)
        self.class_embedding = _param(rngs, (w,), w**-0.5)
        self.positional_embedding = _param(rngs, (grid * grid + 1, w), w**-0.5)
        self.ln_pre, self.ln_post = _ln(w, rngs), _ln(w, rngs)
        self.transformer = Transformer(w, cfg.vision_layers, cfg.vision_heads, cfg.act, rngs)
        self.proj = _param(rngs, (w, cfg.embed_dim), w**-0.5)

    def __call__(self, x):
        x = self.conv1(x)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        cls = jnp.broadcast_to(self.class_embedding[...], (x.shape[0], 1, x.shape[-1]))
        x = self.ln_pre(jnp.concatenate([cls, x], 1) + self.positional_embedding[...])
        x = self.transformer(x)
        return self.ln_post(x[:, 0]) @ self.proj[...]  # the class token's output


class CLIP(nnx.Module):
    def __init__(self, cfg: CLIPConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        w = cfg.text_width
        self.visual = VisionTransformer(cfg, rngs)
        self.token_embedding = nnx.Embed(cfg.vocab_size, w, rngs=rngs)
        self.positional_embedding = _param(rngs, (cfg.context_length, w), 0.01)
        self.transformer = Transformer(w, cfg.text_layers, cfg.text_heads, cfg.act, rngs)
        self.ln_final = _ln(w, rngs)
        self.text_projection = _param(rngs, (w, cfg.embed_dim), w**-0.5)

    def encode_image(self, pixels: jax.Array) -> jax.Array:
        """Preprocessed float images [N, S, S, 3] -> embeddings [N, embed_dim] (not normalised)."""
        return self.visual(pixels)

    def encode_text(self, ids: jax.Array) -> jax.Array:
        """Token ids [N, context] -> embeddings at the end-of-text token (the largest id)."""
        x = self.token_embedding(ids) + self.positional_embedding[...]
        x = self.ln_final(self.transformer(x, causal=True))
        return x[jnp.arange(ids.shape[0]), jnp.argmax(ids, -1)] @ self.text_projection[...]


# -- tokenizer ----------------------------------------------------------------------------------
def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable character table, which CLIP's vocabulary starts with."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


# CLIP's pre-tokenisation: contractions, letter runs, single digits, other non-space runs.
_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
N_MERGES = 49152 - 256 - 2  # CLIP uses the first 48894 merges of bpe_simple_vocab_16e6


def read_bpe(path: str | Path) -> list[str]:
    """The merges of CLIP's `bpe_simple_vocab_16e6.txt.gz` (or its uncompressed text)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(
            f"--bpe: {path} does not exist (CLIP's bpe_simple_vocab_16e6.txt.gz ships with the CLIP "
            "and open_clip packages)"
        )
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    lines = raw.decode("utf-8").split("\n")[1 : N_MERGES + 1]  # the first line is a version header
    if len(lines) != N_MERGES or any(len(m.split()) != 2 for m in lines):
        raise ConfigError(
            f"--bpe: {path} is not CLIP's BPE merges file (need {N_MERGES} lines of 'a b' after a header)"
        )
    return lines


class CLIPTokenizer:
    """CLIP's BPE through HF `tokenizers`: clean (ftfy, HTML unescape, whitespace), lower-case,
    split by CLIP's pattern, byte-level characters, BPE with `</w>` ending each word;
    `<start_of_text>` ... `<end_of_text>`, truncated to the context with the last token kept as
    end-of-text, zero-padded."""

    def __init__(self, merges: list[str], context_length: int = 77):
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers

        chars = _bytes_to_unicode()
        vocab_list = chars + [c + "</w>" for c in chars] + ["".join(m.split()) for m in merges]
        vocab_list += ["<start_of_text>", "<end_of_text>"]
        vocab = {t: i for i, t in enumerate(vocab_list)}
        self.sot, self.eot = vocab["<start_of_text>"], vocab["<end_of_text>"]
        self.vocab_size = len(vocab)
        self.context_length = context_length
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split()) for m in merges], end_of_word_suffix="</w>")
        self.tok = Tokenizer(bpe)
        self.tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PATTERN), behavior="removed", invert=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    @staticmethod
    def clean(text: str) -> str:
        import ftfy

        text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
        return " ".join(text.split()).lower()

    def __call__(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.context_length), np.int32)
        for i, enc in enumerate(self.tok.encode_batch([self.clean(t) for t in texts])):
            ids = [self.sot, *enc.ids, self.eot][: self.context_length]
            ids[-1] = self.eot
            out[i, : len(ids)] = ids
        return out


# -- weights ------------------------------------------------------------------------------------
_ATTN = {"in_proj/kernel": ("in_proj_weight", "linear"), "in_proj/bias": ("in_proj_bias", "copy")}


def _torch_name(key: str) -> tuple[str, str]:
    *mods, leaf = key.split("/")
    if mods and mods[-1] == "in_proj":  # PyTorch's MultiheadAttention keeps q, k, v in one in_proj_* pair
        name, how = _ATTN[f"in_proj/{leaf}"]
        return ".".join(mods[:-1] + [name]), how
    if key == "token_embedding/embedding":
        return "token_embedding.weight", "copy"
    if leaf == "kernel":
        return ".".join(mods + ["weight"]), "conv" if mods[-1] == "conv1" else "linear"
    if leaf == "scale":
        return ".".join(mods + ["weight"]), "copy"
    return ".".join(mods + [leaf]), "copy"


def config_from_state_dict(sd: dict, act: str = "quick_gelu", head_width: int = 64) -> CLIPConfig:
    """The config a CLIP state dict implies (as OpenAI's `build_model` reads it)."""
    try:

        def layers(prefix):
            return len({k[len(prefix) :].split(".")[0] for k in sd if k.startswith(prefix)})

        vw, tw = sd["visual.conv1.weight"].shape[0], sd["ln_final.weight"].shape[0]
        patch = sd["visual.conv1.weight"].shape[-1]
        grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
        return CLIPConfig(
            embed_dim=sd["text_projection"].shape[1],
            image_size=patch * grid,
            patch_size=patch,
            vision_width=vw,
            vision_layers=layers("visual.transformer.resblocks."),
            vision_heads=vw // head_width,
            context_length=sd["positional_embedding"].shape[0],
            vocab_size=sd["token_embedding.weight"].shape[0],
            text_width=tw,
            text_heads=tw // head_width,
            text_layers=layers("transformer.resblocks."),
            act=act,
        )
    except KeyError as e:
        raise ConfigError(
            f"the checkpoint has no {e.args[0]}; is it a CLIP ViT (OpenAI or open_clip) state dict?"
        ) from e


def convert_state_dict(sd: dict, cfg: CLIPConfig) -> CLIP:
    return from_state_dict(lambda: CLIP(cfg, nnx.Rngs(0)), sd, _torch_name, "a CLIP ViT state dict of this shape")


def torch_names(model: CLIP) -> dict:
    return to_state_dict(model, _torch_name)


def save_clip(
    model: CLIP | dict[str, np.ndarray], merges: list[str], path: str | Path, cfg: CLIPConfig | None = None
) -> None:
    """`model`: a CLIP, or its arrays by path with their `cfg`."""
    save_weights(model, path, config=asdict(cfg or model.cfg), bpe=merges, preprocess=PREPROCESS)


HINT = "convert a CLIP checkpoint and its bpe_simple_vocab_16e6.txt.gz with `dalle-ablate convert-clip`"


class CLIPScorer:
    """CLIP score of images against their captions, batched and jitted, with the weights' hash."""

    def __init__(self, path: str | Path, field: str = "eval.clip.weights", batch_size: int = 32):
        meta, arrays = open_weights(path, field, HINT)
        if "bpe" not in meta:
            raise ConfigError(f"{field}: {path} has no BPE merges; it is not a CLIP weights file ({HINT})")
        self.cfg = CLIPConfig(**meta["config"])
        if self.cfg.act not in ACTIVATIONS:
            raise ConfigError(f"{field}: {path} asks for activation {self.cfg.act!r}; valid: {', '.join(ACTIVATIONS)}")
        model = with_arrays(lambda: CLIP(self.cfg, nnx.Rngs(0)), arrays, f"{field} {path}")
        self.tokenizer = CLIPTokenizer(meta["bpe"], self.cfg.context_length)
        self.state = nnx.state(model)
        self.hash = file_hash(path)
        self.batch_size = batch_size
        self._image, self._text = _encoders(self.cfg)

    def preprocess(self, images: np.ndarray) -> np.ndarray:
        from PIL import Image

        s = self.cfg.image_size
        out = np.zeros((len(images), s, s, 3), np.float32)
        for i, img in enumerate(np.asarray(images, np.uint8)):
            pil = Image.fromarray(img)
            short, long = sorted(pil.size)
            new_long = int(s * long / short)  # torchvision's Resize(s) on the shorter side
            w, h = (s, new_long) if pil.size[0] <= pil.size[1] else (new_long, s)
            pil = pil.resize((w, h), Image.BICUBIC)
            left, top = round((w - s) / 2.0), round((h - s) / 2.0)
            out[i] = np.asarray(pil.crop((left, top, left + s, top + s)), np.float32) / 255.0
        return (out - MEAN) / STD

    def image_embeddings(self, images: np.ndarray) -> np.ndarray:
        return apply_batched(self._image, self.state, self.preprocess(images), self.batch_size)

    def text_embeddings(self, texts: list[str]) -> np.ndarray:
        return apply_batched(self._text, self.state, self.tokenizer(texts), self.batch_size)

    def scores(self, images: np.ndarray, texts: list[str]) -> np.ndarray:
        """100 * cos per (image, caption) pair (signed; `clip_score` reduces them)."""
        return pair_scores(self.image_embeddings(images), self.text_embeddings(texts))


def pair_scores(image_embeddings: np.ndarray, text_embeddings: np.ndarray) -> np.ndarray:
    """100 * cos per row pair of image and caption embeddings (not clamped)."""
    a, b = image_embeddings, text_embeddings
    return 100.0 * (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def clip_score(image_embeddings: np.ndarray, text_embeddings: np.ndarray) -> float:
    """The CLIP score of a set of samples as torchmetrics computes it: max(mean of 100 * cos, 0)."""
    return max(float(pair_scores(image_embeddings, text_embeddings).mean()), 0.0)


@lru_cache(maxsize=None)  # per config: every loaded copy of the same shape shares the compilations
def _encoders(cfg: CLIPConfig):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: CLIP(cfg, nnx.Rngs(0))))
    return (
        jax.jit(lambda state, x: nnx.merge(graphdef, state).encode_image(x)),
        jax.jit(lambda state, ids: nnx.merge(graphdef, state).encode_text(ids)),
    )


@dataclass
class ClipEvalConfig(OptionConfig):
    """eval.clip: the CLIP network and its BPE, a local `.npz` of converted weights; nothing is
    downloaded."""

    RANGES = {"batch_size": "[1, inf)"}

    weights: Optional[str] = None  # CLIP weights and BPE (.npz from dalle-ablate convert-clip); needed for clip
    batch_size: int = 32  # images (or captions) per forward pass

    def validate(self, run: Any) -> None:
        check(
            bool(self.weights),
            f"eval.metrics has clip but eval.clip.weights is not set: give CLIP weights (.npz; {HINT})",
        )
        existing(self.weights, "eval.clip.weights", HINT)


def clip_setup(settings: ClipEvalConfig, eval_cfg) -> dict:
    return {"scorer": CLIPScorer(settings.weights, "eval.clip.weights", settings.batch_size)}


@evaluator(
    "clip",
    "samples",
    settings=ClipEvalConfig,
    setup=clip_setup,
    metrics=[
        Metric("score", "CLIP score of the images against their captions", "100 x cosine", "higher", headline=4),
    ],
)
def clip_evaluator(images: np.ndarray, ctx: SamplesContext) -> dict:
    """eval.metrics=[clip]: CLIP score as torchmetrics': 100 * cos of image and caption
    embeddings, mean over the samples, the mean clamped at 0."""
    state = ctx.cache["clip"]
    scorer = state["scorer"]
    if "text" not in state:  # the prompts are fixed for the Evaluation's life: encode them once
        state["text"] = scorer.text_embeddings(ctx.prompts)
    return {
        "score": clip_score(scorer.image_embeddings(images), state["text"][: len(images)]),
        "n": float(len(images)),
        "weights": scorer.hash,
    }
