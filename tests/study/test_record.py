"""A study's record (study/record.py, study/kept.py, study/declaration.py, study/identity.py,
study/clock.py): a run's entry read back as the run it was, by the page and by pandas; a torn
file refused alone; the code digest against git's own blob ids; each edit of a frozen design
refused in one line; and a small study end to end -- its page from the record the same bytes as
from its run stores and as a newcomer's from the record alone, the record's refusals, and the
study split over invocations in three folders (a time limit that stops a job, one that starts
none, a job through Ray) recording the same runs, stage 2's plan and verdicts as one invocation."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import AT_THE_END, SMALL_DATA, TINY_TRAIN, replacing
from dalle_ablate.registry import ConfigError
from dalle_ablate.report.study_file import load_study
from dalle_ablate.report.load import load_run, series
from dalle_ablate.report.page import in_folder, write_page
from dalle_ablate.report.transitions import Rule
from dalle_ablate.study import declaration, identity
from dalle_ablate.study.clock import Clock, parse_duration
from dalle_ablate.study.record import METRICS, RUNS, STRESS, Record, dumps, entry_of, final_columns, loads, run_of

STUDY = {
    "name": "tiny",
    "title": "A tiny study",
    "source": "s",
    "experiment": "study_mega",
    "baseline": "baseline",
    "findings": [
        {
            "id": "bias-loss",
            "claim": "biases hurt",
            "arm": "bias",
            "against": "baseline",
            "metric": "eval_loss",
            "expect": "higher",
            "margin": "2%",
        },
        {
            "id": "bias-stable",
            "claim": "biases are stabler",
            "arm": "bias",
            "against": "baseline",
            "metric": "lr_sensitivity",
            "expect": "lower",
            "margin": "10%",
        },
    ],
    "stages": {
        "declared": "in the test, before stage 1",
        "budget": {"runs": 2},
        "seeds_from": 10,
        "cap": 2,
        "w1": 0.8,
        "boundaries": "asOF",
        "rule": "even",  # stage 2 trains: the open finding's two arms a seed each
    },
    "stress": {
        "claims": ["bias-stable"],
        "lr": [1e-3, 1e-2, 1e-1],
        "seeds": [7],
        "steps": 4,
        "overrides": ["eval.metrics=[]", "eval.grids=[]"],
    },
}
# The suite's tiny runs with one validation and one checkpoint each, at their last step (a run's
# hooks all run there; the record, the page and stage 2's plan read the final evaluation), and one
# decoder layer: each of this file's ~20 child runs traces and loads (or compiles: every stress
# rate is a program of its own) a smaller step. The record's path is the same at any size.
TRAIN = replacing(TINY_TRAIN, *AT_THE_END, "model.decoder_layers=1")
ARGS = ["+arm=baseline,bias", "seed=0,1", *SMALL_DATA, *TRAIN, "tracker=none"]
TIMES = ("wall_time",)  # measured, not computed: what two trainings of one run differ in


def write_study(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump({**STUDY, **changes}, sort_keys=False))
    return path


def study(cwd: Path, *extra: str, record: str = "rec") -> subprocess.CompletedProcess:
    """`dalle-ablate study tiny.yaml --record rec ...` in `cwd`, every path relative to it (a clone)."""
    cmd = [sys.executable, "-m", "dalle_ablate.cli", "study", "../tiny.yaml", "--record", record]
    cmd += ["--report-out", "reports", "--page-out", "results", *ARGS, *extra]  # extra's +arm= chooses
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900, env=dict(os.environ))


# -- an entry and its file ------------------------------------------------------------------------
def synthetic_store(root: Path) -> Path:
    """A run store with what a page reads: float32 losses (one NaN, one inf), float64 step times,
    an evaluation's tables, members."""
    store = root / "bias-seed3" / "run"
    (store / "tables").mkdir(parents=True)
    loss = np.float32(4.97) - np.arange(1, 31, dtype=np.float32) * np.float32(0.0123)
    rows = [
        {"step": s, "train/loss": float(loss[s - 1]), "perf/step_time": 0.07 + s * 1.1e-9, "train/lr": 1e-3}
        for s in range(1, 31)
    ]
    rows[4]["train/loss"], rows[9]["train/loss"] = math.nan, math.inf
    rows += [{"step": s, "eval/valid/loss": float(np.float32(1 / s))} for s in (10, 20, 30)]
    (store / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (store / "config.yaml").write_text(yaml.safe_dump({"seed": 3, "optim": {"lr": 1e-3, "betas": [0.9, 0.99]}}))
    meta = {
        "overrides": ["+arm=bias", "seed=3"],
        "params": 10,
        "git": {"commit": "abc", "dirty": False},
        "members": {"seeds": [3, 4], "job_dir": "/host/a/staging/bias-seed3"},
        "command": "not kept",
    }
    (store / "meta.json").write_text(json.dumps(meta))
    (store / "summary.json").write_text(json.dumps({"status": "finished", "wall_time": 12.5, "steps": 30}))
    for step in (20, 30):
        columns = ["run", "scale", "shapes/all", "shapes/all_lo", "shapes/n", "shapes/one/all", "shapes/one/n"]
        pareto = {
            "columns": columns,
            "rows": [["r", 1.0, 0.1, 0.05, 40, 0.2, 10], ["r", 2.0, step / 100, 0.1, 40, 0.3, 10]],
        }
        (store / "tables" / f"eval_pareto_{step}.json").write_text(json.dumps(pareto))
    examples = {"columns": ["example", "loss"], "rows": [[i, float(np.float32(0.3 + i / 7))] for i in range(5)]}
    (store / "tables" / "eval_valid_examples_30.json").write_text(json.dumps(examples))
    return store


def test_an_entry_reads_back_as_the_run_it_was_and_pandas_reads_it(tmp_path):
    run = load_run(synthetic_store(tmp_path))
    code = {"commit": "abc", "dirty": False, "numbers": "0" * 16, "libraries": {}}
    text = dumps(entry_of(run, "bias", 1, code, Rule()))
    path = tmp_path / "rec" / "bias-seed3.json"
    back = run_of(loads(text, path), path)
    for column in METRICS:  # every value as logged: NaN where none, inf kept, float32 losses exact
        want, got = series(run, column), series(back, column)
        assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1]), column
    assert back.config == run.config and back.summary == run.summary and back.seed == 3
    assert (
        back.pareto_steps == {s: final_columns(t) for s, t in run.pareto_steps.items()}
        and back.pareto == back.pareto_steps[30]
    )
    assert back.pareto["columns"] == ["scale", "shapes/all", "shapes/n", "shapes/one/all", "shapes/one/n"]
    assert np.array_equal(back.valid_losses, run.valid_losses)
    assert back.meta["members"] == {"seeds": [3, 4], "job_dir": "bias-seed3"}  # the job, not the host's path
    assert "command" not in back.meta
    assert dumps(loads(text, path)) == text  # deterministic: the same entry, the same bytes
    assert "4.9577" in text and "4.957700" not in text  # a float32 loss in its own shortest digits
    # pandas, without this package: the train steps' curves one row per step, the evaluations' one per evaluation
    frame, evals = (pd.DataFrame(json.loads(text)[k]) for k in ("metrics", "evals"))
    assert list(frame.columns) == ["perf/step_time", "step", "train/loss"] and frame["step"].tolist() == list(
        range(1, 31)
    )
    assert evals.to_dict("list") == {"eval/valid/loss": [0.1, 0.05, 0.033333335], "step": [10, 20, 30]}
    assert frame["perf/step_time"].iloc[-1] == 0.07 and "0.07000003" not in text  # to the microsecond


