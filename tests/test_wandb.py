"""report_to: [wandb] logs the metrics rows, the config and the eval table to W&B; tested in W&B's
offline mode (no network) by reading the offline run's transaction log back."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

from emapg.config import ConfigError, load_config  # noqa: E402
from emapg.run.metrics import read_metrics  # noqa: E402
from emapg.run.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def records(path: Path):
    """The protobuf records of a W&B transaction log (the LevelDB log format: a 7-byte file header,
    then 32 KiB blocks of chunks, each with a 7-byte header: crc32, length, type)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            yield rec


def key(item) -> str:
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_holds_the_metrics_the_config_and_the_eval_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(ROOT / "recipes" / "smoke.yaml", ["export=false", "steps=2", "eval.size=4",
                                                        "report_to=[wandb]", "wandb_project=emapg-test"])
    table = Trainer(cfg, tmp_path, progress=False).train()
    assert not (tmp_path / "tensorboard").exists()  # only what report_to names
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert log.name == f"run-{(tmp_path / 'wandb_id').read_text().strip()}.wandb"
    history, summary, config, kinds = {}, {}, {}, set()
    for rec in records(log):
        kind = rec.WhichOneof("record_type")
        kinds.add(kind)
        if kind == "history":
            row = {key(i): json.loads(i.value_json) for i in rec.history.item}
            history[row["_step"]] = row
        elif kind == "summary":
            summary.update({key(i): json.loads(i.value_json) for i in rec.summary.update})
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
            assert rec.run.project == "emapg-test" and rec.run.display_name == tmp_path.name
    for row in read_metrics(tmp_path):  # every metrics.jsonl row, at its step, with its values
        logged = history[row["step"]]
        for name, value in row.items():
            if name != "step" and isinstance(value, float):
                assert logged[name] == pytest.approx(value), name
    assert config["seed"] == 0 and config["steps"] == 2 and config["algo"]["kl"] == cfg.algo.kl
    assert summary["final/policy_accuracy"] == table["policy"]["accuracy"]
    assert summary["final/init_accuracy"] == table["init"]["accuracy"]
    assert "artifact" in kinds  # the eval table


def test_report_to_is_checked():
    with pytest.raises(ConfigError, match="report_to"):
        load_config(ROOT / "recipes" / "smoke.yaml", ["report_to=[mlflow]"])
