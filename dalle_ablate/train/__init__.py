"""Training: the jitted step, the run assembly, the loop, checkpoints, and the evaluation of a
saved checkpoint. The Hydra task function that calls it is `dalle_ablate.job.run`."""