def test_a_torn_record_file_is_refused_in_one_line_and_the_others_are_kept(tmp_path):
    run = load_run(synthetic_store(tmp_path))
    record = Record(str(tmp_path / "rec"))
    code = {"commit": "abc", "dirty": False, "numbers": "0" * 16, "libraries": {}}
    entry = entry_of(run, "bias", 1, code, Rule())
    record.add(RUNS, entry)
    record.add(RUNS, {**entry, "name": "bias-seed4", "seed": 4})
    whole = (tmp_path / "rec" / RUNS / "bias-seed4.json").read_bytes()
    torn = tmp_path / "rec" / RUNS / "bias-seed3.json"
    torn.write_bytes(torn.read_bytes()[:700])  # a copy cut off mid-file
    with pytest.raises(ConfigError) as e:
        record.entries(RUNS)
    assert str(e.value).startswith(f"{torn}: not valid JSON, half-written or corrupt (")
    assert str(e.value).endswith("delete it and the study trains that run again") and "\n" not in str(e.value)
    assert (tmp_path / "rec" / RUNS / "bias-seed4.json").read_bytes() == whole
    torn.write_text(json.dumps({"record": 1, "name": "bias-seed3"}))  # an edited one
    with pytest.raises(ConfigError, match=r"bias-seed3.json: a run's entry without arm, seed, stage, overrides"):
        record.entries(RUNS)


