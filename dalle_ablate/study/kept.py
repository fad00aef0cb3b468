"""A study kept in a record (`dalle-ablate study NAME --record R`, study/record.py): its
declaration frozen before its first run and checked at every invocation, each finished run store
written to the record (a study's own runs as they finish, and those of a study already under way),
only the runs the record lacks trained, and the page read from the record alone."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from dalle_ablate.registry import ConfigError
from dalle_ablate.report.study_file import Study, stress_folder
from dalle_ablate.report.load import find_stores, load_run, machine_time
from dalle_ablate.report.page import StudyRuns
from dalle_ablate.report.staged import RECORD as STAGES
from dalle_ablate.study import declaration, identity
from dalle_ablate.study.record import DECLARATION, RUNS, STRESS, Record, check_entry, entry_of
from dalle_ablate.study.stage2 import PlanFrom
from dalle_ablate.track.runstore import settled
from dalle_ablate.train.meta import library_versions


class Kept:
    """A study and its record: the declaration as the record froze it (or as it will, checked
    against this invocation's), what the record holds and what is left to train."""

    def __init__(self, where: str, study: Study, study_file: Path, overrides: list[str], no_run: bool = False):
        self.record = Record(where)
        self.study = study
        self.here = identity.digest_on_disk()
        code = {"numbers": self.here, "libraries": {k: library_versions().get(k) for k in identity.LIBRARIES}}
        now = declaration.declare(study, study_file, overrides, code)
        if not now["protocol"]["seeds"]:
            raise ConfigError(
                f"--record: study {study.name} sweeps no seeds (its preset {study.experiment} or a seed= override); "
                "a record keeps each arm's runs by seed"
            )
        frozen = self.record.declaration()
        if frozen is None and (self.done(RUNS) or self.done(STRESS) or self.stages() is not None):
            raise ConfigError(
                f"record {self.record}: holds runs but no {DECLARATION}, so nothing says what they were declared for; "
                "restore it from where the record came from (git, the bucket)"
            )
        if frozen is not None:  # a page alone (--no-run) trains nothing: the design is what it must share
            declaration.check(frozen, now, str(self.record), design_only=no_run)
        self.declared = frozen or now
        self.frozen = frozen is not None
        for kind in (RUNS, STRESS):  # every entry, however it came into the record (a copy, a merge)
            for name, entry in self.record.entries(kind).items():
                check_entry(entry, self.declared, self.seeds(kind), f"record {self.record}: {kind}/{name}.json")

    # -- the declaration, and what the record holds ---------------------------------------------------
    def freeze(self) -> None:
        """Freeze the declaration: before the record's first run, and before stage 1's first job."""
        if not self.frozen:
            self.record.freeze(self.declared)
            self.frozen = True

    def stages(self) -> Optional[dict]:
        from dalle_ablate.report.load import read_json

        path = self.record.root / STAGES
        return read_json(path) if path.exists() else None

    def seeds(self, kind: str) -> list[int]:
        """The seeds a run of `kind` may have: stage 1's and stage 2's (its plan's, once made), or the
        stress plan's."""
        if kind == STRESS:
            return list(self.declared["stress"]["seeds"])
        stage1 = list(self.declared["protocol"]["seeds"] or [])
        plan = self.stages()
        if plan is not None:
            return stage1 + sorted({s for seeds in plan["stage2"].values() for s in seeds})
        st = self.study.stages
        return stage1 + (st.seeds(st.cap) if st is not None else [])

    def waiting(self) -> list[str]:
        """What stage 2 waits for, in words: it is planned from every declared stage-1 run and
        stress run, never from a part of them (a `+arm=` or `--no-stress` invocation's)."""
        from dalle_ablate.report.study_file import run_name

        p, s = self.declared["protocol"], self.declared["stress"]
        runs = {f"{a}-seed{k}" for a in p["arms"] for k in p["seeds"]} - self.done(RUNS)
        stress = (
            set()
            if s is None
            else {run_name(a, lr, k) for a in p["configs"].get("stress", {}) for lr in s["lr"] for k in s["seeds"]}
            - self.done(STRESS)
        )
        return [f"{len(x)} {what}" for x, what in ((runs, "stage-1 runs"), (stress, "stress runs")) if x]

    def done(self, kind: str) -> set[str]:
        """The names of the runs of `kind` the record holds (its files': each is read where it is used)."""
        folder = self.record.root / kind
        return {p.stem for p in folder.glob("*.json")} if folder.is_dir() else set()

    # -- finished run stores into the record ------------------------------------------------------
    def take(self, folder: Path) -> int:
        """Write each settled run store under the study's folder (and its stress runs') that the
        record lacks to the record, checked against the declaration -- and the folder's kept
        stage-2 plan, if the record has none yet; how many runs were written."""
        self._take_plan(folder)
        n = 0
        kinds = ((RUNS, folder), (STRESS, stress_folder(folder))) if self.declared["stress"] else ((RUNS, folder),)
        for kind, where in kinds:
            try:
                stores = find_stores(str(where))
            except ConfigError:  # none there yet
                continue
            done = self.done(kind)
            for store in stores:
                if store.parent.name not in done and (store / "summary.json").exists():
                    n += self._take_one(kind, store)
        return n

    def _take_plan(self, folder: Path) -> None:
        """A study under way planned its stage 2 in its folder: that plan is the study's."""
        from dalle_ablate.fileio import atomic_write
        from dalle_ablate.report.staged import check_stages

        kept = Path(folder) / STAGES
        if self.stages() is None and kept.is_file() and self.study.stages is not None:
            from dalle_ablate.report.load import read_json

            check_stages(read_json(kept), self.study.stages, str(kept))
            self.freeze()
            atomic_write(self.record.root / STAGES, kept.read_text())

    def _take_one(self, kind: str, store: Path) -> int:
        """A settled run store (finished, or diverged: a result) as the record's entry."""
        from dalle_ablate.report.load import read_json

        summary = read_json(store / "summary.json")
        if not settled(summary, self.declared["stress"]["steps"] if kind == STRESS else None):
            return 0
        run = load_run(store)
        arm = run.arm
        if arm is None or (kind == STRESS and "optim.lr" not in run.config):
            raise ConfigError(
                f"{store}: no +arm= in its meta.json (or no optim.lr): not a run of study {self.study.name}"
            )
        try:
            code = identity.code_of(run.meta.get("git") or {}, run.meta.get("versions") or {}, self.here)
            lr = float(run.config["optim.lr"]) if kind == STRESS else None
            stage = "stress" if kind == STRESS else (1 if run.seed in (self.declared["protocol"]["seeds"] or []) else 2)
            entry = entry_of(run, arm, stage, code, self.study.transition, lr)
            check_entry(entry, self.declared, self.seeds(kind), str(store))
        except ConfigError as e:  # the run store is what is refused: it is not in the record
            raise ConfigError(str(e) if str(e).startswith(str(store)) else f"{store}: {e}") from None
        self.freeze()
        self.record.add(kind, entry)
        return 1

    # -- what the study's clock, stage 2 and page read from it ------------------------------------
    def costs(self) -> dict:
        """Seconds per run measured on the record's runs, by (kind, arm): a members job once."""
        out = {}
        for kind in (RUNS, STRESS):
            by_arm: dict[str, list] = {}
            for r in self.record.runs(kind):
                if r.summary.get("wall_time") is not None:
                    by_arm.setdefault(r.arm, []).append(r)
            for arm, rs in by_arm.items():
                out[(kind, arm)] = machine_time(rs) / len(rs)
        return out

    def stage2_state(self) -> PlanFrom:
        """What stage 2 plans from and keeps: the record's folder (its plan is kept there), the
        record's runs, stage 1's declared seeds, the runs the record holds."""
        return PlanFrom(
            self.record.root, self.inputs(), list(self.declared["protocol"]["seeds"]), frozenset(self.done(RUNS))
        )

    def inputs(self) -> StudyRuns:
        """What the page reads, from the record alone."""
        return StudyRuns(self.record.runs(RUNS), self.record.runs(STRESS), self.stages())
