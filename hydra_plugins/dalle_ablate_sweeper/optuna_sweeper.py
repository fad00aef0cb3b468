"""Hydra discovers this plugin (the `hydra_plugins` namespace package): `hydra/sweeper=optuna`
is the project's Optuna sweeper (dalle_ablate/sweep/sweeper.py), and the repository root is on
the config search path so that `sweeps/` is a config group (`+sweeps=lr_shampoo`)."""

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.plugins.search_path_plugin import SearchPathPlugin

from dalle_ablate.sweep import sweeper as impl

ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=impl.OptunaSweeperConf, provider="dalle-ablate")


class OptunaSweeper(impl.OptunaSweeper):
    """Hydra instantiates sweepers only from the hydra_plugins package; the code is the library's."""


ROOT = Path(__file__).resolve().parents[2]


class ProjectSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if (ROOT / "sweeps").is_dir():
            search_path.append(provider="dalle-ablate", path=f"file://{ROOT}")