def test_a_record_in_a_bucket_is_read_back_whole_on_another_host(tmp_path, gcs, monkeypatch):
    """Each file a record writes in a bucket is uploaded whole; another host (its own staging
    root) reads the same entries, and a file the bucket holds torn is named in one line there."""
    run = load_run(synthetic_store(tmp_path))
    code = {"commit": "abc", "dirty": False, "numbers": "0" * 16, "libraries": {}}
    url = f"{gcs.url}/records/{tmp_path.name}"
    here = Record(url)
    here.freeze({"study": "tiny"})
    here.add(RUNS, entry_of(run, "bias", 1, code, Rule()))
    monkeypatch.setenv("DALLE_ABLATE_STAGING", str(tmp_path / "another-host"))
    there = Record(url)
    assert there.root != here.root and str(there) == url
    assert there.declaration() == {"study": "tiny"}
    assert dumps(there.entries(RUNS)["bias-seed3"]) == (here.root / RUNS / "bias-seed3.json").read_text()
    gcs.fs().pipe(f"{url}/{RUNS}/bias-seed3.json", b'{"record": 1, "na')  # cut off by a writer that is not ours
    with pytest.raises(ConfigError, match=r"bias-seed3.json: not valid JSON, half-written or corrupt \("):
        Record(url).entries(RUNS)


# -- the code's identity -------------------------------------------------------------------------
def test_the_code_digest_uses_gits_blob_ids_and_moves_only_with_the_code_that_decides_numbers(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    for path, text in {
        "dalle_ablate/model/layers.py": "x = 1\n",
        "dalle_ablate/report/page.py": "y = 2\n",
        "dalle_ablate/train/step.py": "z = 3\n",
        "dalle_ablate/train/meta.py": "w = 4\n",
    }.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True, text=True).stdout  # noqa: E731
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(identity, "ROOT", repo)
    blob = git("hash-object", "dalle_ablate/model/layers.py").strip()
    assert identity._blob((repo / "dalle_ablate/model/layers.py").read_bytes()) == blob  # git's own id
    first = identity.digest_at("HEAD")
    assert identity.digest_on_disk() == first
    for path in ("dalle_ablate/report/page.py", "dalle_ablate/train/meta.py"):  # no number changes with these
        (repo / path).write_text("changed = True\n")
    assert identity.digest_on_disk() == first
    (repo / "dalle_ablate/train/step.py").write_text("z = 4\n")  # the step: another digest
    assert identity.digest_on_disk() != first
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    assert identity.digest_at("HEAD") == identity.digest_on_disk() != identity.digest_at("HEAD~1") == first
    with pytest.raises(ConfigError, match=r"^commit 0123abc is not in this checkout's history, so the code"):
        identity.digest_at("0123abc")
    with pytest.raises(ConfigError, match=r"with uncommitted changes, which no record can identify"):
        identity.code_of({"commit": git("rev-parse", "HEAD~1").strip(), "dirty": True}, {}, "f" * 16)


