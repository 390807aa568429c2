"""The config reference (`emapg config`, docs/CONFIG.md) is generated from the declarations: every field, its
type, default and rule, and the doc file equal to what the code generates."""

from pathlib import Path

import yaml

from emapg.cli import main
from emapg.config import TrainConfig, load_config
from emapg.config import reference as ref
from emapg.settings import declared

ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_md_is_what_the_declarations_generate():
    assert (ROOT / "docs" / "CONFIG.md").read_text() == ref.markdown(), \
        "docs/CONFIG.md is stale: emapg config --markdown > docs/CONFIG.md"


def test_the_reference_has_every_field_with_its_default_rule_and_doc():
    got = {e.name: e for e in ref.entries()}
    assert list(got) == list(declared(TrainConfig))
    eta = got["algo.eta"]
    assert (eta.type, eta.default, eta.rule, eta.trl) == ("float", "0.9", "must be in (0, 1]", "eta")
    assert "1.0 = frozen reference model" in eta.doc
    assert got["eval.size"].option == "--size" and got["steps"].replay_safe and not got["lr"].replay_safe
    assert got["weight_ema"].default == "null" and "kept for shipping" in got["weight_ema"].doc
    assert all(e.doc for e in got.values())  # every field says what it does


def test_emapg_config_prints_the_reference_and_show_prints_the_resolved_config(capsys, tmp_path):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "algo.eta: float  (default 0.9; must be in (0, 1];" in out and out.count("\n    ") > 80
    assert main(["config", "--show", "smoke", "algo.eta=0.5", "steps=7"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["algo"]["eta"] == 0.5 and shown["steps"] == 7 and shown["model"] == "tiny-llama"
    assert shown["lr"] == load_config(ROOT / "recipes" / "smoke.yaml").lr and "weight_ema" in shown
    assert main(["config", "steps=3"]) == 2  # overrides need --show
