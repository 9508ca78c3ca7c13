"""Read an offline wandb run (``<dir>/wandb/offline-run-*/run-*.wandb``): its records are
protobufs (``wandb.proto.wandb_internal_pb2.Record``) in LevelDB's log format (32 KiB blocks,
7-byte chunk headers: crc32, length, type full/first/middle/last) after a 7-byte file header."""

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    out, buf, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + HEADER : pos + HEADER + length], pos + HEADER + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def read_run(save_dir: Path, path: Path | None = None) -> dict:
    """{"history": [{key: value}], "config": {key: value}} of the one offline run there (or of
    the run file ``path``)."""
    if path is None:
        (path,) = sorted(Path(save_dir).glob("wandb/offline-run-*/run-*.wandb"))
    history, config = [], {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in rec.history.item})  # fmt: skip
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
    return {"history": history, "config": config}
