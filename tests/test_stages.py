"""What the reference recipes need of a run: length stages that start from an earlier run (init_from), verl's
warmup schedule, Adam's betas, n samples per evaluation problem, evaluation before training or not, and
recipes that extend one another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from emapg.config import ConfigError, TrainConfig, load_config
from emapg.run.assembly import lr_factor
from emapg.run.checkpoint import latest_checkpoint, load_checkpoint
from emapg.run.metrics import read_metrics
from emapg.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "recipes" / "smoke.yaml"


def cfg(*overrides):
    return load_config(SMOKE, ["export=false", *overrides])


def test_a_stage_started_from_another_runs_checkpoint_continues_it_exactly(tmp_path):
    """init_from = verl's resume_from_path: stage 2 in its own folder equals the same run continued."""
    full, first, second = tmp_path / "full", tmp_path / "first", tmp_path / "second"
    Trainer(cfg("steps=4", "save_every=2"), full, progress=False).train()
    Trainer(cfg("steps=2", "save_every=2"), first, progress=False).train()
    stage = Trainer(cfg("steps=4", "save_every=2", f"init_from={first}"), second, progress=False)
    assert stage.run.progress.step == 2 and stage.run.anchor.num_steps == 2
    stage.train()
    want, got = load_checkpoint(latest_checkpoint(full)), load_checkpoint(latest_checkpoint(second))
    assert got["state"]["step"] == 4
    for part in ("policy", "anchor"):
        for name, t in want[part].items():
            torch.testing.assert_close(got[part][name], t, rtol=0, atol=0)
    rows = read_metrics(second)
    assert [r["step"] for r in rows if "reward_mean" in r] == [3, 4]
    assert rows[0]["step"] == 2 and "eval/policy_accuracy" in rows[0]  # the stage evaluates its start
    assert (first / "checkpoints").exists() and len(read_metrics(first)) == 3  # the first run is untouched


def test_a_grpo_stage_evaluates_its_frozen_anchor_and_takes_the_configs_optimizer_settings(tmp_path):
    """eta = 1: the anchor stays the step-0 model; the stage's start evaluation is of its starting policy, so it
    must not stand in for the anchor's. A stage's lr, betas and weight decay are its config's."""
    Trainer(cfg("steps=2", "save_every=2", "algo.eta=1.0"), tmp_path / "a", progress=False).train()
    stage = Trainer(cfg("steps=3", "save_every=1", "algo.eta=1.0", f"init_from={tmp_path / 'a'}", "lr=5e-4",
                        "betas=[0.8, 0.95]", "weight_decay=0.01"), tmp_path / "b", progress=False)
    assert stage.run.anchor_is_initial
    group = stage.run.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (5e-4, (0.8, 0.95), 0.01)
    assert stage.run.scheduler.base_lrs == [5e-4]
    stage.train()
    assert stage.run.progress.initial_eval_settings["at_step"] == 2 and stage._initial_anchor_eval() is None
    resumed = Trainer(cfg("steps=4", "save_every=1", "algo.eta=1.0", f"init_from={tmp_path / 'a'}", "lr=5e-4",
                          "betas=[0.8, 0.95]", "weight_decay=0.01"), tmp_path / "b", resume=True, progress=False)
    assert resumed._initial_anchor_eval() is None  # the record survives a resume
    assert read_metrics(tmp_path / "b")[-1]["lr"] == pytest.approx(5e-4)


def test_init_from_a_folder_without_a_checkpoint_is_one_line(tmp_path):
    from emapg.run.checkpoint import CheckpointError

    Trainer(cfg("steps=2", "save_every=2"), tmp_path / "done", progress=False).train()
    with pytest.raises(CheckpointError, match=r"steps: 2 is not past step 2 of init_from .*done.*nothing to train"):
        Trainer(cfg("steps=2", f"init_from={tmp_path / 'done'}"), tmp_path / "run0", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"init_from: .*empty: no intact checkpoint to start from"):
        Trainer(cfg("steps=2", f"init_from={tmp_path / 'empty'}"), tmp_path / "run", progress=False)
    with pytest.raises(CheckpointError, match=r"init_from: .*nowhere is not a run folder"):
        Trainer(cfg("steps=2", f"init_from={tmp_path / 'nowhere'}"), tmp_path / "run2", progress=False)


