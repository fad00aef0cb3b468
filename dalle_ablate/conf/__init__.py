"""The Hydra config groups, shipped inside the package (`pkg://dalle_ablate.conf`) so that an
installed wheel composes the same configs as a source checkout. One folder per group; each YAML
file starts from a schema: the run's own sections are in `dalle_ablate/config.py`, each option's
(an optimizer, schedule, dataset, tracker, model family) in its module, registered as
`schema/<group>_<name>` by `Registry.option`."""