# -- the frozen declaration -----------------------------------------------------------------------
CODE = {"numbers": "0" * 16, "libraries": {}}
FINDINGS = [
    *STUDY["findings"],
    {
        "id": "bias-3",
        "claim": "c",
        "arm": "bias",
        "against": "baseline",
        "metric": "eval_loss",
        "expect": "higher",
        "margin": "3%",
    },
]


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"findings": FINDINGS[1:]}, "findings: bias-loss gone (declared: bias-loss, bias-stable, bias-3)"),
        ({"findings": FINDINGS[:2]}, "findings: bias-3 gone (declared: bias-loss, bias-stable, bias-3)"),
        ({"stages": {**STUDY["stages"], "w1": 0.6}}, "stages.w1 is 0.6, declared 0.8"),
        ({"stages": {**STUDY["stages"], "boundaries": "P"}}, 'stages.boundaries is "P", declared "asOF"'),
        (
            {"findings": [*FINDINGS[:2], {**FINDINGS[2], "margin": "4%"}]},
            'findings.bias-3.margin is "4%", declared "3%"',
        ),
        ({"stress": {**STUDY["stress"], "seeds": [8]}}, "stress.seeds is [8], declared [7]"),
    ],
)
def test_each_edit_of_a_frozen_design_is_refused_naming_it(tmp_path, edit, message):
    """The three edits an independent simulation found to inflate the false-difference rate when
    they go through silently (dropping the findings that look null after look 1, keeping only the
    best, choosing w1 or the boundaries afterwards), a margin and the stress seeds."""
    frozen = declaration.declare(
        load_study(write_study(tmp_path / "a", findings=FINDINGS)), tmp_path / "a" / "tiny.yaml", [], CODE
    )
    path = write_study(tmp_path / "b", **{"findings": FINDINGS, **edit})
    now = declaration.declare(load_study(path), path, [], CODE)
    with pytest.raises(ConfigError) as e:
        declaration.check(frozen, now, "rec")
    assert str(e.value) == (
        f"record rec: the study differs from its frozen declaration ({message}); a changed design is a new "
        "declaration on fresh seeds (a new --record)"
    )
    declaration.check(
        frozen,
        declaration.declare(
            load_study(tmp_path / "a" / "tiny.yaml"), tmp_path / "a" / "tiny.yaml", ["+arm=bias", "seed=5001"], CODE
        ),
        "rec",
    )  # choosing runs is no edit
    other_code = {**frozen, "code": {"numbers": "1" * 16, "libraries": {}}}
    with pytest.raises(ConfigError, match=r"^record rec: the code that decides the runs' numbers differs from"):
        declaration.check(frozen, other_code, "rec")
    declaration.check(frozen, other_code, "rec", design_only=True)  # a page alone trains nothing


def test_a_declaration_reads_overrides_as_hydra_does_and_ignores_how_runs_are_kept(tmp_path):
    """The same study continued with its overrides in another order or spelling, with resume=auto,
    another tracker or data cache, is the same declaration, frozen through JSON; another value is not."""
    path = write_study(tmp_path)
    study_ = load_study(path)
    first = ["trainer.steps=6", "trainer.progress=false", "eval.metrics=[]"]
    frozen = json.loads(json.dumps(declaration.declare(study_, path, first, CODE)))
    again = [
        "eval.metrics=[]",
        "trainer.progress=False",
        "trainer.steps=6",
        "resume=auto",
        "tracker=wandb",
        "data.cache_dir=/elsewhere",
        "+arm=bias",
    ]
    declaration.check(frozen, declaration.declare(study_, path, again, CODE), "rec")
    with pytest.raises(ConfigError, match=r"^record rec: the study differs from its frozen declaration \(protocol"):
        declaration.check(
            frozen, declaration.declare(study_, path, ["trainer.steps=7", "eval.metrics=[]"], CODE), "rec"
        )