def test_init_from_a_run_of_another_model_says_so(tmp_path, capsys):
    """A healthy checkpoint of another model is not "damaged": its names (another family) or its shapes (another
    width of the same family) are named, in one line, with no warning about its checkpoints before it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from emapg.models.zoo import load_model

    Trainer(cfg("steps=1", "save_every=1", "eval.size=0"), tmp_path / "llama", progress=False).train()
    Trainer(cfg("steps=2", "save_every=1", "eval.size=0", "model=tiny-qwen2"), tmp_path / "qwen",
            progress=False).train()
    capsys.readouterr()
    with pytest.raises(ConfigError, match=r"init_from: .*qwen: step_000002 holds another model's weights "
                                          r"\(model.layers.0.self_attn.k_proj.bias, which this run's model has not"):
        Trainer(cfg("steps=3", "eval.size=0", f"init_from={tmp_path / 'qwen'}"), tmp_path / "llama2", progress=False)
    assert "damaged" not in capsys.readouterr().err  # two checkpoints there: neither is called damaged first
    Trainer(cfg("steps=2", "save_every=1", "eval.size=0"), tmp_path / "llama-2", progress=False).train()
    capsys.readouterr()
    with pytest.raises(ConfigError, match=r"init_from: .*llama-2 is a run of another model \(tiny-llama, not "
                                          r"tiny-qwen2\) whose checkpoints do not fit"):  # qwen's biases: not there
        Trainer(cfg("steps=3", "eval.size=0", "model=tiny-qwen2", f"init_from={tmp_path / 'llama-2'}"),
                tmp_path / "qwen2", progress=False)
    assert "warning" not in capsys.readouterr().err  # no "damaged ... trying an older checkpoint" first
    model, tok = load_model("tiny-llama")  # the same model under another name: a damaged newest checkpoint is said
    model.save_pretrained(tmp_path / "same-llama")
    tok.save_pretrained(tmp_path / "same-llama")
    (tmp_path / "llama-2" / "checkpoints" / "step_000002" / "policy.safetensors").write_bytes(b"cut")
    Trainer(cfg("steps=3", "eval.size=0", f"model={tmp_path / 'same-llama'}", f"init_from={tmp_path / 'llama-2'}"),
            tmp_path / "same", progress=False)
    assert "step_000002/policy.safetensors is damaged" in capsys.readouterr().err
    model, tok = load_model("tiny-llama")
    wide = AutoConfig.for_model(**{**model.config.to_dict(), "intermediate_size": model.config.intermediate_size * 2})
    AutoModelForCausalLM.from_config(wide).save_pretrained(tmp_path / "wide-llama")
    tok.save_pretrained(tmp_path / "wide-llama")
    with pytest.raises(ConfigError, match=r"holds weights of another shape \(model.layers.0.mlp.*there, .* in this "
                                          r"run's model: another size of the model\?\)"):
        Trainer(cfg("steps=2", f"model={tmp_path / 'wide-llama'}", "eval.size=0", f"init_from={tmp_path / 'llama'}"),
                tmp_path / "wide", progress=False)


def test_warmup_ratio_is_verls_constant_schedule_by_training_step():
    c = TrainConfig(steps=1005, warmup_ratio=0.285)  # the search script: int(0.285 x 1005) = 286 steps
    # verl: min(1, t / max(1, W)) at its scheduler's t-th step (0 first), stepped once per training step
    assert [lr_factor(c, 99, t) for t in (0, 1, 143, 285, 286, 1000)] == [0.0, 1 / 286, 0.5, 285 / 286, 1.0, 1.0]
    assert lr_factor(TrainConfig(warmup_steps=4), 0, 7) == 0.25  # warmup_steps counts optimizer steps
    assert lr_factor(TrainConfig(), 0, 0) == 1.0


def test_a_run_trains_at_the_schedules_rate_and_with_its_betas(tmp_path):
    tr = Trainer(cfg("steps=3", "save_every=0", "eval.size=0", "warmup_ratio=0.7", "mini_batch_prompts=2",
                     "betas=[0.8, 0.9]"), tmp_path, progress=False)
    assert tr.run.optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    tr.train()
    # W = int(0.7 x 3) = 2: the rate of steps 1, 2, 3 is 0, 1/2, 1 (both optimizer steps of a step alike)
    assert [r["lr"] for r in read_metrics(tmp_path)] == pytest.approx([0.0, 0.5e-3, 1e-3])


def test_eval_samples_and_at_start(tmp_path, monkeypatch):
    import emapg.run.evaluate as ev

    seen = []
    real = ev.evaluate

    def spy(model, tokenizer, task, examples, spec, **kw):
        seen.append(spec.n)
        return real(model, tokenizer, task, examples, spec, **kw)

    monkeypatch.setattr(ev, "evaluate", spy)
    Trainer(cfg("steps=2", "save_every=0", "eval.greedy=false", "eval.samples=3", "eval.at_start=false",
                "eval.every=0", "eval.size=4"), tmp_path, progress=False).train()
    assert seen == [3, 3]  # the policy and the anchor at the end; nothing before the first step
    rows = read_metrics(tmp_path)
    assert rows[0]["step"] == 1 and not any(k.startswith("eval/") for k in rows[0])
    assert "eval/policy_accuracy" in rows[-1]
    with pytest.raises(ConfigError, match="eval.samples: 3 samples per problem need sampling: eval.greedy: false"):
        load_config(SMOKE, ["eval.samples=3"])


def test_extends_merges_section_by_section(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("model: tiny-llama\nsteps: 5\nalgo: {kl: k3, eta: 0.95, beta: 0.01}\nrollout: {n: 2}\n")
    (tmp_path / "variant.yaml").write_text("extends: base\nalgo: {kl: topk_reverse}\nsteps: 7\n")
    c = load_config(tmp_path / "variant.yaml", ["algo.k=4"])
    assert (c.steps, c.algo.kl, c.algo.eta, c.algo.beta, c.algo.k, c.rollout.n) == (7, "topk_reverse", 0.95, 0.01, 4, 2)
    (tmp_path / "loop.yaml").write_text("extends: loop2\n")
    (tmp_path / "loop2.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="extends: loop.yaml extends this file again"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "mine.yaml").write_text("extends: smoke\nsteps: 9\n")  # a shipped recipe's name, from anywhere
    assert load_config(tmp_path / "mine.yaml").model == "tiny-llama"
    # another task than the parent's: the parent's task_args (arithmetic's digits) are not carried over
    (tmp_path / "other.yaml").write_text("extends: smoke\ntask: multihop_kb\n")
    assert load_config(tmp_path / "other.yaml").task_args == {}
    (tmp_path / "same.yaml").write_text("extends: smoke\ntask_args: {digits: 2}\n")
    assert load_config(tmp_path / "same.yaml").task_args == {"digits": 2, "ops": "+", "terms": 2}
    (tmp_path / "lost.yaml").write_text("extends: nothing-here\n")
    with pytest.raises(ConfigError, match=r"lost.yaml: extends: .*nothing-here.yaml: No such file"):
        load_config(tmp_path / "lost.yaml")


def test_a_shipped_stage_recipe_names_its_earlier_stage():
    c16, c24 = load_config(ROOT / "recipes" / "math_r1_distill_1p5b_16k.yaml"), \
        load_config(ROOT / "recipes" / "math_r1_distill_1p5b_24k.yaml")
    assert c16.init_from and c24.init_from and c16.steps < c24.steps
    assert (c16.rollout.max_new_tokens, c24.rollout.max_new_tokens) == (16384, 24576)
