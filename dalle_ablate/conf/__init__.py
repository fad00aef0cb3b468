"""The Hydra config groups, shipped inside the package (`pkg://dalle_ablate.conf`) so that an
installed wheel composes the same configs as a source checkout. One folder per group; each YAML
file starts from its schema in `dalle_ablate/config.py`."""