# -- the time limit ------------------------------------------------------------------------------
def test_a_page_from_a_record_with_a_readme_points_the_reader_to_it(tmp_path):
    """A record's README (how its runs were trained and checked, by hand) is named in the page's
    provenance where there is one; the line is otherwise the record's path alone."""
    from types import SimpleNamespace

    from dalle_ablate.study.runner import _record_provenance

    path = write_study(tmp_path)
    study_ = load_study(path)
    kept = SimpleNamespace(declared=declaration.declare(study_, path, ARGS, CODE), record=str(tmp_path / "rec"))
    (tmp_path / "rec").mkdir()
    bare = _record_provenance(study_, kept, [], True)[1]
    assert bare.startswith(f"Read from its record, {tmp_path / 'rec'}; the page's code is that of commit ")
    (tmp_path / "rec" / "README.md").write_text("# How these runs were trained\n")
    told = _record_provenance(study_, kept, [], True)[1]
    assert told == bare.replace(
        "; the page's", " (its README.md says how its runs were trained and checked); the page's", 1
    )


def test_a_time_limit_reads_as_a_person_writes_it_and_starts_no_job_its_cost_says_ends_late():
    assert [parse_duration(t) for t in ("2h30m", "90m", "1.5h", "45s", "600", "1h0m5s")] == [
        9000,
        5400,
        5400,
        45,
        600,
        3605,
    ]
    for bad in ("soon", "0", "-5m", "2x"):
        with pytest.raises(ConfigError, match=r"^--time-limit .*: give a positive duration such as 2h30m, 90m"):
            parse_duration(bad)
    clock = Clock(100.0, {("runs", "a"): 30.0, ("runs", "b"): 50.0})
    assert clock.fits("runs", ["a"], 2, "two of a")  # 60 s of 100
    assert clock.estimate("runs", "c", 1) == 40.0  # an arm not measured: the median of those that are
    assert not clock.fits("runs", ["a", "b"], 2, "two of a and b")  # 160 s
    assert not clock.fits("runs", ["a"], 1, "one more of a")  # nothing after a job left out: the order kept
    assert clock.left_out == ["two of a and b", "one more of a"]
    assert Clock(None).fits("runs", ["a"], 99, "x") and Clock(5.0).fits("runs", ["new"], 9, "unmeasured")


def test_a_job_past_the_deadline_is_stopped_by_sigterm_and_saves(tmp_path):
    """call_child at its deadline: the child gets SIGTERM (a run saves its last step on it), and the
    study hears PastDeadline once it exited."""
    import time

    from dalle_ablate.study.children import PastDeadline, call_child

    saved = tmp_path / "saved"
    child = (
        "import signal, sys, time\n"
        f"def save(*a):\n    open({str(saved)!r}, 'w').write('step saved')\n    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, save)\ntime.sleep(600)"
    )
    with pytest.raises(PastDeadline):
        call_child([sys.executable, "-c", child], dict(os.environ), deadline=time.monotonic() + 1.0)
    assert saved.read_text() == "step saved"  # it stopped on SIGTERM, not after its sleep or a kill


