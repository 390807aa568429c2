"""weight_ema: an EMA of the policy's weights kept for shipping beside any KL reference (issue 68). It is the
exact average of the policy's weights after each step, resumes bit-equal, is evaluated, exported and chosen by a
validation set; with EMA-PG it is the anchor itself."""

import json

import pytest
import torch

from emapg.config import ConfigError, load_config
from emapg.lab.report import shipped
from emapg.run.checkpoint import latest_checkpoint, load_checkpoint
from emapg.run.metrics import read_metrics
from emapg.run.trainer import Trainer
from tests.test_trainer import SMOKE, strip_timing

GRPO = ("algo.eta=1.0", "algo.kl=k3", "algo.beta=0.05", "weight_ema=0.5")


def cfg(*overrides):
    return load_config(SMOKE, ["export=false", *overrides])


def test_the_weight_ema_is_the_average_of_the_policy_after_each_step(tmp_path, monkeypatch):
    """With a frozen anchor the weight EMA is a second copy: theta_w <- d theta_w + (1 - d) theta after every
    step, from the policy after that step (recomputed here from the policy's weights, step by step); the KL's
    reference stays the initial policy."""
    tr = Trainer(cfg("steps=3", "save_every=0", "eval.size=0", *GRPO), tmp_path, progress=False)
    assert tr.run.weight_ema is not None and tr.run.ema is tr.run.weight_ema and tr.run.anchor.frozen
    init = {n: p.detach().clone() for n, p in tr.run.model.named_parameters()}
    expect = {n: p.clone() for n, p in init.items()}
    real_step = tr.run.weight_ema.step

    def step(model):  # the policy after the step's updates, as the weight EMA sees it
        for n, p in model.named_parameters():
            expect[n] = 0.5 * expect[n] + 0.5 * p.detach()
        return real_step(model)

    monkeypatch.setattr(tr.run.weight_ema, "step", step)
    tr.train()
    moved = averaged = False
    for n, p in tr.run.model.named_parameters():
        torch.testing.assert_close(tr.run.weight_ema.average[n], expect[n], rtol=0, atol=1e-7)
        moved |= not torch.equal(expect[n], p.detach())
        averaged |= not torch.equal(expect[n], init[n])
    assert averaged  # it was stepped
    with tr.run.anchor.use(tr.run.model) as ref:  # the KL's reference: still the initial weights
        for n, p in ref.named_parameters():
            assert torch.equal(p, init[n]), n
    assert moved  # the average lags the policy: the test could fail


def test_with_ema_pg_the_anchor_is_the_weight_ema_and_another_decay_is_refused(tmp_path):
    tr = Trainer(cfg("steps=1", "save_every=0", "eval.size=0", "algo.eta=0.9", "weight_ema=0.9"), tmp_path,
                 progress=False)
    assert tr.run.weight_ema is None and tr.run.ema is tr.run.anchor  # no second copy
    with pytest.raises(ConfigError, match=r"weight_ema: 0\.95 differs from algo\.eta=0\.9"):
        cfg("algo.eta=0.9", "weight_ema=0.95")
    with pytest.raises(ConfigError, match="weight_ema"):
        cfg("algo.eta=1.0", "weight_ema=1.0")  # a decay of 1 never moves: it is the initial policy


