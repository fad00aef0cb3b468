"""`dalle-ablate encode` writes dalle-mini-format parquet that the trainer reads back end to end; `dalle-ablate eval`
names a checkpoint it cannot restore. The help of `python run.py` and of `dalle-ablate` speaks to users, and
help or a typo answers without loading what no verb needs for it."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import CONF, ROOT, SMALL_DATA, TINY_TRAIN, compose, run_config, run_py
from dalle_ablate.cli import main
from dalle_ablate.train.loop import JobInfo, train


def test_encode_then_train_on_parquet(tmp_path, small_dataset, capsys):
    out = tmp_path / "pq"
    main(["encode", "--out", str(out), *SMALL_DATA, "model.text_len=24"])
    assert "train on it: python run.py data=parquet" in capsys.readouterr().out
    table = pq.read_table(out / "valid.parquet")
    assert table.column("caption").to_pylist() == small_dataset.captions["valid"]
    assert np.array_equal(np.array(table.column("encoding").to_pylist()), small_dataset.codes["valid"])
    cfg = run_config(
        "data=parquet",
        f"data.path={out}/train.parquet",
        f"data.valid_path={out}/valid.parquet",
        "data.image_vocab=145",
        f"data.codebook_path={out}/codebook.npz",
        f"data.tokenizer_path={out}/tokenizer.json",
        "data.shuffle_buffer=64",
        "tracker=none",
        data=(),
    )
    res = train(cfg, JobInfo(tmp_path / "job"))
    assert res.status == "finished" and np.isfinite(res.eval_loss)
    assert (res.run_dir / "media" / "samples_grid_6.png").is_file()
    meta = json.loads((res.run_dir / "meta.json").read_text())
    assert meta["data"]["image_len"] == small_dataset.image_len == 36 and meta["data"]["files"] == 1


def test_cli_errors_are_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dalle_ablate.cli", "encode", "--out", str(tmp_path), "data.patch_size=7"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: data.patch_size=7 does not divide data.image_size=48"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A three-step run with one checkpoint (step 3)."""
    tmp = tmp_path_factory.mktemp("trained")
    proc = run_py(*SMALL_DATA, *TINY_TRAIN, "trainer.steps=3", "tracker=none", cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "outputs" / "run"


def _halve(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.slow
@pytest.mark.parametrize("torn", ["metadata", "arrays"])
def test_eval_of_a_truncated_checkpoint_names_it_in_one_line(trained, tmp_path, torn):
    import shutil

    job = shutil.copytree(trained, tmp_path / "job")
    step = job / "run" / "checkpoints" / "3"
    if torn == "metadata":
        _halve(step / "default" / "_METADATA")
    else:  # the largest file of the arrays' OCDBT database
        _halve(max((step / "default").rglob("ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size))
    proc = subprocess.run(
        [sys.executable, "-m", "dalle_ablate.cli", "eval", str(job), "tracker=none"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    head = f"error: {step}: the checkpoint of step 3 cannot be restored (truncated or corrupt?): "
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(head), proc.stderr[-3000:]
    why = proc.stderr[len(head) :]
    if torn == "metadata":
        assert why.startswith("JSONDecodeError: ")
    else:
        assert why.startswith("ValueError: OUT_OF_RANGE: Error reading ") and f'at local file "{step}/default/"' in why


def test_a_ctrl_c_lets_a_study_s_child_finish_what_it_does_on_one(tmp_path):
    """call_child (the study's multirun and stress runs): on Ctrl-C the child, which gets the same
    interrupt from the terminal, may save and exit; subprocess.call would SIGKILL it after 0.25 s.
    The interrupt still reaches the caller once the child is gone."""
    import signal
    import threading

    from dalle_ablate.study.children import call_child

    done = tmp_path / "saved"
    child = f"import time, pathlib; time.sleep(1.5); pathlib.Path({str(done)!r}).write_text('x')"
    # Python's own Ctrl-C handler, also where the suite runs as a background job (SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            call_child([sys.executable, "-c", child], dict(os.environ))
    finally:
        signal.signal(signal.SIGINT, before)
    assert done.read_text() == "x"


def test_a_sigterm_to_a_study_alone_is_passed_on_to_its_child_which_saves(tmp_path, monkeypatch):
    """A scheduler may send SIGTERM to the study's process alone (Kubernetes: the container's first
    process): call_child passes it on to the child, which stops as a run does on one (here: says it
    saved, exits 143), and the study stops saying SIGTERM, exit 143. Without it the child trained
    on until the grace period (50 s here) killed it, unsaved."""
    import signal
    import threading
    import time

    from dalle_ablate import interrupts
    from dalle_ablate.study.children import call_child

    monkeypatch.setitem(interrupts._state, "terminated", False)  # this process's record, as it was after the test
    done, ready = tmp_path / "saved", tmp_path / "ready"
    child = (
        "import pathlib, signal, sys, time\n"
        "def term(*_):\n"
        f"    pathlib.Path({str(done)!r}).write_text('saved')\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        f"pathlib.Path({str(ready)!r}).write_text('')\n"
        "time.sleep(60)\n"
    )

    def terminate_when_ready():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with interrupts.taken_at_checks():
            threading.Thread(target=terminate_when_ready, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                call_child([sys.executable, "-c", child], dict(os.environ), grace=50)
            assert (interrupts.word(), interrupts.exit_code()) == ("terminated (SIGTERM)", 143)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert done.read_text() == "saved"


@pytest.mark.slow
def test_eval_builds_on_the_runs_saved_config_not_on_defaults_changed_since(trained, tmp_path, monkeypatch):
    """A default that changes after a run (here the sampling noise's seed, `EvalConfig.seed`)
    leaves how `dalle-ablate eval` evaluates the run's checkpoint alone: the same config and the
    same numbers; what the command line asks for still applies."""
    import shutil

    import yaml
    from hydra.core.config_store import ConfigStore

    from dalle_ablate.evaluate import EvalConfig
    from dalle_ablate.train.eval_checkpoint import evaluate_checkpoint

    job = shutil.copytree(trained, tmp_path / "job")
    asked = ["tracker=none", "eval.metrics=[shapes]", "eval.guidance_scales=[3]"]
    out = evaluate_checkpoint(str(job), asked)
    before = yaml.safe_load((out / "config.yaml").read_text())
    table = json.loads((out / "tables" / "eval_pareto_3.json").read_text())
    assert before["eval"]["seed"] == 0 and before["eval"]["guidance_scales"] == [3.0]
    # The release after the run draws its evaluation noise from seed 5 (the schema as a new
    # process would store it); put back after the test.
    store = ConfigStore.instance().repo["schema"]
    monkeypatch.setitem(store, "eval.yaml", store["eval.yaml"])
    ConfigStore.instance().store(group="schema", name="eval", node=EvalConfig(seed=5))
    assert compose("tracker=none").eval.seed == 5
    out = evaluate_checkpoint(str(job), [*asked[:-1], "eval.guidance_scales=[3,5]"])
    after = yaml.safe_load((out / "config.yaml").read_text())
    assert after["eval"]["guidance_scales"] == [3.0, 5.0]
    after["eval"]["guidance_scales"] = [3.0]
    assert after == before
    again = json.loads((out / "tables" / "eval_pareto_3.json").read_text())
    assert again["columns"] == table["columns"] and [r[again["columns"].index("scale")] for r in again["rows"]] == [
        3.0,
        5.0,
    ]
    assert again["rows"][0] == table["rows"][0]


@pytest.mark.slow
def test_an_evaluator_registered_from_a_test_file_scores_every_scale(trained, tmp_path, monkeypatch):
    """docs/architecture.md's recipe for an evaluator, from this file alone: registered with
    `@evaluator`, chosen by `eval.metrics`, it is handed each guidance scale's decoded images and
    what it returns is that scale's row of the Pareto table."""
    import shutil

    from dalle_ablate.evaluate import EVALUATORS, evaluator
    from dalle_ablate.train.eval_checkpoint import evaluate_checkpoint

    monkeypatch.setattr(EVALUATORS, "_items", dict(EVALUATORS._items))  # the registration ends with the test
    seen = []

    @evaluator("toy_brightness", "samples")
    def toy_brightness(images, ctx):
        seen.append(np.asarray(images))
        return {"mean": float(np.mean(images)), "n_images": float(len(images))}

    job = shutil.copytree(trained, tmp_path / "job")
    out = evaluate_checkpoint(
        str(job), ["tracker=none", "eval.metrics=[toy_brightness]", "eval.num_samples=8", "eval.guidance_scales=[1,3]"]
    )
    table = json.loads((out / "tables" / "eval_pareto_3.json").read_text())
    col = {c: table["columns"].index(c) for c in table["columns"]}
    assert [r[col["scale"]] for r in table["rows"]] == [1.0, 3.0] and len(seen) == 2
    assert all(x.ndim == 4 and x.shape[0] == 8 and x.shape[-1] == 3 for x in seen)  # 8 RGB images per scale
    for row, images in zip(table["rows"], seen):
        assert row[col["toy_brightness/n_images"]] == 8.0
        assert row[col["toy_brightness/mean"]] == pytest.approx(float(images.mean()))


def _saved_run(tmp_path, edit) -> tuple:
    """A run store's saved config, as a run with these overrides wrote it, edited by `edit`."""
    import yaml
    from omegaconf import OmegaConf

    recorded = ["tracker=none", "eval.num_samples=8"]
    saved = OmegaConf.to_container(compose(*recorded), resolve=True)
    edit(saved)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    return tmp_path, recorded


def test_eval_config_takes_todays_default_for_a_field_new_since_the_run_and_names_it(tmp_path, capsys):
    from dalle_ablate.train.eval_checkpoint import run_config_for_eval

    def older(saved):
        saved["eval"]["num_samples"] = 16  # a value the recorded overrides do not give
        del saved["eval"]["top_p"]  # a field added after the run

    store, recorded = _saved_run(tmp_path, older)
    cfg = run_config_for_eval(store, recorded, ["eval.batch_size=4"])
    assert (cfg.eval.num_samples, cfg.eval.top_p, cfg.eval.batch_size) == (16, None, 4)
    assert (
        capsys.readouterr().err
        == f"note: {store / 'config.yaml'} predates eval.top_p: evaluated with today's default\n"
    )


@pytest.mark.parametrize("case", ["missing", "not yaml", "removed field", "wrong type"])
def test_eval_of_a_run_whose_saved_config_cannot_be_used_is_one_line(tmp_path, case):
    from dalle_ablate.registry import ConfigError
    from dalle_ablate.train.eval_checkpoint import run_config_for_eval

    edits = {
        "missing": lambda s: None,
        "not yaml": lambda s: None,
        "removed field": lambda s: s["eval"].update(old_knob=1),
        "wrong type": lambda s: s["eval"].update(seed="abc"),
    }
    store, recorded = _saved_run(tmp_path, edits[case])
    file = store / "config.yaml"
    if case == "missing":
        file.unlink()
    elif case == "not yaml":
        file.write_text("eval: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        run_config_for_eval(store, recorded, [])
    assert (
        str(e.value)
        == {
            "missing": f"{file}: missing; eval builds a run's config from the config.yaml its run store saved",
            "not yaml": f"{file}: cannot be read (ParserError: while parsing a flow sequence)",
            "removed field": f"{file}: eval.old_knob is not a field of today's config (removed or renamed since the run)",
            "wrong type": f"{file}: eval.seed: Value 'abc' of type 'str' could not be converted to Integer",
        }[case]
    )


def test_ctrl_c_in_a_verb_is_one_line_and_exit_130(monkeypatch, capsys):
    """A study stopped with Ctrl-C: one line saying how to continue, not the traceback of the
    wait for its child."""
    from dalle_ablate import cli

    def interrupted(args):
        raise KeyboardInterrupt

    _, arguments, kwargs = cli.VERBS["study"]
    monkeypatch.setitem(cli.VERBS, "study", (interrupted, arguments, kwargs))
    with pytest.raises(SystemExit) as e:
        cli.main(["study", "mega-variants", "--no-run"])
    assert e.value.code == 130
    assert capsys.readouterr().err == "dalle-ablate study interrupted; run the same command again\n"  # not an error


# -- help, and how much a command loads before it answers (issue 53) -------------------------------


def _docs_named(text: str) -> list[str]:
    """The repository files a help text sends its reader to."""
    return re.findall(r"\b(?:README\.md|docs/[\w/.-]+\.md)", text)


def test_run_py_help_says_what_it_is_the_groups_to_choose_three_examples_and_the_docs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert text.startswith("python run.py: train a DALL·E-style text-to-image transformer"), text[:200]
    # Hydra's generic parts are gone: its config dump (`--cfg job` prints it) and the presets' internal schema group.
    assert "== Config ==" not in text and "Powered by Hydra" not in text and "schema" not in text
    # Every config group of the package, each with every option it has.
    groups = text.split("Config groups (group=option):\n")[1].split("\n\n")[0]
    listed = dict(re.findall(r"^  (\+?\w+)=  .*\n((?:^ {15}\S.*\n?)+)", groups, re.M))
    assert sorted(g.lstrip("+") for g in listed) == sorted(p.name for p in CONF.iterdir() if any(p.glob("*.yaml"))), (
        groups
    )
    for group, options in listed.items():
        assert " ".join(options.split()).split(", ") == sorted(
            p.stem for p in (CONF / group.lstrip("+")).glob("*.yaml")
        )
    assert "+arm" in listed and "model" in listed  # `+` where the defaults list has no entry for the group
    # Three example commands, each of which composes (a multirun by the first value of each list).
    examples = [
        line.strip() for line in text.split("Examples:\n")[1].splitlines() if line.strip().startswith("python run.py")
    ]
    assert len(examples) == 3, examples
    from dalle_ablate.validate import to_run_config

    for cmd in examples:
        to_run_config(compose(*[t.split(",")[0] for t in shlex.split(cmd)[2:] if not t.startswith("-")]))
    assert "docs/quickstart.md" in text and "docs/reference/config.md" in text
    assert all((ROOT / path).is_file() for path in _docs_named(text)), _docs_named(text)


def test_dalle_ablate_help_speaks_to_users(capsys):
    from dalle_ablate import cli

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert cli.__doc__.splitlines()[0] not in text  # the module's docstring is for developers
    assert text.startswith("usage: dalle-ablate [-h] VERB ...\n\ndalle-ablate: ") and "python run.py" in text
    assert all(f"\n    {name} " in text or f"\n    {name}\n" in text for name in cli.VERBS), text
    examples = [
        line.strip() for line in text.split("examples:\n")[1].splitlines() if line.startswith("  dalle-ablate ")
    ]
    assert len(examples) == 3, examples
    for example in examples:  # each a verb's valid command line
        argv = shlex.split(example)[1:]
        assert cli.build_parser().parse_args(argv).verb == argv[0]
    assert "docs/reference/cli.md" in text and all((ROOT / path).is_file() for path in _docs_named(text))


# What `--help` and a typo need not load: JAX and its libraries, scipy, the config schemas, the trainer.
HEAVY = ("jax", "flax", "optax", "orbax", "scipy", "wandb", "dalle_ablate.validate", "dalle_ablate.train.loop")
LOADED = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    if sys.argv[0] == "run.py":
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        from dalle_ablate.cli import main
        main(sys.argv[1:])
except SystemExit as e:
    print("exit", e.code, file=sys.stderr)
print("loaded:", *sorted(m for m in %r if m in sys.modules), file=sys.stderr)
""" % (HEAVY,)


@pytest.mark.parametrize(
    "argv,loaded",
    [
        (["dalle-ablate", "--help"], []),
        (["dalle-ablate", "report", "--help"], []),
        (["dalle-ablate", "repot"], []),
        (
            ["dalle-ablate", "plan", "--help"],
            ["flax", "jax", "optax"],
        ),  # its --device help lists the device table (parallel/)
        # Composing needs every option's schema, and the model families are Flax modules: the trainer, scipy and W&B wait.
        (["run.py", "--help"], ["dalle_ablate.validate", "flax", "jax", "optax"]),
        (["run.py", "modle=x"], ["dalle_ablate.validate", "flax", "jax", "optax"]),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0] in ("run.py", "dalle-ablate") else None,
)
def test_help_and_a_typo_load_only_what_they_need(argv, loaded):
    proc = subprocess.run([sys.executable, "-c", LOADED, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    *_, exit_line, modules = proc.stderr.splitlines()
    assert exit_line == f"exit {2 if argv[1] in ('repot', 'modle=x') else 0}", proc.stderr[-2000:]
    assert modules.split()[1:] == loaded


@pytest.mark.parametrize(
    "path, says",
    [
        ("{tmp}/gone", "no such file or folder (give a run dir, its run/ or run/checkpoints/)"),
        ("{tmp}", "no orbax checkpoint found there"),
        ("gs://Not_A_Bucket/x", "not a bucket URL this tool can use; give gs://<bucket>/<path>"),
    ],
)
def test_eval_names_the_path_it_was_given_not_resume(tmp_path, capsys, path, says):
    """Issue 72: `dalle-ablate eval` of a path with no checkpoint is a one-line error naming the
    path as the command took it, not as `resume=` (the trainer's field, which eval has none of)."""
    path = path.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["eval", path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: dalle-ablate eval {path}: {says}") and err.count("\n") == 1, err