# -- a small study end to end ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny study in one invocation: stage 1 (2 arms x 2 seeds), its stress runs, stage 2."""
    root = tmp_path_factory.mktemp("tiny")
    write_study(root)
    done = study(root / "one")
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.mark.long
def test_the_page_from_the_record_is_the_page_from_the_run_stores_and_a_newcomers(tiny, tmp_path):
    from dalle_ablate.study.kept import Kept
    from dalle_ablate.study.runner import provenance

    record = Record(str(tiny / "one" / "rec"))
    assert sorted(record.entries(RUNS)) == sorted(p.name for p in (tiny / "one/studies/tiny").iterdir() if p.is_dir())
    assert sorted(record.entries(STRESS)) == sorted(p.name for p in (tiny / "one/studies/tiny-stress").iterdir())
    stages = json.loads((tiny / "one" / "rec" / "stages.json").read_text())
    assert stages["stage2"] == {"baseline": [10], "bias": [10]}  # the even rule: the open finding's arms, a seed each
    assert {n: e["stage"] for n, e in record.entries(RUNS).items()} == {
        **{f"{a}-seed{k}": 1 for a in ("baseline", "bias") for k in (0, 1)},
        "baseline-seed10": 2,
        "bias-seed10": 2,
    }
    assert {e["stage"] for e in record.entries(STRESS).values()} == {"stress"}
    study_file = tiny / "tiny.yaml"
    s = load_study(study_file)
    from_stores = in_folder(str(tiny / "one/studies/tiny"))
    from_stores.stages = stages  # the plan, kept in the record (the folder has none)
    kept = Kept(str(tiny / "one" / "rec"), s, study_file, ARGS)
    pages = []
    for name, inputs in (("stores", from_stores), ("record", kept.inputs())):
        lines = provenance("tiny.yaml", None, ARGS, ["python", "job.py"], inputs.runs, 0.0, False, None, "rec")
        pages.append(write_page(s, inputs, tmp_path / name, lines, study_file=study_file))
    assert pages[0].read_bytes() == pages[1].read_bytes()
    figures = sorted((tmp_path / "stores" / "figures").iterdir())
    assert figures and [f.name for f in figures] == sorted(p.name for p in (tmp_path / "record/figures").iterdir())
    assert all(f.read_bytes() == (tmp_path / "record/figures" / f.name).read_bytes() for f in figures)
    # a newcomer: the record alone, in a folder beside the one that trained it, the same command
    newcomer = tiny / "newcomer"
    shutil.copytree(tiny / "one" / "rec", newcomer / "rec")
    built = study(newcomer, "--no-run")
    assert built.returncode == 0, built.stderr[-3000:]
    assert "no HTML report: 6 of the record's runs have no run store on this machine" in built.stdout
    assert (newcomer / "results/tiny.md").read_bytes() == (tiny / "one/results/tiny.md").read_bytes()
    assert "Read from its record, rec; the page's code is that of commit " in (newcomer / "results/tiny.md").read_text()


@pytest.mark.long
def test_a_record_refuses_what_is_not_a_run_of_its_declaration(tiny, tmp_path):
    from dalle_ablate.study.kept import Kept

    rec = tmp_path / "rec"
    shutil.copytree(tiny / "one" / "rec", rec)
    kept = Kept(str(rec), load_study(tiny / "tiny.yaml"), tiny / "tiny.yaml", ARGS)
    folder = tmp_path / "studies" / "tiny"
    shutil.copytree(tiny / "one/studies/tiny/bias-seed1", folder / "bias-seed1")
    entry = rec / RUNS / "bias-seed1.json"
    entry.unlink()  # the record lacks it: the study takes the store, checked
    meta = folder / "bias-seed1/run/meta.json"
    good = json.loads(meta.read_text())
    for change, message in [
        (
            {"overrides": [*good["overrides"], "optim.lr=0.01"]},
            "was trained with other overrides than the declaration's: optim.lr=0.01 not declared",
        ),
        ({"git": {"commit": "0" * 40, "dirty": False}}, "commit 0000000000000000000000000000000000000000 is not in"),
        (
            {"versions": {**good["versions"], "jax": "0.0.1"}},
            "was trained with other libraries than the declaration's (jax 0.0.1; declared ",
        ),
    ]:
        meta.write_text(json.dumps({**good, **change}))
        with pytest.raises(ConfigError) as e:
            kept.take(folder)
        assert message in str(e.value) and "\n" not in str(e.value)
        assert not entry.exists()  # nothing written
    meta.write_text(json.dumps(good))
    assert kept.take(folder) == 1 and entry.exists()
    (rec / "declaration.json").unlink()  # lost: nothing says what the runs were declared for
    with pytest.raises(ConfigError, match=r"holds runs but no declaration.json, so nothing says what they were"):
        Kept(str(rec), load_study(tiny / "tiny.yaml"), tiny / "tiny.yaml", ARGS)


