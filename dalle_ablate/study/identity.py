"""The identity of the code that decides a run's numbers: a digest of the source files a training
process runs to compute them (NUMBERS), taken as git's blob ids -- of the files on disk, or of a
commit's tree -- so that two commits that differ elsewhere (the report, the study runner, the
docs) train the same runs and share it, and a study record can tell runs of other code apart."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Optional

from dalle_ablate.registry import ConfigError

ROOT = Path(__file__).resolve().parents[2]  # the checkout: dalle_ablate/ and run.py
# What computes a run's numbers, from its config (whose own digest a record keeps beside this one):
# the model, optimizers, data, evaluation and sampling, sharding, the config schemas and checks, and
# the trainer's step, loop and logging. Not here: how runs are stored, tracked, named, checkpointed,
# resumed, interrupted, launched, reported or studied, which change no number a run logs.
NUMBERS = (
    "dalle_ablate/model/",
    "dalle_ablate/optim/",
    "dalle_ablate/data/",
    "dalle_ablate/evaluate/",
    "dalle_ablate/generate/",
    "dalle_ablate/vqgan/",
    "dalle_ablate/parallel/",
    "dalle_ablate/config.py",
    "dalle_ablate/validate.py",
    "dalle_ablate/weights.py",
    "dalle_ablate/metrics.py",
    "dalle_ablate/train/assembly.py",
    "dalle_ablate/train/grad_scaling.py",
    "dalle_ablate/train/gradients.py",
    "dalle_ablate/train/hooks.py",
    "dalle_ablate/train/logger.py",
    "dalle_ablate/train/loop.py",
    "dalle_ablate/train/member_program.py",
    "dalle_ablate/train/perf.py",
    "dalle_ablate/train/program.py",
    "dalle_ablate/train/state.py",
    "dalle_ablate/train/step.py",
    "dalle_ablate/train/tokenizer.py",
)
# The libraries whose versions decide the numbers as much as the code does (meta.json's `versions`).
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy")


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"git {' '.join(args)}: cannot run ({e})") from None
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
        raise ConfigError(f"git {' '.join(args)} in {ROOT}: {why}")
    return out.stdout


def _digest(blobs: dict[str, str]) -> str:
    text = "".join(f"{path} {blob}\n" for path, blob in sorted(blobs.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _blob(data: bytes) -> str:
    """git's id of a file's content (`git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _numbers(path: str) -> bool:
    return path.endswith(".py") and any(path == n or (n.endswith("/") and path.startswith(n)) for n in NUMBERS)


def digest_on_disk() -> str:
    """The digest of the files of NUMBERS in this checkout as they are now (uncommitted changes
    included): the code a run this process starts trains with. A file of NUMBERS git does not track
    is refused in one line: no commit could name the code it is part of."""
    tracked = _git("ls-files", "--", "dalle_ablate").splitlines()
    untracked = [
        f for f in _git("ls-files", "--others", "--exclude-standard", "--", "dalle_ablate").splitlines() if _numbers(f)
    ]
    if untracked:
        raise ConfigError(
            f"{untracked[0]}: not tracked by git, yet it decides a run's numbers (study/identity.py NUMBERS); "
            "commit it or move it away, so that a record can name the code its runs are trained by"
        )
    return _digest({f: _blob((ROOT / f).read_bytes()) for f in tracked if _numbers(f) and (ROOT / f).is_file()})


def digest_at(commit: str) -> str:
    """The digest of the files of NUMBERS in `commit`'s tree (a ConfigError naming the commit where
    this checkout does not have it)."""
    try:
        listing = _git("ls-tree", "-r", commit, "--", "dalle_ablate")
    except ConfigError:
        raise ConfigError(
            f"commit {commit} is not in this checkout's history, so the code that trained its runs cannot be "
            "identified; fetch it (git fetch) or run from a clone that has it"
        ) from None
    blobs = {}
    for line in listing.splitlines():
        info, path = line.split("\t", 1)
        if _numbers(path):
            blobs[path] = info.split()[2]
    return _digest(blobs)


def code_of(git: dict, versions: dict, here: Optional[str] = None) -> dict:
    """A run's code identity from its meta.json's `git` and `versions`: its commit, the digest of the
    files that decide its numbers in that commit, and the library versions that do. A run trained
    with uncommitted changes has the digest of this checkout's files (`here`, digest_on_disk) only
    if it was trained from this very commit here (the study that trained it records it at once);
    else it cannot be identified: a ConfigError."""
    commit, dirty = git.get("commit"), bool(git.get("dirty"))
    if not commit:
        raise ConfigError("it was trained outside a git checkout, so its code cannot be identified")
    if dirty:
        if here is None or commit != _git("rev-parse", "HEAD").strip():
            raise ConfigError(
                f"it was trained at {commit[:12]} with uncommitted changes, which no record can identify; "
                "train it again from a clean checkout"
            )
        numbers = here
    else:
        numbers = digest_at(commit)
    return {
        "commit": commit,
        "dirty": dirty,
        "numbers": numbers,
        "libraries": {k: versions.get(k) for k in LIBRARIES},
    }


def last_change(paths: tuple[str, ...]) -> str:
    """The last commit that changed `paths` (with ' + uncommitted changes' where they have some),
    or 'unknown' outside a git checkout: the identity of code that is not a run's."""
    try:
        commit = _git("log", "-1", "--format=%H", "--", *paths).strip()
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", *paths).strip()
    except ConfigError:
        return "unknown (not a git checkout)"
    return f"{commit or 'unknown'}{' + uncommitted changes' if dirty else ''}"
