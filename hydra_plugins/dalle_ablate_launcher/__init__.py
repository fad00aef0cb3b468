"""Hydra discovers this plugin (the `hydra_plugins` namespace package): `hydra/launcher=ray`,
`slurm`, `slurm_tpu` and `slurm_local` run a sweep's trials on a cluster (dalle_ablate/launch/).
The SLURM presets need the `cluster` extra (hydra-submitit-launcher's parameters); without it they
are not offered, and `ray` says what to install when it is used."""

from hydra.core.config_store import ConfigStore

from dalle_ablate.launch import ray_tasks

ConfigStore.instance().store(
    group="hydra/launcher", name="ray", node=ray_tasks.RayLauncherConf, provider="dalle-ablate"
)


class RayLauncher(ray_tasks.RayLauncher):
    """Hydra instantiates launchers only from the hydra_plugins package; the code is the library's."""


try:
    from dalle_ablate.launch import submitit_jobs
except ImportError:  # no hydra-submitit-launcher: pip install -c constraints.txt -e '.[cluster]'
    pass
else:
    for name, node in (
        ("slurm", submitit_jobs.SlurmConf),
        ("slurm_tpu", submitit_jobs.SlurmTpuConf),
        ("slurm_local", submitit_jobs.LocalConf),
    ):
        ConfigStore.instance().store(group="hydra/launcher", name=name, node=node, provider="dalle-ablate")

    class SubmititLauncher(submitit_jobs.SubmititLauncher):
        """As RayLauncher: the class Hydra instantiates, the library's code."""
