"""A study's jobs, planned once (study/jobs.py): each job's arms and seeds read from its command's
overrides, its command line in the order the study command gave them, members or one job per
seed, the arms a study times interleaved seed by seed, and a record's finished runs left out."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from dalle_ablate.report.study_file import load_study, study_path
from dalle_ablate.study.jobs import plan_study, stage1_jobs, sweep
from dalle_ablate.study.stage2 import job_command

STUDY = load_study(study_path("mega-variants"))
FOLDER = Path("/s/mega-variants")


def tails(jobs) -> list[tuple]:
    return [(j.arms, j.seeds, j.tail()) for j in jobs]


def test_a_plain_study_is_one_job_its_seeds_members_or_one_job_each_in_the_commands_order():
    swept = ["+arm=baseline,bias", "seed=7,8", "trainer.steps=5"]
    [members] = stage1_jobs(sweep(STUDY, swept, True), timed=())
    assert members.command("study_mega", FOLDER) == [
        sys.executable,
        "-m",
        "dalle_ablate.job",
        "-m",
        "experiment=study_mega",
        "hydra.sweep.dir=/s/mega-variants",
        "+arm=baseline,bias",
        "trainer.steps=5",
        "seed=7",
        "seeds=[7,8]",
        "members.impl=map",
    ]
    assert tails(stage1_jobs(sweep(STUDY, swept, False), timed=())) == [
        (("baseline", "bias"), (7, 8), ["+arm=baseline,bias", "seed=7,8", "trainer.steps=5"])
    ]
    # one seed, or members.impl chosen by the command: no members.impl=map
    assert sweep(STUDY, ["seed=3", "+arm=bias"], True).tail() == ["seed=3", "+arm=bias"]
    assert sweep(STUDY, ["members.impl=vmap", "seed=0,1", "+arm=bias"], True).tail() == [
        "members.impl=vmap",
        "+arm=bias",
        "seed=0",
        "seeds=[0,1]",
    ]


def test_a_plan_adds_a_top_ups_seeds_and_the_study_files_arms_and_keeps_the_commands_own():
    study = dataclasses.replace(STUDY, findings=[f for f in STUDY.findings if f.arm == "bias"])
    plan = plan_study(study, FOLDER, ["trainer.steps=5"], "seed=0,1", False)
    assert (plan.sweep.arms, plan.sweep.seeds, plan.overrides) == (("baseline", "bias"), (0, 1), ("trainer.steps=5",))
    assert plan.sweep.tail() == ["trainer.steps=5", "seed=0,1", "+arm=baseline,bias"]


def test_timed_arms_train_seed_by_seed_and_a_records_finished_runs_are_left_out():
    whole = sweep(STUDY, ["+arm=baseline,bias,swish", "seed=7,8", "trainer.steps=5"], True)
    assert tails(stage1_jobs(whole, timed=("bias",))) == [
        (
            ("baseline", "swish"),
            (7, 8),
            ["trainer.steps=5", "+arm=baseline,swish", "seed=7", "seeds=[7,8]", "members.impl=map"],
        ),
        (("bias",), (7,), ["trainer.steps=5", "+arm=bias", "seed=7"]),
        (("bias",), (8,), ["trainer.steps=5", "+arm=bias", "seed=8"]),
    ]
    unseeded = sweep(dataclasses.replace(STUDY, experiment="quick"), ["+arm=baseline,bias"], True)  # sweeps no seed
    assert tails(stage1_jobs(unseeded, timed=("bias",))) == [
        (("baseline",), (), ["+arm=baseline"]),
        (("bias",), (), ["+arm=bias"]),
    ]
    done = {"baseline-seed7", "bias-seed8"}  # the record holds these: the others train, grouped by what they lack
    assert tails(stage1_jobs(whole, timed=("bias",), done=done)) == [
        (("baseline",), (8,), ["trainer.steps=5", "+arm=baseline", "seed=8"]),
        (("swish",), (7, 8), ["trainer.steps=5", "+arm=swish", "seed=7", "seeds=[7,8]", "members.impl=map"]),
        (("bias",), (7,), ["trainer.steps=5", "+arm=bias", "seed=7"]),
    ]


def test_stage_2_writes_the_members_block_as_stage_1_does():
    assert job_command("study_mega", FOLDER, "bias", [3, 4], ["x=1"], True)[5:] == [
        "hydra.sweep.dir=/s/mega-variants",
        "+arm=bias",
        "seed=3",
        "seeds=[3,4]",
        "members.impl=map",
        "x=1",
    ]
    assert job_command("study_mega", FOLDER, "bias", [3, 4], ["members.impl=vmap"], True)[6:] == [
        "+arm=bias",
        "seed=3",
        "seeds=[3,4]",
        "members.impl=vmap",
    ]
    assert job_command("study_mega", FOLDER, "bias", [3, 4], [], False)[6:] == ["+arm=bias", "seed=3,4"]
