"""`hydra/launcher=ray`: each job of a batch as Ray tasks on a Ray cluster ($RAY_ADDRESS, or one
started on this machine), one task per process of the job, the processes of one job held together
by a placement group. Why not the official hydra-ray-launcher (1.2.2, the latest): it pins
cloudpickle<3, which cannot install beside this project's pinned set (joblib and submitit take
cloudpickle 3.1), and it collects a batch with one `ray.get` over all of it, so one lost worker
raises out of the whole batch and ends the sweep. Here every task runs in a fresh worker process
(`max_calls=1`: JAX initialises once per process, with the job's own XLA flags and distributed
settings), is never retried by Ray (`max_retries=0`: a trial is retried by the sweeper, from its
checkpoint), and a lost worker or node fails only its own job (`WorkerLost`)."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Optional, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf

from dalle_ablate.launch.jobs import failed, lost, process_env, run_one, sweep_configs
from dalle_ablate.registry import ConfigError, RunFailed, first_line

log = logging.getLogger(__name__)
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class RayLauncherConf:
    _target_: str = "hydra_plugins.dalle_ablate_launcher.RayLauncher"
    # null: Ray's own rule -- $RAY_ADDRESS if set (a cluster started with `ray start --head`), else
    # a Ray instance started on this machine for the sweep.
    address: Optional[str] = None
    processes: int = 1  # processes per trial, one Ray task each: a mesh across hosts (distributed.*)
    num_cpus: float = 1  # per process
    num_gpus: float = 0  # per process
    # How a trial's processes are placed (Ray placement group strategy): STRICT_SPREAD puts each on
    # a node of its own, as one process per TPU host needs; PACK puts them where they fit.
    strategy: str = "PACK"
    env: dict = field(default_factory=dict)  # environment of every process, e.g. {XLA_FLAGS: ...}
    init: dict = field(default_factory=dict)  # more ray.init() arguments, e.g. {num_cpus: 4}


CONNECT_TIMEOUT = 10  # seconds: Ray itself retries an address that does not answer for minutes


def reachable(address: Optional[str]) -> None:
    """A Ray address given as host:port (or ray://host:port), from hydra.launcher.address or
    $RAY_ADDRESS, must accept a connection within CONNECT_TIMEOUT: RunFailed naming it if not."""
    field = "hydra.launcher.address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS")
    if not address or address in ("auto", "local"):
        return
    # Something that accepts connections there but is no Ray cluster: Ray tries for this many
    # seconds (one a second; 20 by default), not NUM_REDIS_GET_RETRIES.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(CONNECT_TIMEOUT))
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        return  # Ray's own error says what it expects
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as e:
        why = f"no answer in {CONNECT_TIMEOUT} s" if isinstance(e, socket.timeout) else first_line(e)
        raise RunFailed(
            f"{field}={address}: no Ray cluster can be reached there ({why}); start one with `ray start --head`, "
            "or leave the address unset to start Ray on this machine",
            RunFailed.FAILED,
        ) from None


def _free_address() -> str:
    """host:port for process 0's JAX coordinator, found on the node that runs process 0."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"


class RayLauncher(Launcher):
    def __init__(
        self,
        address: Optional[str] = None,
        processes: int = 1,
        num_cpus: float = 1,
        num_gpus: float = 0,
        strategy: str = "PACK",
        env: Optional[dict] = None,
        init: Optional[dict] = None,
    ):
        if processes < 1 or num_cpus < 0 or num_gpus < 0:
            raise ConfigError(
                f"hydra.launcher.processes={processes} must be >= 1, hydra.launcher.num_cpus={num_cpus} "
                f"and num_gpus={num_gpus} >= 0"
            )
        if strategy not in STRATEGIES:
            raise ConfigError(f"hydra.launcher.strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")

        def plain(d) -> dict:
            return OmegaConf.to_container(d, resolve=True) if OmegaConf.is_config(d) else dict(d or {})

        self.address, self.processes, self.strategy = address, processes, strategy
        self.resources = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        self.env = {str(k): str(v) for k, v in plain(env).items()}
        self.init = plain(init)

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def _connect(self):
        try:
            import ray
        except ImportError:
            raise ConfigError("hydra/launcher=ray needs Ray: pip install -c constraints.txt -e '.[cluster]'") from None
        if not ray.is_initialized():
            reachable(self.address)
            try:
                ray.init(address=self.address, **self.init)
            except ConnectionError as e:  # e.g. address=auto with no cluster started on this machine
                raise RunFailed(f"hydra/launcher=ray: {first_line(e)}", RunFailed.FAILED) from None
            log.info(
                f"Ray cluster: {ray.cluster_resources().get('CPU', 0):g} CPUs on "
                f"{sum(n['Alive'] for n in ray.nodes())} nodes"
            )
        return ray

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        ray = self._connect()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        configs = sweep_configs(self.hydra_context, self.config, job_overrides, initial_job_idx)
        task = ray.remote(max_calls=1, max_retries=0)(run_one)
        state, cwd = Singleton.get_state(), os.getcwd()
        groups, pending = [], {}  # ref -> (job, rank)
        returns: list[Optional[JobReturn]] = [None] * len(configs)
        try:
            for job, cfg in enumerate(configs):
                group = None
                if self.processes > 1:
                    bundle = {
                        "CPU": self.resources["num_cpus"],
                        **({"GPU": self.resources["num_gpus"]} if self.resources["num_gpus"] else {}),
                    }
                    group = placement_group([bundle] * self.processes, strategy=self.strategy)
                    groups.append(group)

                def at(rank: int, group=group) -> dict:
                    return (
                        {}
                        if group is None
                        else {
                            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                                placement_group=group, placement_group_bundle_index=rank
                            )
                        }
                    )

                coordinator = (
                    "" if group is None else ray.get(ray.remote(_free_address).options(num_cpus=0, **at(0)).remote())
                )
                for rank in range(self.processes):
                    env = {**self.env, **process_env(coordinator, self.processes, rank)}
                    ref = task.options(**self.resources, **at(rank)).remote(
                        self.hydra_context, self.task_function, cfg, state, cwd, env
                    )
                    pending[ref] = (job, rank)
            self._collect(ray, pending, returns, configs, job_overrides)
        finally:
            for ref in pending:  # Ctrl-C or an error here: no trial keeps running on the cluster
                ray.cancel(ref, force=True)
            for group in groups:
                remove_placement_group(group)
        return returns

    def _collect(
        self, ray, pending: dict, returns: list, configs: list, job_overrides: Sequence[Sequence[str]]
    ) -> None:
        """Each job's return as its tasks finish: process 0's JobReturn, or WorkerLost when any of its
        processes died (its other processes are then stopped: they would wait for it forever)."""
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            job, rank = pending.pop(ref)
            try:
                ret = ray.get(ref)
            except ray.exceptions.TaskCancelledError:
                continue  # a process of a job already lost
            except ray.exceptions.RayTaskError as e:  # the launcher's own code on the worker failed
                ret = failed(job_overrides[job], e.cause or e)
            except ray.exceptions.RayError as e:
                why = (
                    f"process {rank} of job #{configs[job].hydra.job.num} was lost: {type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0]}"
                )
                log.warning(why)
                returns[job] = lost(configs[job], job_overrides[job], why)
                for other, (j, _) in list(pending.items()):
                    if j == job:
                        ray.cancel(other, force=True)
                continue
            if rank == 0 and returns[job] is None:
                returns[job] = ret
