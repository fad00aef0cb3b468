"""`dalle-ablate encode` writes dalle-mini-format parquet that the trainer reads back end to end; `dalle-ablate eval`
names a checkpoint it cannot restore."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import SMALL_DATA, TINY_TRAIN, run_config, run_py
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
        "data=parquet", f"data.path={out}/train.parquet", f"data.valid_path={out}/valid.parquet",
        "data.image_vocab=145", f"data.codebook_path={out}/codebook.npz", f"data.tokenizer_path={out}/tokenizer.json",
        "data.shuffle_buffer=64", "tracker=none", data=(),
    )
    res = train(cfg, JobInfo(tmp_path / "job"))
    assert res.status == "finished" and np.isfinite(res.eval_loss)
    assert (res.run_dir / "media" / "samples_grid_6.png").is_file()
    meta = json.loads((res.run_dir / "meta.json").read_text())
    assert meta["data"]["image_len"] == small_dataset.image_len == 36 and meta["data"]["files"] == 1


def test_cli_errors_are_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dalle_ablate.cli", "encode", "--out", str(tmp_path), "data.patch_size=7"],
        capture_output=True, text=True, timeout=300,
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
    proc = subprocess.run([sys.executable, "-m", "dalle_ablate.cli", "eval", str(job), "tracker=none"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    head = f"error: {step}: the checkpoint of step 3 cannot be restored (truncated or corrupt?): "
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(head), proc.stderr[-3000:]
    why = proc.stderr[len(head):]
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

    from dalle_ablate.cli import call_child

    done = tmp_path / "saved"
    child = f"import time, pathlib; time.sleep(1.5); pathlib.Path({str(done)!r}).write_text('x')"
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        call_child([sys.executable, "-c", child], dict(os.environ))
    assert done.read_text() == "x"
