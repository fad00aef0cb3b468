"""The compilation cache (parallel/compile_cache.py): a run's programs are written once and loaded
after; JAX's key tells programs apart; what can go wrong costs a compile and one line, not the run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, run_config
from dalle_ablate.config import CompilationCacheConfig
from dalle_ablate.parallel import compile_cache
from dalle_ablate.track.runstore import read_metrics
from dalle_ablate.train.loop import JobInfo, train


@pytest.fixture
def cache_at():
    """Point this process's cache at a folder, in the test's body (pytest's own warnings capture
    is set anew for it); the session's folder after it."""
    session = CompilationCacheConfig(dir=os.environ.get("JAX_COMPILATION_CACHE_DIR"))
    yield lambda folder: compile_cache.configure(CompilationCacheConfig(dir=None if folder is None else str(folder)))
    compile_cache.configure(session)


def compiled_now(fn, *args):
    """`fn(*args)` jitted after every in-memory cache is cleared (as in a new process), and what
    it cost: (its value, CompileTimes.since of the call)."""
    jax.clear_caches()
    before = compile_cache.TIMES.snapshot()
    out = np.asarray(jax.jit(fn)(*args))
    return out, compile_cache.TIMES.since(before)


def poly(x):
    return jnp.tanh(x @ x.T).sum(0) * 3.0


def other(x):  # another program on the same input: another key
    return jnp.cos(x @ x.T).sum(0) * 3.0


X = np.arange(64, dtype=np.float32).reshape(8, 8) / 64


def test_a_program_is_compiled_once_then_loaded_and_another_program_is_not_taken_for_it(tmp_path, cache_at):
    assert cache_at(tmp_path / "cache") == str(tmp_path / "cache")
    cold, first = compiled_now(poly, X)
    assert (first["compiled"], first["loaded"]) == (1, 0) and first["compile_s"] > 0
    assert len(compile_cache.cache_entries(tmp_path / "cache")) == 1
    warm, again = compiled_now(poly, X)
    assert (again["compiled"], again["loaded"]) == (0, 1) and again["load_s"] > 0
    np.testing.assert_array_equal(warm, cold)
    # JAX's key is the program: another one on the same input misses, and computes its own value.
    out, third = compiled_now(other, X)
    assert (third["compiled"], third["loaded"]) == (1, 0)
    np.testing.assert_allclose(out, np.cos(X @ X.T).sum(0) * 3.0, rtol=1e-5)
    # ... and so is its input's shape: the same code on a bigger array is a program of its own.
    _, fourth = compiled_now(poly, np.ones((16, 8), np.float32))
    assert (fourth["compiled"], fourth["loaded"]) == (1, 0)
    assert len(compile_cache.cache_entries(tmp_path / "cache")) == 3


def test_null_turns_the_cache_off(tmp_path, cache_at):
    assert cache_at(None) is None
    for _ in range(2):
        _, cost = compiled_now(poly, X)
        assert (cost["compiled"], cost["loaded"]) == (1, 0)
    assert cost["cache_dir"] is None


def test_a_corrupt_entry_is_compiled_again_with_one_warning_line(tmp_path, cache_at, capfd):
    cache_at(tmp_path / "cache")
    cold, _ = compiled_now(poly, X)
    (entry,) = compile_cache.cache_entries(tmp_path / "cache")
    entry.write_bytes(b"not a compiled program" * 10)
    capfd.readouterr()
    out, cost = compiled_now(poly, X)
    np.testing.assert_array_equal(out, cold)
    assert (cost["compiled"], cost["loaded"]) == (1, 0)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("warning: Error reading persistent compilation cache entry for 'jit_poly'")
    assert err[0].endswith("compiled it instead (the cache folder: compilation_cache.dir)")


def test_a_folder_that_cannot_be_written_is_one_warning_line_and_no_cache(tmp_path, cache_at, capfd):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    assert cache_at(blocker / "cache") is None
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [
        f"warning: compilation_cache.dir={blocker / 'cache'} cannot be written (NotADirectoryError: Not a "
        "directory); this run compiles every program -- fix the folder, set another, or compilation_cache.dir=null"
    ]
    out, cost = compiled_now(poly, X)
    np.testing.assert_allclose(out, np.tanh(X @ X.T).sum(0) * 3.0, rtol=1e-5)
    assert (cost["compiled"], cost["loaded"], cost["cache_dir"]) == (1, 0, None)
    assert capfd.readouterr().err == ""


WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import jax, jax.numpy as jnp, numpy as np
    from dalle_ablate.config import CompilationCacheConfig
    from dalle_ablate.parallel import compile_cache
    compile_cache.configure(CompilationCacheConfig(dir=sys.argv[1], max_size_gb=4.0))  # a bound: JAX's lock
    go = Path(sys.argv[2])
    while not go.exists():  # both processes compile at the same moment
        time.sleep(0.01)
    x = jnp.arange(64.0).reshape(8, 8) / 64
    for k in range(6):
        y = jax.jit(lambda a, k=k: jnp.tanh(a @ a.T * (k + 1)).sum(0))(x)
    cost = compile_cache.TIMES.since(compile_cache.CompileTimes())
    print(cost["compiled"], cost["loaded"], float(y.sum()))
    """
)


def test_two_processes_writing_one_cache_at_once_leave_every_entry_readable(tmp_path):
    """With a bound (compilation_cache.max_size_gb), JAX locks the folder around each entry: two
    processes compiling the same programs at once leave every entry whole (docs/guides/runs.md)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path / "cache"), str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert all(err.strip() == "" for _, err in outs), [e for _, e in outs]
    counts = [[int(n) for n in o.split()[:2]] for o, _ in outs]  # (compiled, loaded) of each
    # Each met the six programs (and the eager ops'), compiled, or loaded where the other wrote first.
    assert all(c + loaded >= 6 for c, loaded in counts), counts
    assert len(compile_cache.cache_entries(tmp_path / "cache")) >= 6
    # A third process reads every program back, without a warning, to the same values.
    third = subprocess.run(
        [sys.executable, "-c", WRITER, str(tmp_path / "cache"), str(go)], env=env, capture_output=True, text=True
    )
    assert third.returncode == 0 and third.stderr.strip() == "", third.stderr
    compiled, loaded, value = third.stdout.split()
    assert compiled == "0" and int(loaded) >= 6
    assert {o.split()[2] for o, _ in outs} == {value}


def test_a_run_records_its_compiling_and_a_warm_run_or_another_seed_loads_every_program(tmp_path, small_dataset):
    cfg = run_config("tracker=none")
    cfg = dataclasses.replace(cfg, compilation_cache=CompilationCacheConfig(dir=str(tmp_path / "cache")))
    try:
        jax.clear_caches()  # as two new processes: nothing compiled by an earlier test in memory
        cold = train(cfg, JobInfo(tmp_path / "cold"))
        jax.clear_caches()
        warm = train(cfg, JobInfo(tmp_path / "warm"))
        jax.clear_caches()
        seed = dataclasses.replace(cfg, seed=1)
        other_seed = train(seed, JobInfo(tmp_path / "seed1"))
    finally:
        compile_cache.configure(CompilationCacheConfig(dir=os.environ.get("JAX_COMPILATION_CACHE_DIR")))
    first, second = (json.loads((r.run_dir / "meta.json").read_text())["compilation"] for r in (cold, warm))
    assert first["cache_dir"] == str(tmp_path / "cache")
    assert first["compiled"] > 0 and first["loaded"] == 0
    # every program the warm run needs is loaded; the cold run may compile more (a program whose
    # result a cache on disk then keeps, as the FLOP/s probe's, is not run again)
    assert second["compiled"] == 0 and 0 < second["loaded"] <= first["compiled"]
    assert second["compile_s"] + second["load_s"] < first["compile_s"] + first["load_s"]
    assert _same_losses(cold, warm)
    # another seed is another run (other losses) of the same programs: its init keys and dropout
    # keys are arguments, not constants compiled into them, so it too loads every one
    third = json.loads((other_seed.run_dir / "meta.json").read_text())["compilation"]
    assert third["compiled"] == 0 and third["loaded"] == second["loaded"]
    assert not _same_losses(cold, other_seed)


def _same_losses(a, b) -> bool:
    keys = ("train/loss", "eval/valid/loss")
    rows = [{(r["step"], k): r[k] for r in read_metrics(x.run_dir) for k in keys if k in r} for x in (a, b)]
    return rows[0] == rows[1] and len(rows[0]) > 0
