"""Every config file composes; user mistakes fail with one line naming the field and choices."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CONF, compose, run_config, run_py

from dalle_ablate.registry import ConfigError
from dalle_ablate.validate import to_run_config

GROUPS = ["model", "size", "optim", "schedule", "data", "tracker", "experiment", "eval", "mesh"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_config_file_composes(group, option):
    extra = ["data.path=/nonexistent"] if option == "parquet" else []
    extra += ["model=dalle"] if option == "dalle12b" else []  # the single-stream family's size
    cfg = compose(f"{group}={option}", *extra)
    assert cfg.model.layout in options("model")
    run = to_run_config(cfg)  # typed and validated
    if group == "model":  # a layout preset of the seq2seq family, or a family's own preset
        assert run.model.layout == option if run.model.family == "seq2seq" else run.model.family == "single_stream"
    if group == "optim":
        assert run.optim.name == option
    if group == "schedule":
        assert run.schedule.name == option
    if group == "data":
        assert run.data.name == option


def test_size_is_packaged_into_model():
    cfg = to_run_config(compose("size=mega", "model=normformer"))
    assert (cfg.model.d_model, cfg.model.encoder_layers, cfg.model.heads, cfg.model.ffn_dim) == (2048, 24, 16, 4096)
    assert cfg.model.layout == "normformer" and cfg.model.image_vocab == 16384 and cfg.model.image_len == 256


def test_registry_errors_name_field_and_choices():
    with pytest.raises(
        ConfigError, match=r"model.activation='nosuch' is not a known activation; valid: gelu, relu, smelu, swish"
    ):
        run_config("model.activation=nosuch")
    with pytest.raises(ConfigError, match=r"model.norm='batchnorm' is not a known norm; valid: layernorm, rmsnorm"):
        run_config("model.norm=batchnorm")


def test_illegal_combinations_name_both_flags():
    with pytest.raises(ConfigError, match=r"model.final_ln_encoder=true conflicts with model.layout=deepnet"):
        run_config("model=deepnet", "model.final_ln_encoder=true")
    with pytest.raises(ConfigError, match=r"model.final_ln_decoder=false conflicts with model.layout=preln"):
        run_config("model=preln", "model.final_ln_decoder=false")
    # ... unless asked for, as the Mega study's ablation of that very finding
    assert not run_config(
        "model=preln", "model.final_ln_decoder=false", "model.require_final_ln_decoder=false"
    ).model.final_ln_decoder
    with pytest.raises(ConfigError, match=r"model.d_model=30 is not divisible by model.heads=4"):
        run_config("model.d_model=30", "model.heads=4")
    with pytest.raises(ConfigError, match=r"trainer.batch_size=8 is not divisible by trainer.grad_accum=3"):
        run_config("trainer.grad_accum=3")


def _one_line_error(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # Nothing else: no traceback, and not Hydra's "Error executing job with overrides: [...]" above it.
    assert proc.stderr.strip() == lines[0], proc.stderr
    return lines[0]


def test_unknown_option_lists_valid_layouts(tmp_path: Path):
    line = _one_line_error(run_py("model=nosuch", cwd=tmp_path))
    assert line == f"error: model=nosuch is not a known option of 'model'; valid: {', '.join(options('model'))}"


def test_unknown_field_lists_valid_fields(tmp_path: Path):
    line = _one_line_error(run_py("trainer.stepz=3", cwd=tmp_path))
    assert line.startswith("error: unknown field 'trainer.stepz'; valid fields of trainer: batch_size, ")
    assert "steps" in line


def test_bad_value_names_the_field(tmp_path: Path):
    line = _one_line_error(run_py("trainer.steps=many", cwd=tmp_path))
    assert line.startswith("error: bad value for 'trainer.steps'")


# Values the issue (#14) found accepted silently, and one per kind of range.
OUT_OF_RANGE = [
    (["trainer.eval_batches=0"], "trainer.eval_batches=0 must be in [1, inf) or null"),
    (["trainer.keep_checkpoints=0"], "trainer.keep_checkpoints=0 must be in [1, inf)"),
    (["seed=-1"], "seed=-1 must be in [0, inf)"),
    (["init_seed=-2"], "init_seed=-2 must be in [0, inf) or null"),
    (
        ["schedule.warmup_steps=100000", "trainer.steps=10"],
        "schedule.warmup_steps=100000 (after schedule.lr_offset=0) is not shorter than trainer.steps=10: the learning rate "
        "would never reach optim.lr; shorten it, or set schedule.allow_long_warmup=true",
    ),
    (
        ["schedule.warmup_steps=4", "schedule.lr_offset=2"],
        "schedule.warmup_steps=4 (after schedule.lr_offset=2) is not shorter",
    ),
    (["optim.b2=1.0"], "optim.b2=1.0 must be in [0, 1)"),  # Adam's b2 = 1 never forgets: inf / 0
    (["optim=shampoo", "optim.b1=1.0"], "optim.b1=1.0 must be in [0, 1)"),
    (["optim=shampoo", "optim.lapack_threads=0"], "optim.lapack_threads=0 must be in [1, inf) or null"),
    (["optim=adafactor", "optim.decay_rate=0"], "optim.decay_rate=0.0 must be in (0, 1]"),
    (["optim=adafactor", "optim.momentum=1.5"], "optim.momentum=1.5 must be in [0, 1) or null"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be in [0, inf)"),
    (["schedule=cosine", "schedule.end_factor=2"], "schedule.end_factor=2.0 must be in [0, 1]"),
    (["data.num_train=0"], "data.num_train=0 must be in [1, inf)"),
    (["data.max_objects=12"], "data.max_objects=12 must be in [1, 9]"),
    (["data.min_objects=3", "data.max_objects=2"], "data.min_objects=3 exceeds data.max_objects=2"),
    (["data.mix=uniform"], "data.mix='uniform' is not one of tiers, counts"),
    (["data=parquet", "data.path=x", "data.valid_fraction=1"], "data.valid_fraction=1.0 must be in [0, 1)"),
]


@pytest.mark.parametrize("overrides,message", OUT_OF_RANGE)
def test_values_out_of_range_name_the_field_and_the_range(overrides, message):
    with pytest.raises(ConfigError) as err:
        run_config(*overrides, **({"data": ()} if "data=parquet" in overrides else {}))
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("mode", ["global", "per_block"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_scaling_without_float16_is_refused(mode, dtype):
    # issue #42: it trained silently (scaling is for float16's range; these dtypes have float32's)
    with pytest.raises(ConfigError) as err:
        run_config(f"trainer.grad_scaling={mode}", f"model.dtype={dtype}")
    assert str(err.value) == (
        f"trainer.grad_scaling={mode} conflicts with model.dtype={dtype}: gradient scaling is for "
        "float16 (set model.dtype=float16, or trainer.grad_scaling=none)"
    )
    assert run_config(f"trainer.grad_scaling={mode}", "model.dtype=float16").trainer.grad_scaling == mode


def test_a_long_warmup_runs_when_asked():
    cfg = run_config("schedule.warmup_steps=100", "schedule.allow_long_warmup=true")
    assert cfg.schedule.warmup_steps == 100 > cfg.trainer.steps
    assert run_config("trainer.eval_batches=null").trainer.eval_batches is None


def test_seed_out_of_range_is_one_line_and_exit_2(tmp_path: Path):
    line = _one_line_error(run_py("seed=-1", cwd=tmp_path))
    assert line == "error: seed=-1 must be in [0, inf)"


def test_a_key_added_with_plus_needs_a_schema_field():
    with pytest.raises(ConfigError) as err:
        run_config("+trainer.nosuch=1")
    assert str(err.value) == (
        "unknown field 'trainer.nosuch'; valid fields of trainer: batch_size, eval_batches, eval_every, "
        "grad_accum, grad_scale_growth_every, grad_scale_init, grad_scaling, keep_checkpoints, "
        "log_every, progress, save_every, steps, steps_per_dispatch"
    )
    with pytest.raises(ConfigError, match=r"^unknown field 'model.nosuch'; valid fields of model: .*\bd_model\b"):
        run_config("+model.nosuch=1")


def test_several_processes_need_a_coordinator():
    hint = (
        "needs distributed.coordinator_address (host:port of process 0, or JAX_COORDINATOR_ADDRESS), or "
        "distributed.auto=true on a cluster JAX detects (Cloud TPU, Slurm, Open MPI)"
    )
    with pytest.raises(ConfigError) as err:
        run_config("distributed.num_processes=2")
    assert str(err.value) == f"distributed.num_processes=2 {hint}"
    with pytest.raises(ConfigError) as err:
        run_config("distributed.process_id=1")
    assert str(err.value) == f"distributed.process_id=1 {hint}"
    assert run_config("distributed.num_processes=1").distributed.num_processes == 1
    d = run_config(
        "distributed.num_processes=2", "distributed.process_id=1", "distributed.coordinator_address=h:1"
    ).distributed
    assert (d.num_processes, d.process_id) == (2, 1)


def test_zero_steps_blames_the_steps_not_the_warmup():
    with pytest.raises(ConfigError) as err:
        run_config("trainer.steps=0")
    assert str(err.value) == "trainer.steps=0 must be positive"
    with pytest.raises(ConfigError) as err:
        run_config("trainer.steps_per_dispatch=0")
    assert str(err.value) == "trainer.steps_per_dispatch=0 must be positive"


def _composing_error(*overrides: str) -> str:
    from dalle_ablate.cli import format_error

    with pytest.raises(Exception) as err:
        compose(*overrides)
    return format_error(err.value)


def test_a_preset_setting_a_field_the_schema_lacks_keeps_the_key():
    assert (
        _composing_error("data=parquet", "experiment=quick")
        == "experiment=quick sets data.num_train, which ParquetDataConfig has no field for"
    )


def test_an_unquoted_list_keeps_hydras_hint_on_quoting():
    assert _composing_error("model.attention_pattern=row,nosuch") == (
        "model.attention_pattern=row,nosuch is ambiguous: for a list write model.attention_pattern=[row,nosuch]; for a "
        "string quote the value: \"model.attention_pattern='row,nosuch'\"; to sweep over it add --multirun"
    )


def test_distributed_auto_off_a_cluster_is_one_line(tmp_path: Path):
    line = _one_line_error(run_py("distributed.auto=true", cwd=tmp_path))
    assert line == (
        "error: distributed.auto=true, but JAX detects no cluster here (Cloud TPU, Slurm, Open MPI; it says: "
        "coordinator_address should be defined.); on other machines set distributed.coordinator_address, "
        "distributed.num_processes and distributed.process_id instead"
    )


def test_a_failed_multirun_job_is_one_line_naming_its_overrides(tmp_path: Path):
    # Hydra's "Error executing job with overrides: [...]" folded into the project's line.
    line = _one_line_error(run_py("-m", "seed=-1,-2", cwd=tmp_path))
    assert line == "error: seed=-1 must be in [0, inf) (job: seed=-1)"


def test_hydras_hints_after_its_first_line_are_kept():
    assert _composing_error("+trainer=x") == (
        "Could not append to config. An item is already at 'trainer'. Either remove + "
        "prefix: 'trainer=x'; Or add a second + to add or override 'trainer': "
        "'++trainer=x'"
    )


MEMBER_REFUSALS = [
    (["seeds=[0,0]"], "seeds=[0, 0] repeats a seed; each member must be a different run"),
    (["seeds=[]"], "seeds=[] lists no seed; give at least one (seeds=[0,1,2]), or leave seeds unset for one run"),
    (["seeds=[0,-1]"], "seeds=[0, -1]: every seed must be >= 0"),
    (["seeds=[0,1]", "members.impl=pmap"], "members.impl='pmap' is not valid; valid: vmap, map"),
    (["mesh.member=2"], "mesh.member=2 spreads the members of seeds=[...] over devices; without seeds it must be 1"),
    (
        ["seeds=[0,1,2]", "mesh.member=2"],
        "mesh.member=2 must be a positive divisor of the 3 members of seeds=[0, 1, 2]",
    ),
    (
        ["seeds=[0,1]", "optim.powersgd.rank=2"],
        "seeds=[...] with optim.powersgd.rank: PowerSGD's per-worker compression "
        "does not run as members; run its seeds as separate runs (seed=0,1,2)",
    ),
    (
        [
            "seeds=[0,1]",
            "distributed.num_processes=2",
            "distributed.coordinator_address=h:1",
            "distributed.process_id=0",
        ],
        "seeds=[...] runs in one process; a run of several processes (distributed.*) trains its seeds as separate runs",
    ),
]


@pytest.mark.parametrize("overrides,message", MEMBER_REFUSALS)
def test_members_refusals_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        run_config(*overrides)
    assert str(err.value) == message


def test_seeds_is_one_value_and_members_default_to_vmap():
    cfg = run_config("seeds=[3,1,4]")
    assert (cfg.seeds, cfg.members.impl, cfg.mesh.member) == ([3, 1, 4], "vmap", 1)
    assert run_config("seeds=[0,1]", "mesh.member=2", "members.impl=map").mesh.member == 2
    # a sweep's trial trains its seeds as members (tests/sweep/test_seeds.py): no longer refused
    assert run_config("seeds=[0,1]", "optuna.trial=3", "optuna.statistic=upper").optuna.trial == 3


def test_shampoo_runs_as_members_under_map_only():
    with pytest.raises(ConfigError) as err:
        run_config("optim=shampoo", "seeds=[0,1]")
    assert str(err.value) == (
        "optim=shampoo with seeds=[...] runs only with members.impl=map: under vmap its root refresh "
        "would run at every step as two batched eighs (the CPU deadlock of optim/inverse_roots.py), "
        "and float64 roots do not compile"
    )
    assert run_config("optim=shampoo", "seeds=[0,1]", "members.impl=map").members.impl == "map"
