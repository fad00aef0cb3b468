"""Reads an offline W&B run file (`run-<id>.wandb`) back, independently of the code that wrote it.

The file is W&B's record log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB
blocks of chunks, each `crc32 (4) | length (2, little-endian) | type (1) | data`, type 1 = a
whole record, 2/3/4 = first/middle/last piece of one (the LevelDB log format). Each record is a
`wandb_internal_pb2.Record` protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7


def records(path: Path) -> list:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    out, pos, pending = [], HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - (pos % BLOCK)
        if left < 7:  # block trailer too short for a chunk header: skip to the next block
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


def history(path: Path) -> list[dict]:
    """The logged rows: {"_step": s, key: value, ...}."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            if rec.history.HasField("step"):
                row["_step"] = rec.history.step.num
            rows.append(row)
    return rows


def run_info(path: Path) -> dict:
    for rec in records(path):
        if rec.WhichOneof("record_type") == "run":
            r = rec.run
            return {
                "id": r.run_id,
                "group": r.run_group,
                "job_type": r.job_type,
                "name": r.display_name,
                "notes": r.notes,
                "project": r.project,
                "config": {i.key: json.loads(i.value_json) for i in r.config.update},
            }
    raise AssertionError(f"{path} has no run record")


def metric_definitions(path: Path) -> dict[str, dict]:
    """The run's define_metric calls: name (or glob) -> {step_metric, hidden, summary: set}."""
    out = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "metric":
            m = rec.metric
            ops = {f.name for f, v in m.summary.ListFields() if v is True}
            out[m.name or m.glob_name] = {"step_metric": m.step_metric, "hidden": m.options.hidden, "summary": ops}
    return out


def summary(path: Path) -> dict:
    """The run's last summary record: key -> value."""
    out = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "summary":
            for item in rec.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def artifacts(path: Path) -> list[dict]:
    """The artifacts the run logged: type, name, aliases, metadata and the files of each."""
    out = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "artifact":
            a = rec.artifact
            out.append(
                {
                    "type": a.type,
                    "name": a.name,
                    "aliases": list(a.aliases),
                    "metadata": json.loads(a.metadata) if a.metadata else {},
                    "files": sorted(e.path for e in a.manifest.contents),
                }
            )
    return out
