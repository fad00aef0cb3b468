"""`dalle-ablate encode` writes dalle-mini-format parquet that the trainer reads back end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq

from conftest import SMALL_DATA, run_config
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
