"""VQGAN (Esser et al. 2021, arXiv 2012.09841) in Flax: encode images to codes and decode codes to
images, with the layout of dalle-mini's `vqgan_imagenet_f16_16384` (taming-transformers'
ImageNet f16 model: 16384 codes of 256 dims, 256 px -> 16 x 16 codes). Weights load from a local
`.npz`; `convert_state_dict` maps a taming-transformers PyTorch state dict to it."""

from dalle_ablate.vqgan.model import VQGAN, VQGANConfig, convert_state_dict, load_vqgan, save_vqgan

__all__ = ["VQGAN", "VQGANConfig", "convert_state_dict", "load_vqgan", "save_vqgan"]
