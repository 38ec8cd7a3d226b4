"""Reading W&B's offline files in tests, and the environment of a process that may import wandb
(offline: nothing is sent anywhere)."""

from __future__ import annotations

import importlib
import json
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def offline_env(tmp: Path) -> dict[str, str]:
    """The environment of a process that may import wandb: offline, silent, every W&B file under `tmp`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no key, no server address
    return {
        **env,
        "PYTHONPATH": str(REPO),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp / "wandb-data"),
    }


# -- reading W&B's offline files -----------------------------------------------------------
# An offline run writes <dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb (one directory per
# wandb.init: a resume with the same id writes a second one, which `wandb sync` appends to the
# same run). The file is W&B's "LevelDB log" of protobuf Records: a 7-byte header (":W&B",
# magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each a 7-byte header (crc32 of type +
# data, length, type: 1 full, 2 first, 3 middle, 4 last) and its data. wandb 0.31 has no Python
# reader of its own (wandb.sdk.internal.datastore is gone), so this is one.
BLOCK, HEADER = 32768, 7


def wandb_records(path: Path) -> list[Any]:
    pb: Any = importlib.import_module("wandb.proto.wandb_internal_pb2")  # generated: no types for mypy

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack_from("<HB", data, 4) == (0xBEE1, 0), data[:HEADER]
    pos, bodies, parts = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a chunk header: zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        body = data[pos + HEADER : pos + HEADER + length]
        if kind == 0 and length == 0:  # padding to the end of the block
            pos += left
            continue
        assert len(body) == length and zlib.crc32(bytes([kind]) + body) == crc, f"{path}: bad chunk at {pos}"
        pos += HEADER + length
        if kind == 1:
            bodies.append(body)
        elif kind == 2:
            parts = body
        elif kind == 3:
            parts += body
        elif kind == 4:
            bodies.append(parts + body)
    records = []
    for body in bodies:
        record = pb.Record()
        record.ParseFromString(body)
        records.append(record)
    return records


def segments(out: Path, run_id: str) -> list[Path]:
    """The offline directories of W&B run `run_id` in `out`/wandb, one per wandb.init of it, in time
    order (offline-run-<time>-<id>, and -<id>-<n> for a second one in the same second)."""
    found = []
    for d in (out / "wandb").glob(f"offline-run-*-{run_id}*"):
        m = re.fullmatch(rf"offline-run-(\d{{8}}_\d{{6}})-{run_id}(?:-(\d+))?", d.name)
        if m:
            found.append(((m.group(1), int(m.group(2) or 0)), d))
    return [d for _, d in sorted(found)]


def wandb_history(out: Path, run_id: str) -> dict[int, dict[str, Any]]:
    """{step: the scalars logged at it} over every offline segment of W&B run `run_id` in
    `out`/wandb, as the server makes them one run: a later segment's values win, and a rewound one
    (its branch point, `resume_from="<id>?_step=<s>"`) first drops the steps after s."""
    dirs = segments(out, run_id)
    assert dirs, f"no offline W&B run {run_id} in {out / 'wandb'}: {sorted(p.name for p in (out / 'wandb').glob('*'))}"
    history: dict[int, dict[str, Any]] = {}
    for d in dirs:
        for record in wandb_records(d / f"run-{run_id}.wandb"):
            if record.WhichOneof("record_type") == "run":
                assert record.run.run_id == run_id
                branch = record.run.branch_point
                if branch.run:
                    assert branch.run == run_id and branch.metric == "_step", branch
                    history = {s: row for s, row in history.items() if s <= branch.value}
            elif record.WhichOneof("record_type") == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                history.setdefault(int(row["_step"]), {}).update(
                    {k: v for k, v in row.items() if not k.startswith("_")}
                )
    return history
