"""FLOPs of the seq2seq model, from the config alone (no model built).

Counts matmul FLOPs (2 per multiply-add) of the forward pass; a training step costs 3x the
forward (backward = 2x forward), the convention of Kaplan et al. 2020 (arXiv 2001.08361) and of
MFU in PaLM (arXiv 2204.02311, appendix B). Attention scores are counted over the full square
(as the dense kernels compute them), norms, softmax and embeddings lookups are not counted.
"""

from __future__ import annotations

from dalle_ablate.model.seq2seq import padded


def forward_flops_per_example(cfg) -> int:
    d, f, t, i = cfg.d_model, cfg.ffn_dim, cfg.text_len, cfg.image_len
    ffn_mats = 3 if cfg.glu else 2
    enc = cfg.encoder_layers * (4 * t * d * d + 2 * t * t * d + ffn_mats * t * d * f)
    dec_self = 4 * i * d * d + 2 * i * i * d
    dec_cross = 2 * i * d * d + 2 * t * d * d + 2 * i * t * d
    dec = cfg.decoder_layers * (dec_self + dec_cross + ffn_mats * i * d * f)
    head = i * d * padded(cfg.image_vocab + 1, cfg.vocab_pad_multiple)
    return 2 * (enc + dec + head)


def train_flops_per_example(cfg) -> int:
    return 3 * forward_flops_per_example(cfg)
