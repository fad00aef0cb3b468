"""The package as a whole: the dependencies it declares are the ones it imports, its packages
import only downward (import-linter, the contracts in pyproject.toml), and a wheel built from it
installs non-editable and runs from outside the source tree."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT, SMALL_DATA, TINY_TRAIN

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Declared and needed, never imported by name: what else loads them.
LOADED_BY_OTHERS = {
    "jaxlib": "jax's compiled backend",
    "cmaes": "optuna's CmaEsSampler (sweep sampler `cmaes`)",
    "hydra-joblib-launcher": "a Hydra plugin, loaded by hydra/launcher=joblib",
    "gcsfs": "fsspec's gs:// filesystem (dalle_ablate/fileio.py), and etils.epath's, which orbax's paths use",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(reqs: list[str]) -> set[str]:
    return {norm(re.split(r"[\[=<>~! ;]", r, maxsplit=1)[0]) for r in reqs}


def imported_distributions() -> dict[str, set[str]]:
    """distribution -> the modules of dalle_ablate/ and hydra_plugins/ that import it (at any
    depth of the file, optional imports included)."""
    by_module = md.packages_distributions()
    out: dict[str, set[str]] = {}
    for root in ("dalle_ablate", "hydra_plugins"):
        for f in (ROOT / root).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [f"{node.module}.{a.name}" for a in node.names]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in ("dalle_ablate", "hydra_plugins", "__future__"):
                        continue
                    dists = by_module.get(top)
                    assert dists, f"{f.relative_to(ROOT)} imports {top}, which no installed distribution provides"
                    for d in providers(name, dists):
                        out.setdefault(norm(d), set()).add(str(f.relative_to(ROOT)))
    return out


def providers(name: str, dists: list[str]) -> list[str]:
    """Of the distributions sharing a top-level package, those holding the module imported: a
    namespace package (google.*: google-auth, google-cloud-storage, protobuf, ...) is several
    distributions' folders, the one imported is the one whose files hold its deepest part."""
    if len(dists) == 1:
        return dists
    parts = name.split(".")
    for depth in range(len(parts), 1, -1):
        path = "/".join(parts[:depth])
        found = [
            d for d in dists if any(str(f) == f"{path}.py" or str(f).startswith(f"{path}/") for f in md.files(d) or [])
        ]
        if found:
            return found
    return dists


def test_declared_dependencies_are_the_imported_ones():
    imported = imported_distributions()
    required = requirement_names(PYPROJECT["project"]["dependencies"])
    optional = requirement_names(
        [
            *PYPROJECT["project"]["optional-dependencies"]["ref"],
            *PYPROJECT["project"]["optional-dependencies"]["cluster"],
        ]
    )
    undeclared = {d: sorted(m) for d, m in imported.items() if d not in required | optional}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = required - set(imported) - {norm(d) for d in LOADED_BY_OTHERS}
    assert not unused, f"declared in pyproject.toml but never imported: {sorted(unused)}"


def test_the_constraints_pin_every_declared_requirement_at_its_version():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[norm(name)] = version.strip()
    extras = PYPROJECT["project"]["optional-dependencies"]
    for req in [*PYPROJECT["project"]["dependencies"], *extras["dev"], *extras["ref"], *extras["cluster"]]:
        name, version = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^ ;]+)", req).groups()
        assert pins.get(norm(name)) == version, f"{req}: constraints.txt pins {pins.get(norm(name))}"


def test_packages_import_only_downward():
    """The layers of docs/architecture.md, as pyproject.toml's import-linter contracts state them."""
    r = subprocess.run([Path(sys.executable).parent / "lint-imports"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "4 kept, 0 broken" in r.stdout


@pytest.mark.parametrize(
    "module, line, message",
    [
        (
            "model/flops.py",
            "from dalle_ablate.train.loop import train",
            "dalle_ablate.model is not allowed to import dalle_ablate.train",
        ),
        # the page writer knows nothing of the trainer or of the study runner that runs it (issue 60)
        (
            "report/page.py",
            "from dalle_ablate.train.meta import git_commit",
            "dalle_ablate.report is not allowed to import dalle_ablate.train",
        ),
        (
            "report/page.py",
            "from dalle_ablate.study.runner import run_study",
            "dalle_ablate.report is not allowed to import dalle_ablate.study",
        ),
        # the statistics engine: numpy, scipy and the standard library, no words and no tables (issue 73)
        ("stats/verdicts.py", "import pandas", "dalle_ablate.stats is not allowed to import pandas"),
        (
            "stats/stages.py",
            "from dalle_ablate.report import prose",
            "dalle_ablate.stats is not allowed to import dalle_ablate.report",
        ),
    ],
)
def test_a_broken_layer_fails_the_contract(tmp_path, module, line, message):
    """The check can fail: a copy of the package with one import upward breaks it."""
    shutil.copytree(ROOT / "dalle_ablate", tmp_path / "dalle_ablate", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "dalle_ablate" / module, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run(
        [Path(sys.executable).parent / "lint-imports", "--no-cache"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode != 0
    assert message in r.stdout


@pytest.mark.long
def test_the_wheel_installs_and_runs_outside_the_source_tree(tmp_path):
    """pip builds a wheel, installs it (not editable) into a fresh venv whose only other packages
    are this environment's dependencies, and, from a folder outside the checkout, `python -m
    dalle_ablate describe`, `dalle-ablate plan` and a 5-step run of the default job work on the
    configs the wheel carries."""
    # Built from the tracked files, copied: what a clean checkout holds, and setuptools' build/
    # and egg-info land in the copy, not in the working tree.
    src = tmp_path / "src"
    for f in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
        check=True,
        capture_output=True,
        text=True,
    )
    wheel = next(wheels.glob("dalle_ablate-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # The dependencies from this environment, appended after the venv's own site-packages; its
    # .pth files (the editable install of the checkout among them) are not processed from there.
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(work), DALLE_ABLATE_CACHE=str(tmp_path / "cache"))

    def run(*args: str) -> str:
        r = subprocess.run([str(a) for a in args], cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    where = run(
        py, "-c", "import dalle_ablate, dalle_ablate.conf as c; print(dalle_ablate.__file__); print(c.__file__)"
    )
    assert all(Path(line).is_relative_to(site) for line in where.split()), where
    assert "total" in run(py, "-m", "dalle_ablate", "describe", "size=small")
    assert "per device" in run(
        venv / "bin" / "dalle-ablate", "plan", "size=mega", "mesh.fsdp=8", "mesh.data=4", "trainer.batch_size=64"
    )
    run(py, "-m", "dalle_ablate.job", *SMALL_DATA, *TINY_TRAIN, "tracker=none", "eval.metrics=[]", "eval.grids=[]")
    (summary,) = work.glob("outputs/*/*/run/summary.json")
    got = json.loads(summary.read_text())
    assert got["status"] == "finished" and got["steps"] == 6