def test_a_resumed_weight_ema_equals_the_uninterrupted_one(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    Trainer(cfg("steps=4", "save_every=2", *GRPO), full, progress=False).train()
    Trainer(cfg("steps=2", "save_every=2", *GRPO), part, progress=False).train()
    resumed = Trainer(load_config(part / "config.yaml", ["steps=4"]), part, resume=True, progress=False)
    resumed.train()
    ca, cb = load_checkpoint(latest_checkpoint(full)), load_checkpoint(latest_checkpoint(part))
    assert set(ca["weight_ema"]) == set(cb["weight_ema"]) and len(ca["weight_ema"]) > 2
    for name, t in ca["weight_ema"].items():
        assert torch.equal(cb["weight_ema"][name], t), name
    a, b = strip_timing(read_metrics(full)), strip_timing(read_metrics(part))
    assert [r.get("eval/ema_accuracy") for r in a] == [r.get("eval/ema_accuracy") for r in b]


def test_a_checkpoint_that_lost_its_weight_ema_is_damaged_and_the_older_one_resumes(tmp_path, capsys):
    Trainer(cfg("steps=4", "save_every=2", *GRPO), tmp_path, progress=False).train()
    (latest_checkpoint(tmp_path) / "weight_ema.safetensors").unlink()
    resumed = Trainer(load_config(tmp_path / "config.yaml", ["steps=4"]), tmp_path, resume=True, progress=False)
    assert resumed.run.progress.step == 2
    assert "weight_ema.safetensors is damaged" in capsys.readouterr().err


def test_the_weight_ema_is_evaluated_on_test_and_validation_exported_and_tabled(tmp_path):
    run = tmp_path / "run"
    over = [*GRPO, "steps=2", "save_every=2", "eval.every=1", "eval.size=6", "eval.validation_size=4",
            "task_args.eval_size=10"]
    table = Trainer(load_config(SMOKE, over), run, progress=False).train()
    rows = read_metrics(run)
    last = rows[-1]
    for key in ("eval/ema_accuracy", "eval/validation_ema_accuracy", "eval/validation_policy_accuracy"):
        assert key in last, key
    assert "eval/validation_anchor_accuracy" not in last  # a frozen anchor: the initial policy, nothing to ship
    assert table["ema"]["accuracy"] == last["eval/ema_accuracy"]
    assert "| ema |" in (run / "eval.md").read_text() and "Weight EMA against policy" in (run / "eval.md").read_text()
    ids = {s: json.loads((run / "outcomes" / f"{s}.ids.json").read_text()) for s in ("heldout", "validation")}
    assert len(ids["heldout"]) == 6 and len(ids["validation"]) == 4 and not set(ids["heldout"]) & set(ids["validation"])
    # the exported EMA is the checkpoint's average, and `emapg export` of the checkpoint writes the same
    from transformers import AutoModelForCausalLM

    from emapg.run.export import export_checkpoint

    ema = AutoModelForCausalLM.from_pretrained(run / "export" / "ema")
    avg = load_checkpoint(latest_checkpoint(run))["weight_ema"]
    for n, p in ema.named_parameters():
        assert torch.equal(p, avg[f"average.{n}"]), n
    out = export_checkpoint(run, out=tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(out / "ema")
    for (n, p), (_, q) in zip(ema.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_a_validation_set_larger_than_the_held_out_problems_is_refused_naming_what_to_change(tmp_path):
    with pytest.raises(ConfigError, match=r"eval\.validation_size: 8 after eval\.size 6 needs 14 .* has 10"):
        Trainer(cfg("eval.size=6", "eval.validation_size=8", "task_args.eval_size=10"), tmp_path, progress=False)


def test_the_shipped_model_is_chosen_on_validation_never_on_test():
    row = {"step": 40, "eval/policy_accuracy": 0.70, "eval/ema_accuracy": 0.60,
           "eval/validation_policy_accuracy": 0.50, "eval/validation_ema_accuracy": 0.55,
           "eval/transfer_policy_accuracy": 0.3, "eval/transfer_ema_accuracy": 0.2}
    got = shipped([{"step": 0}, row])
    assert got == {"shipped": 0.60, "shipped_is_ema": 1.0, "transfer_shipped": 0.2, "ema_gain": pytest.approx(-0.1)}
    tie = {**row, "eval/validation_ema_accuracy": 0.50}  # a tie keeps the policy
    assert shipped([tie])["shipped"] == 0.70 and shipped([tie])["shipped_is_ema"] == 0.0
    assert shipped([{"step": 1, "eval/policy_accuracy": 0.5}]) == {}


def test_the_memory_plan_counts_a_weight_ema_of_its_own_and_no_copy_with_ema_pg():
    from emapg.models import plan as P

    shape = P.shape_of(P.model_config("tiny-qwen2"))

    def resident(*over, world=1):
        c = load_config(SMOKE, ["model=tiny-qwen2", *over])
        p = P.plan(c, shape, world=world, prompt_tokens=50, device="cpu")
        return p.resident, {ph.name: ph.parts for ph in p.phases}

    plain, _ = resident("algo.eta=1.0")
    own, _ = resident("algo.eta=1.0", "weight_ema=0.9")
    assert own["weight EMA (weight_ema)"] == plain["anchor weights"] > 0
    assert set(own) - set(plain) == {"weight EMA (weight_ema)"}
    assert resident("algo.eta=0.9", "weight_ema=0.9")[0] == resident("algo.eta=0.9")[0]  # the anchor is it
    lora, _ = resident("algo.eta=1.0", "weight_ema=0.9", "lora.r=4")
    assert lora["weight EMA adapters (weight_ema)"] == lora["anchor adapters"]
    _, phases = resident("algo.eta=1.0", "weight_ema=0.9", "export=true", world=2)
    (gathered,) = phases["export"].values()
    assert gathered == 4 * shape.params * P.DTYPE_BYTES["float32"]  # policy, anchor, EMA and the plain model
