"""dalle-ablate: an ablation harness for DALL·E-style text-to-image transformers."""

__version__ = "0.1.0"
