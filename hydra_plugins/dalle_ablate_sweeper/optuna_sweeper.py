"""Hydra discovers this plugin (the `hydra_plugins` namespace package): `hydra/sweeper=optuna`
is the project's Optuna sweeper (dalle_ablate/sweep/sweeper.py). The ready-made sweeps
(`sweeps=lr_shampoo`) are a group of the package's own configs (dalle_ablate/conf/sweeps/)."""

from hydra.core.config_store import ConfigStore

from dalle_ablate.sweep import sweeper as impl

ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=impl.OptunaSweeperConf, provider="dalle-ablate")


class OptunaSweeper(impl.OptunaSweeper):
    """Hydra instantiates sweepers only from the hydra_plugins package; the code is the library's."""
