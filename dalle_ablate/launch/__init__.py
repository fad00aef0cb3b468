"""Where a sweep's trials run: Hydra launchers for clusters (`hydra/launcher=ray`, `slurm`,
`slurm_local`, `slurm_tpu`, registered by hydra_plugins/dalle_ablate_launcher). What they share
(jobs.py): the job's config and process environment for each process of a trial, and `WorkerLost`,
the return of a trial whose process or node died, which the sweeper records as FAILED and goes on."""