@pytest.mark.long
def test_a_study_over_three_folders_with_its_record_carried_records_what_one_invocation_does(tiny):
    """Three clones, the record copied from each to the next: the first stopped by its time limit
    mid-job, then its baseline trained through Ray; the second starts nothing its limit cannot
    hold; the third trains the rest. Each run trained once, and the record holds the same runs,
    stage-2 plan and verdicts as the one invocation's (only the measured times differ)."""
    a, b, c = (tiny / f"clone-{n}" for n in "abc")
    # 3 s: less than any machine takes to import JAX and train the job, so the limit always stops it
    # (a limit the job could beat on a fast day would let it finish: this test's first CI failure)
    late = study(a, "--no-stress", "--time-limit", "3s", "+arm=baseline")
    assert late.returncode == 5, late.stderr[-3000:]
    line = late.stderr.strip().splitlines()[-1]
    assert line.startswith("error: study tiny stopped at its time limit (3s, ")
    # the job is stopped by SIGTERM at the limit -- or, on a machine whose checks outlast it, not started
    job = "stage 1's job of baseline on seeds 0, 1"
    assert f"; left: {job}; continue with: " in line or f"; left: {job}, stopped at the limit (its runs" in line, line
    assert "continue with: dalle-ablate study ../tiny.yaml --record rec" in line
    assert not (a / "rec" / RUNS).exists()  # nothing finished
    # a Ray instance of its own (address=local): a cluster another test or process on this host left
    # running (ray.init's default joins it) may go away mid-job
    ray = study(a, "--no-stress", "+arm=baseline", "hydra/launcher=ray", "hydra.launcher.address=local")
    assert ray.returncode == 0, ray.stderr[-3000:]
    assert sorted(p.name for p in (a / "rec" / RUNS).iterdir()) == ["baseline-seed0.json", "baseline-seed1.json"]
    assert "stage 2 of study tiny waits for its record's 2 stage-1 runs and 6 stress runs" in ray.stdout
    shutil.copytree(a / "rec", b / "rec")
    none = study(b, "--time-limit", "1s")
    assert none.returncode == 5, none.stderr[-3000:]
    assert "left: stage 1's job of bias on seeds 0, 1; 1 stress run of bias at lr 0.001; " in none.stderr
    assert "; stage 2 (planned once stage 1 and the stress runs are in); continue with: " in none.stderr
    assert not any((b / "studies").rglob("metrics.jsonl"))  # its baseline's cost says the job ends too late
    shutil.copytree(b / "rec", c / "rec")
    rest = study(c)
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert not (c / "studies/tiny/baseline-seed0").exists()  # never trained twice
    one, three = Record(str(tiny / "one" / "rec")), Record(str(c / "rec"))
    for kind in (RUNS, STRESS):
        left, right = one.entries(kind), three.entries(kind)
        assert sorted(left) == sorted(right)
        for name in left:
            assert _computed(left[name]) == _computed(right[name]), name
    plans = [json.loads((f / "rec/stages.json").read_text()) for f in (tiny / "one", c)]
    planned = [{k: v for k, v in p.items() if k != "seconds_per_run"} for p in plans]  # its costs are measured
    assert planned[0] == planned[1] and set(plans[1]["seconds_per_run"]) == {"baseline", "bias"}
    assert _verdicts(tiny / "one/results/tiny.md") == _verdicts(c / "results/tiny.md")


def _computed(entry: dict) -> dict:
    """An entry less what is measured (wall and step times, the machine), how its job ran and the
    commit it was trained at (its code's digest stays: the code that decides its numbers)."""
    e = {k: v for k, v in entry.items() if k not in (*TIMES, "machine")}
    e["summary"] = {k: v for k, v in entry["summary"].items() if k not in TIMES}
    e["metrics"] = {k: v for k, v in entry["metrics"].items() if k != "perf/step_time"}
    e["meta"] = {k: v for k, v in entry["meta"].items() if k not in ("members", "device", "git")}
    e["code"] = {k: v for k, v in entry["code"].items() if k not in ("commit", "dirty")}  # the numbers' code is
    return e


def _verdicts(page: Path) -> list[str]:
    """The page's summary rows: each finding's verdict, difference and interval."""
    text = page.read_text()
    return [line for line in text.split("\n## ", 2)[1].splitlines() if line.startswith("| bias-")]
