"""End to end on tiny random models: the loop, resume, atomic checkpoints, faults, exports."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from emapg.config import load_config
from emapg.kl import token_kl
from emapg.models.lm import positions
from emapg.run.checkpoint import has_checkpoint, latest_checkpoint, load_checkpoint
from emapg.run.metrics import read_metrics
from emapg.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "recipes" / "smoke.yaml"
TIMING = ("step_seconds", "gen_seconds", "anchor_seconds")


def cfg(*overrides):
    return load_config(SMOKE, ["export=false", *overrides])


def strip_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_smoke_run_writes_the_run_folder(tmp_path):
    tr = Trainer(load_config(SMOKE), tmp_path, progress=False)
    table = tr.train()
    vocab = tr.run.model.get_output_embeddings().weight.shape[0]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    # the diagnostics hold values that could be wrong, not only keys the code writes
    for r in rows[1:]:
        assert 0 <= r["reward_mean"] <= 1 and 0 <= r["clip_frac"] <= 1 and r["step_seconds"] > 0
        assert 1 <= r["response_length"] <= 8 and 0 < r["entropy"] <= math.log(vocab)  # 8 new tokens
        assert 0 < r["grad_norm"] < float("inf")
    # step 1's loss sees the anchor equal to the policy (the estimate exactly 0); after an update the
    # EMA lags the policy (a sampled estimate: either sign, never exactly 0)
    assert rows[1]["kl"] == 0.0 and all(r["kl"] != 0 for r in rows[2:])
    assert rows[0]["eval/policy_accuracy"] == table["init"]["accuracy"]
    assert rows[-1]["eval/anchor_accuracy"] == table["anchor"]["accuracy"]
    assert f"| anchor | {100 * table['anchor']['accuracy']:.1f}% |" in (tmp_path / "eval.md").read_text()
    for f in ("config.yaml", "eval.md", "eval.json", "reward.png", "kl.png", "entropy.png", "accuracy.png"):
        assert (tmp_path / f).exists(), f
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert set(table) == {"init", "policy", "anchor"}
    # exports load with plain transformers and the anchor differs from the policy (eta < 1)
    from transformers import AutoModelForCausalLM

    pol = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "policy")
    anc = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "anchor")
    assert not torch.equal(pol.model.layers[0].mlp.up_proj.weight, anc.model.layers[0].mlp.up_proj.weight)


def test_training_moves_the_policy_and_the_anchor_follows_the_ema_recursion(tmp_path):
    """After each step the anchor is eta * anchor + (1 - eta) * policy, with eta = 0.7 (not 0.5, so a
    swap of eta and 1 - eta is caught), computed here in float64 from the policy after every step."""
    tr = Trainer(cfg("algo.eta=0.7", "steps=3", "eval.size=0", "save_every=0"), tmp_path, progress=False)

    def weight(m):
        return m.model.layers[0].mlp.up_proj.weight.detach().double().clone()

    w0 = weight(tr.run.model)
    expect = w0.clone()
    for step in (1, 2, 3):
        tr.train_step(step)
        tr.run.progress.step = step
        expect = 0.7 * expect + 0.3 * weight(tr.run.model)
        torch.testing.assert_close(weight(tr.run.anchor.module), expect, atol=1e-6, rtol=0)
    assert not torch.equal(weight(tr.run.model), w0)
    assert not torch.equal(weight(tr.run.anchor.module), weight(tr.run.model))


def test_frozen_anchor_is_the_initial_model(tmp_path):
    tr = Trainer(cfg("algo.eta=1.0", "algo.kl=k3"), tmp_path, progress=False)
    w0 = tr.run.model.model.layers[0].mlp.up_proj.weight.detach().clone()
    tr.train()
    assert not torch.equal(tr.run.model.model.layers[0].mlp.up_proj.weight, w0)  # the policy moved: a check that bites
    assert torch.equal(tr.run.anchor.module.model.layers[0].mlp.up_proj.weight, w0)


def test_frozen_anchor_reuses_the_initial_policy(tmp_path, monkeypatch):
    """eta = 1: no second frozen copy for kl_to_init and no second evaluation of the initial model;
    both reuse the anchor's numbers, which must equal what the separate passes would give."""
    tr = Trainer(cfg("algo.eta=1.0", "algo.kl=k3", "log_kl_to_init=true", "steps=2"), tmp_path, progress=False)
    assert tr.run.init_anchor is None
    evaluations = _anchor_evaluations(tr, monkeypatch)
    table = tr.train()
    rows = read_metrics(tmp_path)
    assert all(r["kl_to_init"] == pytest.approx(r["kl"], rel=1e-6) for r in rows[1:])  # same k3, same anchor
    assert table["anchor"]["accuracy"] == table["init"]["accuracy"]
    assert evaluations == ["policy", "policy"]  # step 0 and the end: the anchor's was not run again
    # what the skipped evaluation would have returned (its per-problem outcomes went to RUN/outcomes)
    assert tr.evaluate("anchor") == {k: v for k, v in tr.run.progress.initial_eval.items() if k != "solved"}
    # with eta < 1 the initial policy keeps its own frozen copy
    eta = Trainer(cfg("algo.eta=0.9", "log_kl_to_init=true"), tmp_path / "b", progress=False)
    assert eta.run.init_anchor is not None


def _anchor_evaluations(tr, monkeypatch):
    """The models whose held-out set the run evaluates for real (a reused result is not a run)."""
    calls = []
    real = tr.run.evaluator.run

    def spy(model, which, step, sets=("heldout", "transfer"), reuse=None):
        if reuse is None and "heldout" in sets:
            calls.append(which)
        return real(model, which, step, sets, reuse=reuse)

    monkeypatch.setattr(tr.run.evaluator, "run", spy)
    return calls


def test_eval_anchor_evaluates_the_anchor_at_every_periodic_evaluation(tmp_path, monkeypatch):
    tr = Trainer(cfg("steps=4", "eval.every=2", "eval.size=4", "eval.anchor=true", "algo.eta=0.5"), tmp_path,
                 progress=False)
    calls = _anchor_evaluations(tr, monkeypatch)
    tr.train()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "eval/anchor_accuracy" in r] == [2, 4]
    assert calls == ["policy", "policy", "anchor", "policy", "anchor"]
    frozen = Trainer(cfg("steps=4", "eval.every=2", "eval.size=4", "eval.anchor=true", "algo.eta=1.0"),
                     tmp_path / "frozen", progress=False)
    calls = _anchor_evaluations(frozen, monkeypatch)
    frozen.train()
    assert calls == ["policy"] * 3  # the frozen anchor is the initial policy: its step-0 evaluation serves
    rows = read_metrics(tmp_path / "frozen")
    initial = rows[0]["eval/policy_accuracy"]
    assert all(r["eval/anchor_accuracy"] == initial for r in rows if "eval/anchor_accuracy" in r)


@pytest.mark.parametrize("lora", [0, 2])
def test_evaluating_the_anchor_leaves_training_untouched(tmp_path, lora):
    """The anchor evaluated at every evaluation (full: its own copy; LoRA: the averaged adapters swapped
    into the policy and back) against only at the end: the same run, step for step."""
    def run(folder, anchor):
        Trainer(cfg("steps=4", "eval.every=2", "eval.size=4", f"eval.anchor={anchor}", "algo.eta=0.5",
                    f"lora.r={lora}"), folder, progress=False).train()
        rows = read_metrics(folder)
        return rows, [{k: v for k, v in r.items() if "seconds" not in k and "eval/anchor" not in k} for r in rows]

    every, every_plain = run(tmp_path / "every", "true")
    end, end_plain = run(tmp_path / "end", "false")
    assert [r["step"] for r in every if "eval/anchor_accuracy" in r] == [2, 4]
    assert [r["step"] for r in end if "eval/anchor_accuracy" in r] == [4]
    assert every_plain == end_plain


def test_resumed_frozen_anchor_is_reused_only_if_it_is_still_the_initial_policy(tmp_path, monkeypatch):
    """The checkpoint says whether the anchor has been the initial policy since step 0: a run resumed
    at eta = 1 after steps at eta < 1, or with other evaluation settings, measures for real."""
    base = ("log_kl_to_init=true", "save_every=2", "eval.size=4", "eval.every=0")
    moved, frozen, other = tmp_path / "moved", tmp_path / "frozen", tmp_path / "other"
    Trainer(cfg(*base, "steps=2", "algo.eta=0.5"), moved, progress=False).train()
    tr = Trainer(load_config(moved / "config.yaml", ["steps=3", "algo.eta=1.0"]), moved, resume=True, progress=False)
    assert not tr.run.anchor_is_initial and tr.run.init_anchor is not None
    calls = _anchor_evaluations(tr, monkeypatch)
    tr.train()
    assert calls == ["policy", "anchor"]
    row = read_metrics(moved)[-1]
    assert row["kl_to_init"] != pytest.approx(row["kl"], rel=1e-3)  # the moved anchor is not the initial policy
    assert not load_checkpoint(latest_checkpoint(moved))["state"]["anchor_is_initial"]
    for run, extra in ((frozen, []), (other, ["eval.size=6"])):
        Trainer(cfg(*base, "steps=2", "algo.eta=1.0"), run, progress=False).train()
        tr = Trainer(load_config(run / "config.yaml", ["steps=3", *extra]), run, resume=True, progress=False)
        assert tr.run.anchor_is_initial and tr.run.init_anchor is None
        calls = _anchor_evaluations(tr, monkeypatch)
        tr.train()
        assert calls == (["policy"] if not extra else ["policy", "anchor"]), run


def test_kl_to_init_is_per_token_whatever_the_ppo_epochs(tmp_path):
    """lr ~ 0: every epoch sees the same policy, so one epoch and two report the same KL to init."""
    vals = []
    for epochs in (1, 2):
        tr = Trainer(cfg("steps=1", "eval.size=0", "lr=1e-20", "algo.eta=0.9", "log_kl_to_init=true",
                         f"algo.ppo_epochs={epochs}"), tmp_path / str(epochs), progress=False)
        torch.manual_seed(0)
        with torch.no_grad():  # move the policy away from its initial copy
            for p in tr.run.params:
                p.add_(0.05 * torch.randn_like(p))
        vals.append(tr.train_step(1)["kl_to_init"])
    assert vals[0] > 1e-4 and vals[1] == pytest.approx(vals[0], rel=1e-5)


def test_first_checkpoint_without_latest_still_resumes(tmp_path):
    """A kill between a first checkpoint's rename and writing ``latest`` leaves a complete step folder."""
    Trainer(cfg("steps=2", "save_every=1", "eval.size=0"), tmp_path, progress=False).train()
    (tmp_path / "checkpoints" / "latest").unlink()
    assert latest_checkpoint(tmp_path).name == "step_000002" and has_checkpoint(tmp_path)
    assert not has_checkpoint(tmp_path / "nothing")


def test_save_every_zero_writes_no_checkpoint(tmp_path):
    Trainer(cfg("steps=2", "save_every=0"), tmp_path, progress=False).train()
    assert not (tmp_path / "checkpoints").exists() and (tmp_path / "eval.json").exists()


def test_resume_equals_uninterrupted_run(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    Trainer(cfg("steps=4", "save_every=2"), full, progress=False).train()
    Trainer(cfg("steps=2", "save_every=2"), part, progress=False).train()
    # the interrupted run's config said steps=2; resume it to 4 as a user would with an override
    resumed = Trainer(load_config(part / "config.yaml", ["steps=4"]), part, resume=True, progress=False)
    assert resumed.run.progress.step == 2
    resumed.train()
    a, b = strip_timing(read_metrics(full)), strip_timing(read_metrics(part))
    # the 2-step run evaluated the anchor at its end (step 2); the full run did not: compare the rest
    for ra, rb in zip(a, b, strict=True):
        for key in set(ra) & set(rb):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), (ra["step"], key)
    ca, cb = load_checkpoint(latest_checkpoint(full)), load_checkpoint(latest_checkpoint(part))
    for name, t in ca["policy"].items():
        torch.testing.assert_close(cb["policy"][name], t)
    for name, t in ca["anchor"].items():
        torch.testing.assert_close(cb["anchor"][name], t)


def test_kill_during_save_never_breaks_latest(tmp_path):
    """A child process saves checkpoints in a loop; we SIGKILL it at random moments and check that
    `latest` always names a complete checkpoint that loads."""
    script = f"""
import sys, torch
from pathlib import Path
sys.path.insert(0, {str(ROOT / 'src')!r})
from emapg.run.checkpoint import save_checkpoint
model = torch.nn.Linear(256, 256)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 256)).sum().backward(); opt.step()
step = 0
while True:
    step += 1
    with torch.no_grad():
        model.weight.fill_(float(step))
    save_checkpoint(Path({str(tmp_path / 'checkpoints')!r}), step,
                    model.state_dict(), {{"average.w": model.weight.detach()}}, opt, {{"note": "x"}}, keep=2)
    print(step, flush=True)
"""
    for delay in (0.0, 0.003, 0.011, 0.027, 0.05):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(3):  # let it complete a few saves, then kill it somewhere inside the next ones
            proc.stdout.readline()
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        path = latest_checkpoint(tmp_path)
        ck = load_checkpoint(path)
        step = ck["state"]["step"]
        assert torch.all(ck["policy"]["weight"] == float(step))
        assert torch.all(ck["anchor"]["average.w"] == float(step))


def test_non_finite_loss_skips_the_update_and_training_goes_on(tmp_path, monkeypatch):
    tr = Trainer(cfg("steps=3", "eval.size=0"), tmp_path, progress=False)
    original = tr.micro_loss
    calls = {"n": 0}

    def poisoned(mb, anc, counts):
        loss, sums = original(mb, anc, counts)
        calls["n"] += 1
        return (loss * math.nan if calls["n"] == 1 else loss), sums

    monkeypatch.setattr(tr, "micro_loss", poisoned)
    w0 = tr.run.model.model.layers[0].mlp.up_proj.weight.detach().clone()
    tr.train_step(1)
    assert torch.equal(tr.run.model.model.layers[0].mlp.up_proj.weight, w0)  # the poisoned update was dropped
    tr.run.progress.step = 1
    tr.train()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [2, 3] and all(r["skipped_updates"] == 0 for r in rows)
    assert tr.run.progress.skipped_steps == 1 and rows[-1]["skipped_total"] == 1
    assert all(torch.isfinite(p).all() for p in tr.run.model.parameters())


def test_reward_error_names_the_sample(tmp_path):
    tr = Trainer(cfg("eval.size=0"), tmp_path, progress=False)

    def bad_reward(completion, example):
        if example.id == "train-1":
            raise KeyError("boom")
        return 0.0

    tr.run.task.reward = bad_reward
    with pytest.raises(RuntimeError, match=r"raised KeyError.*example 'train-1'"):
        tr.train_step(1)


@pytest.mark.parametrize("override,message", [
    ("algo.eta=0", "algo.eta: must be in \\(0, 1\\]"),
    ("algo.eta=1.5", "algo.eta: must be in"),
    ("algo.k=-1", "algo.k: must be >= 0"),
    ("algo.kl=k7", "algo.kl: expected an estimator of emapg.kl.ESTIMATORS: k1, .*got .k7."),
    ("micro_batch_prompts=3", "micro_batch_prompts: 3 does not divide"),
    ("algo.etaa=0.5", "unknown key 'etaa' in algo"),
    ("steps=ten", "steps: expected int"),
    ("rollout.top_p=0", "rollout.top_p: must be in"),
    ("eval.top_p=1.5", "eval.top_p: must be in \\(0, 1\\] or null"),
    ("eval.temperature=0", "eval.temperature: must be > 0 or null"),
])
def test_config_validation_messages(override, message):
    from emapg.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(SMOKE, [override])


def test_an_unknown_key_and_bad_task_args_are_reported_with_every_other_problem():
    """One message for all: an unknown override key no longer hides the other problems, and task_args are
    checked by the task's own rules with the config (not after the model loads), as every command passes them."""
    from emapg.tasks import task_args_problems

    with pytest.raises(Exception) as info:
        load_config(SMOKE, ["export=false", "nosuch=1", "algo.eta=7", "task_args={digits: 0}"],
                    task_check=task_args_problems)
    text = str(info.value)
    assert "override 'nosuch': unknown key 'nosuch'" in text and "algo.eta: must be in (0, 1], got 7.0" in text
    assert "task_args.digits: must be >= 1, got 0" in text


def test_a_bad_override_is_blamed_on_the_command_line_not_the_file(tmp_path):
    from emapg.config import ConfigError

    with pytest.raises(ConfigError, match=r"^override steps=abc \(over .*smoke.yaml\): steps: expected int"):
        load_config(SMOKE, ["algo.k=4", "steps=abc"])
    with pytest.raises(ConfigError, match=r"^override algo.eta=2 \(over .*smoke.yaml\): algo.eta: must be in"):
        load_config(SMOKE, ["algo.eta=2"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-llama\nsteps: abc\n")
    with pytest.raises(ConfigError, match=r"^\S*bad.yaml, line 2: steps: expected int"):  # the file: its line
        load_config(bad, ["algo.k=4"])


def test_every_wrong_field_of_a_config_is_named_in_one_message(tmp_path):
    """Wrong types, unknown keys and out-of-range values, in the file and on the command line, all in one
    error (one rerun, not one per field), each blamed where it was typed."""
    from emapg.config import ConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: smoke\nsteps: ten\nlr: -1\nalgo:\n  eta: 2\n  k: many\n  etta: 3\n"
                   "rollout:\n  n: 0\n  temperature: hot\neval:\n  size: -3\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{bad}: 8 problems: ")
    for part in ("steps: expected int, got 'ten'", "algo: unknown key(s) etta", "algo.k: expected int, got 'many'",
                 "rollout.temperature: expected float, got 'hot'", "algo.eta: must be in (0, 1], got 2.0",
                 "rollout.n: must be >= 1, got 0", "lr: must be a finite number > 0", "eval.size: must be >= 0"):
        assert part in message, part
    with pytest.raises(ConfigError) as e:
        load_config(bad, ["steps=4", "eval.size=x", "algo.beta=-1"])
    message = str(e.value)
    assert "steps:" not in message  # the override fixed it
    assert f"override eval.size=x (over {bad}): eval.size: expected int, got 'x'" in message
    assert f"override algo.beta=-1 (over {bad}): algo.beta:" in message
    assert f"{bad}, line 5: algo.eta: must be in" in message and f"{bad}, line 7: algo: unknown key(s) etta" in message


def test_config_file_errors_name_file_and_line(tmp_path):
    from emapg.config import ConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nalgo:\n  eta: [0.9\n")
    with pytest.raises(ConfigError, match=r"bad.yaml, line \d+: invalid YAML"):
        load_config(bad)
    bad.write_text("steps: 3\nalgo:\n  etta: 0.9\n")
    with pytest.raises(ConfigError, match=r"bad.yaml, line 3: algo: unknown key\(s\) etta"):  # the key's line
        load_config(bad)
    with pytest.raises(ConfigError, match="does-not-exist.yaml"):
        load_config(tmp_path / "does-not-exist.yaml")


def test_cli_train_and_resume(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "emapg", "train", "--config", str(SMOKE), "--out", str(out), "steps=2", "export=false"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "| init |" in res.stdout
    res = subprocess.run([sys.executable, "-m", "emapg", "train", "--resume", str(out), "steps=3"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2, 3]
    assert json.loads((out / "checkpoints" / "latest").read_text())["step"] == 3
    # a fresh start into a folder that holds a run refuses, and changes nothing
    before = (out / "metrics.jsonl").read_text()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 2 and f"--out {out}: already holds a run" in res.stderr and "--resume" in res.stderr
    assert (out / "metrics.jsonl").read_text() == before
    res = subprocess.run([sys.executable, "-m", "emapg", "train", "--config", str(SMOKE), "algo.eta=2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 2 and "algo.eta: must be in (0, 1]" in res.stderr


def full_logits(model, batch, temperature):
    """[B, L, V] float64 logits at the response positions from a plain forward of prompt + response
    (independent of emapg's chunked, prefix-shared passes)."""
    n = batch.n
    ids = torch.cat([batch.prompt_ids.repeat_interleave(n, 0), batch.response_ids], 1)
    att = torch.cat([batch.prompt_mask.repeat_interleave(n, 0), torch.ones_like(batch.response_ids)], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att, position_ids=positions(att)).logits.double()
    lp = batch.prompt_ids.shape[1]
    return logits[:, lp - 1 : lp - 1 + batch.response_ids.shape[1]] / temperature


@pytest.mark.parametrize("estimator,k", [("topk_forward", 4), ("topk_reverse", 0), ("topk_forward", 0),
                                         ("topk_reverse", 8), ("exact_reverse", 4), ("k3", 4), ("k1", 4)])
def test_every_estimator_family_logs_the_kl_its_reference_form_gives(tmp_path, estimator, k):
    """The logged kl (and kl_to_init) of an update equal kl.token_kl on full logits of a plain forward:
    the policy moved away from the sampler, which at step 1 is the anchor and the initial policy."""
    tr = Trainer(cfg("steps=1", "eval.size=0", f"algo.kl={estimator}", f"algo.k={k}", "log_kl_to_init=true",
                     "mini_batch_prompts=null", "algo.eta=0.9"), tmp_path, progress=False)
    batch = tr.rollout(1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tr.run.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    temperature, mask = tr.run.cfg.rollout.temperature, batch.response_mask
    policy = full_logits(tr.run.model, batch, temperature)
    with tr.run.anchor.use(tr.run.model) as m:
        anchor = full_logits(m, batch, temperature)
    mean = lambda t: float((t * mask).sum() / mask.sum())  # noqa: E731
    want = mean(token_kl(policy, anchor, batch.response_ids, estimator=estimator, k=k, sampling_logits=anchor))
    to_init = mean(token_kl(policy, anchor, batch.response_ids, estimator="k3", sampling_logits=anchor))
    row = tr.update(batch)
    assert abs(want) > 1e-3 and to_init > 1e-3  # the policy did move
    assert row["kl"] == pytest.approx(want, rel=1e-4)
    assert row["kl_to_init"] == pytest.approx(to_init, rel=1e-4)
    assert row["grad_norm"] > 0 and row["skipped_updates"] == 0


def test_under_top_p_the_sampler_head_is_pi_olds_top_k_from_the_trainer(tmp_path):
    """Under top-p the sampler's processed distribution has fewer than k ids at most positions (the rest of its
    top-k are -inf ties in no order); the head is then pi_old's own top-k from the trainer's pi_old pass, as the
    reference fork takes it: checked against each row's full softmax, recomputed here without padding."""
    tr = Trainer(cfg("steps=1", "eval.size=0", "rollout.top_p=0.02", "algo.k=8"), tmp_path, progress=False)
    mb = tr.rollout(1).micro_batches(tr.run.cfg.micro_batch_prompts)[0]
    anc = tr.anchor_pass(mb)
    valid = mb.response_mask.bool()
    truth = []
    with torch.no_grad():
        for row in range(mb.response_ids.shape[0]):
            p = row // mb.n
            prompt = mb.prompt_ids[p][mb.prompt_mask[p].bool()]
            n = int(valid[row].sum())
            ids = torch.cat([prompt, mb.response_ids[row, :n]])
            logits = tr.run.model(ids[None]).logits[0, len(prompt) - 1: len(prompt) - 1 + n].float()
            truth.append(torch.softmax(logits / tr.run.cfg.rollout.temperature, -1))
    probs = torch.cat(truth)
    top = probs.topk(8, -1).values
    got = probs.gather(-1, anc.head_ids).sort(-1, descending=True).values
    torch.testing.assert_close(got, top, rtol=0, atol=1e-6)  # a true top-8 of pi_old (ties may swap ids)
    nucleus = (probs.sort(-1, descending=True).values.cumsum(-1) < 0.02).sum(-1) + 1
    assert bool((nucleus < 8).any())  # where the sampler's own top-8 would be -inf ties beyond its nucleus
    assert mb.samp_topk is None  # so the sampler records no top-k: the pi_old pass gives it


def test_two_ppo_epochs_with_top_p_recompute_pi_old(tmp_path, monkeypatch):
    """Under top-p the sampler's log-probs are not the policy's: the first update's ratio must be
    pi_theta / pi_old with pi_old recomputed (exactly 1), not pi_theta / pi_samp = 1 - the cut mass."""
    import emapg.algo as algo_mod

    tr = Trainer(cfg("steps=1", "eval.size=0", "algo.ppo_epochs=2", "mini_batch_prompts=2", "rollout.top_p=0.9",
                     "lr=0.05"), tmp_path, progress=False)
    ratios = []
    real = algo_mod.clipped_surrogate

    def spy(logp, old_logp, *args):
        out = real(logp, old_logp, *args)
        ratios.append(out.ratio)
        return out

    monkeypatch.setattr(algo_mod, "clipped_surrogate", spy)
    batch = tr.rollout(1)
    row = tr.update(batch)
    mb = batch.micro_batches(tr.run.cfg.micro_batch_prompts)[0]
    valid = mb.response_mask.bool()
    torch.testing.assert_close(ratios[0][valid], torch.ones(int(valid.sum())), rtol=0, atol=1e-5)
    assert float(mb.top_p_cut[valid].max()) > 1e-2  # pi_samp would have given a ratio this far from 1
    assert row["top_p_cut"] > 0  # top-p cut some mass, and it is reported
    assert row["ratio_max"] > 1.0 + 1e-4  # later mini-batches and the 2nd epoch see a moved policy
    assert row["skipped_updates"] == 0


def test_lora_training_with_ema_of_adapters(tmp_path):
    tr = Trainer(cfg("steps=2", "lora.r=4", "algo.eta=0.5", "export=true", "eval.size=4"), tmp_path, progress=False)
    assert tr.run.anchor.mode == "lora" and tr.run.anchor.module is None
    base = {n: p.detach().clone() for n, p in tr.run.model.named_parameters() if not p.requires_grad}
    tr.train()
    assert all(torch.equal(p, base[n]) for n, p in tr.run.model.named_parameters() if not p.requires_grad)
    adapters = {n: p for n, p in tr.run.model.named_parameters() if p.requires_grad}
    assert set(tr.run.anchor.average) == set(adapters)
    assert any(not torch.equal(tr.run.anchor.average[n], p.float()) for n, p in adapters.items())
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "anchor")
    assert not any("lora" in n for n, _ in merged.named_parameters())


def test_pruning_never_removes_latest_and_drops_an_abandoned_future(tmp_path):
    from emapg.run.checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    ck = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        save_checkpoint(ck, step, model.state_dict(), {}, opt, {}, keep=2)
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_000020", "step_000030"]
    # resumed from step 20 (step 30's future is abandoned), then saves 25 with keep=1
    save_checkpoint(ck, 25, model.state_dict(), {}, opt, {}, keep=1)
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_000025"]
    assert latest_checkpoint(tmp_path).name == "step_000025"
    save_checkpoint(ck, 25, model.state_dict(), {}, opt, {}, keep=1)  # re-saving a step replaces it
    assert latest_checkpoint(tmp_path).name == "step_000025" and not list(ck.glob(".*"))


def _saved_bytes_and_grads(tr, mb):
    """Bytes autograd keeps for backward in the trainer's policy pass, and the gradients."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    tr.run.model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        st = tr._logprobs(tr.run.model, mb)
    st.logp_tok.sum().backward()
    return saved[0], {n: p.grad.clone() for n, p in tr.run.model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_saves_activation_memory_and_keeps_the_gradients(tmp_path):
    from emapg.rollout.sampling import RolloutBatch

    g = torch.Generator().manual_seed(0)
    prompt, resp = torch.randint(3, 259, (4, 20), generator=g), torch.randint(3, 259, (4, 200), generator=g)
    mb = RolloutBatch(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), response_ids=resp,
                      response_mask=torch.ones_like(resp), samp_logp=torch.zeros(4, 200), n=1)
    runs = {}
    for ckpt in (False, True):
        tr = Trainer(cfg("prefix_sharing=false", f"gradient_checkpointing={str(ckpt).lower()}", "eval.size=0"),
                     tmp_path / str(ckpt), progress=False)
        tr.rollout(1)  # a rollout in between: sampling must not leave the layers' flags changed
        runs[ckpt] = _saved_bytes_and_grads(tr, mb)
    (plain, g_plain), (ckpt, g_ckpt) = runs[False], runs[True]
    assert ckpt < 0.3 * plain, (ckpt, plain)
    assert g_plain.keys() == g_ckpt.keys()
    for name in g_plain:
        torch.testing.assert_close(g_ckpt[name], g_plain[name], atol=1e-6, rtol=1e-5)


def test_lora_dropout_is_on_in_the_policy_pass_only(tmp_path):
    from emapg.models.lm import set_pass_mode

    tr = Trainer(cfg("lora.r=4", "lora.dropout=0.5", "eval.size=0"), tmp_path, progress=False)
    drops = [m for n, m in tr.run.model.named_modules() if ".lora_dropout." in f".{n}."]
    assert drops
    set_pass_mode(tr.run.model, grad=True, lora_dropout=True)
    assert all(m.training for m in drops)
    assert not any(m.training for n, m in tr.run.model.named_modules() if m not in drops)  # no checkpointing asked
    set_pass_mode(tr.run.model, grad=False, lora_dropout=True)
    assert not any(m.training for m in tr.run.model.modules())


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    Trainer(cfg("steps=4", "save_every=2", "keep_checkpoints=2", "eval.size=0"), run, progress=False).train()
    return run


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _drop_a_tensor(path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    tensors.pop(next(k for k in sorted(tensors) if ".layers.0." in k))
    save_file(tensors, path)


DAMAGE = {
    "truncated policy": ("step_000004/policy.safetensors", _truncate, 2),
    "truncated optimizer": ("step_000004/optimizer.safetensors", _truncate, 2),
    "garbage state": ("step_000004/state.json", lambda p: p.write_text("{not json"), 2),
    "state without step": ("step_000004/state.json", lambda p: p.write_text('{"skipped_steps": 0}'), 2),
    "missing key": ("step_000004/policy.safetensors", _drop_a_tensor, 2),
    "garbage latest": ("latest", lambda p: p.write_bytes(b"\xff\xfe garbage"), 4),
    "state of another step": ("step_000004/state.json", lambda p: _set_state(p, step=99), 2),
    "step not a number": ("step_000004/state.json", lambda p: _set_state(p, step="four"), 2),
}


def _set_state(path, **changes):
    state = json.loads(path.read_text())
    state.update(changes)
    path.write_text(json.dumps(state))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_resumes(finished_run, tmp_path, damage, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    file, hurt, step = DAMAGE[damage]
    hurt(run / "checkpoints" / file)
    tr = Trainer(cfg("steps=6", "save_every=2", "eval.size=0"), run, resume=True, progress=False)
    assert tr.run.progress.step == step
    if step == 2:
        assert file.split("/")[-1] in capsys.readouterr().err  # the damaged file is named
    tr.train()
    assert tr.run.progress.step == 6


def test_latest_naming_a_deleted_checkpoint_is_named_and_the_newest_complete_one_resumes(finished_run, tmp_path,
                                                                                          capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "checkpoints" / "step_000004")  # latest still names it
    tr = Trainer(cfg("steps=6", "save_every=2", "eval.size=0"), run, resume=True, progress=False)
    assert tr.run.progress.step == 2
    assert "names step_000004, which is incomplete or missing" in capsys.readouterr().err


def test_when_no_checkpoint_is_intact_resume_says_which_files_are_damaged(finished_run, tmp_path):
    import shutil

    from emapg.run.checkpoint import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    for step in ("step_000002", "step_000004"):
        _truncate(run / "checkpoints" / step / "anchor.safetensors")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint.*step_000004/anchor.safetensors.*"
                                              r"step_000002/anchor.safetensors"):
        Trainer(cfg("eval.size=0"), run, resume=True, progress=False)
    out = subprocess.run([sys.executable, "-m", "emapg", "train", "--resume", str(run), "steps=6"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "anchor.safetensors is damaged" in out.stderr


def test_evaluation_samples_as_the_eval_section_says_and_else_as_the_rollout():
    from emapg.rollout.sampling import SamplingSpec
    from emapg.run.evaluate import eval_sampling

    base = ["rollout.temperature=0.9", "rollout.top_p=0.8", "rollout.max_new_tokens=20"]
    assert eval_sampling(cfg(*base)) == SamplingSpec(n=1, temperature=0.9, top_p=0.8, max_new_tokens=20, greedy=True)
    got = eval_sampling(cfg(*base, "eval.greedy=false", "eval.temperature=0.6", "eval.top_p=0.95",
                            "eval.max_new_tokens=7"))
    assert got == SamplingSpec(n=1, temperature=0.6, top_p=0.95, max_new_tokens=7, greedy=False)


def test_the_validation_table_covers_every_number_and_names_only_real_fields():
    import dataclasses
    import typing

    from emapg.config import RULES, TrainConfig

    def fields(cls, prefix=""):
        for f in dataclasses.fields(cls):
            typ = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(typ):
                yield from fields(typ, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", typ

    numbers = {name for name, typ in fields(TrainConfig)
               if {int, float} & ({typ} | set(typing.get_args(typ))) and typ is not bool}
    assert numbers - set(RULES) == set()  # the seed too: any 64-bit integer
    assert set(RULES) <= {name for name, _ in fields(TrainConfig)}


def test_every_evaluation_keeps_its_per_problem_outcomes_on_both_held_out_sets(tmp_path):
    """Held-out and transfer sets (subtraction, never trained on), policy and anchor: one line of 0/1
    per evaluation, in the order of the set's ids, whose mean is the accuracy the metrics report."""
    tr = Trainer(cfg("steps=2", "eval.every=1", "eval.size=8", "eval.transfer={ops: '-'}", "eval.transfer_size=6",
                     "save_every=1"), tmp_path, progress=False)
    tr.train()
    ids = {s: json.loads((tmp_path / "outcomes" / f"{s}.ids.json").read_text()) for s in ("heldout", "transfer")}
    assert ids["heldout"] == [ex.id for ex in tr.run.task.eval_examples(8)] and len(ids["transfer"]) == 6
    assert all(" - " in ex.messages[-1]["content"] for ex in tr.run.evaluator.sets["transfer"][1])
    lines = [json.loads(x) for x in (tmp_path / "outcomes" / "outcomes.jsonl").read_text().splitlines()]
    assert [(r["step"], r["set"], r["model"]) for r in lines] == [
        (0, "heldout", "policy"), (0, "transfer", "policy"),
        *[(s, st, m) for s in (1, 2) for m in ("policy", "anchor") for st in ("heldout", "transfer")]]
    rows = {r["step"]: r for r in read_metrics(tmp_path)}
    for r in lines:
        key = f"eval/{r['model']}_accuracy" if r["set"] == "heldout" else f"eval/transfer_{r['model']}_accuracy"
        assert len(r["solved"]) == len(ids[r["set"]]) and set(r["solved"]) <= {"0", "1"}
        assert sum(map(int, r["solved"])) / len(r["solved"]) == pytest.approx(rows[r["step"]][key])
    # eval.md pairs the last anchor and policy evaluations problem by problem
    last = {r["model"]: r["solved"] for r in lines if r["step"] == 2 and r["set"] == "heldout"}
    only_anchor = sum(a > b for a, b in zip(last["anchor"], last["policy"], strict=True))
    only_policy = sum(b > a for a, b in zip(last["anchor"], last["policy"], strict=True))
    assert (f"same 8 heldout problems (step 2): only the anchor solved {only_anchor}, only the policy "
            f"{only_policy};") in (tmp_path / "eval.md").read_text()
    # a resume replays the steps after its checkpoint: their lines go, and come back once
    tr.run.evaluator.forget_after(1)
    assert [json.loads(x)["step"] for x in (tmp_path / "outcomes" / "outcomes.jsonl").read_text().splitlines()] \
        == [0, 0, 1, 1, 1, 1]


def test_the_table_takes_infinity_where_it_switches_a_clip_off_and_names_a_wrong_type():
    from emapg.config import ConfigError, check_fields

    got = load_config(SMOKE, ["algo.max_grad_norm=.inf", "algo.dual_clip=.inf", "algo.is_clip=.inf"])
    assert got.algo.max_grad_norm == float("inf")
    for bad in ("algo.beta=.inf", "lr=.inf", "algo.eta=.nan"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(SMOKE, [bad])
    with pytest.raises(ConfigError, match=r"algo.eta: must be in \(0, 1\], got '0.9'"):  # a string, given directly
        check_fields({"algo.eta": "0.9"})


@pytest.mark.parametrize("kl,head,form", [("topk_reverse", "union", "residual"), ("topk_forward", "sampler", "bucket"),
                                          ("topk_reverse", "anchor", "renormalised"),
                                          ("topk_forward", "union", "truncated")])
def test_a_run_trains_with_each_kind_of_head_and_tail(tmp_path, kl, head, form):
    """The trainer's passes gather what the head needs (a union: the sampler's ids and the anchor's own) and
    the step is finite, its telemetry in the row, in float32 as trained."""
    tr = Trainer(cfg("steps=2", "eval.size=0", "save_every=0", "export=false", f"algo.kl={kl}", f"algo.head={head}",
                     f"algo.form={form}", "algo.k=8", "algo.beta=0.5"), tmp_path / "run", progress=False)
    w = next(tr.run.model.parameters()).detach().clone()
    tr.train()
    rows = read_metrics(tmp_path / "run")
    for row in rows:
        assert all(math.isfinite(row[key]) for key in ("kl", "grad_norm", "head_mass", "head_mass_anchor",
                                                        "tail_token_frac", "kl_tok_var"))
        assert 0 < row["head_mass"] < 1 and 0 <= row["tail_token_frac"] <= 1
    assert not torch.equal(next(tr.run.model.parameters()), w)


def test_epochs_walk_the_training_set_as_verls_seeded_sampler_does():
    """data_order: epochs gives, step by step, the batches of a DataLoader over a RandomSampler with a generator
    seeded with the run's seed and drop_last (verl's, with data.seed): every epoch a permutation, each example
    once per epoch, and any step computable alone (a resume mid-epoch continues it)."""
    from torch.utils.data import DataLoader, RandomSampler

    from emapg.tasks.base import epoch_indices

    size, per, seed = 10, 3, 6725
    sampler = RandomSampler(range(size), generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(range(size), batch_size=per, sampler=sampler, drop_last=True)
    want = [batch.tolist() for _ in range(3) for batch in loader]  # 3 epochs of 3 batches
    got = [epoch_indices(size, per, seed, step) for step in range(1, 10)]
    assert got == want
    for e in range(3):
        seen = [i for b in got[3 * e : 3 * e + 3] for i in b]
        assert len(set(seen)) == 9  # without replacement within an epoch
    assert epoch_indices(size, per, seed, 5) == want[4]  # step 5 alone, as a resume at step 4 asks it


def test_a_run_in_epochs_resumes_mid_epoch_as_it_would_have_run(tmp_path):
    math = ROOT / "tests" / "fixtures" / "evalsets"
    recipe = tmp_path / "math.yaml"
    files = f"{{train_file: {math / 'deepscaler_train.json'}, eval_file: {math / 'aime_2024.jsonl'}}}"
    recipe.write_text(SMOKE.read_text().replace('task: arithmetic\ntask_args: {digits: 1, ops: "+", terms: 2}',
                                                f"task: math\ntask_args: {files}"))
    args = ["data_order=epochs", "prompts_per_step=2", "micro_batch_prompts=1", "rollout.max_new_tokens=6",
            "eval.size=0", "export=false"]
    full, part = tmp_path / "full", tmp_path / "part"
    Trainer(load_config(recipe, [*args, "steps=5", "save_every=2"]), full, progress=False).train()  # 4 an epoch
    Trainer(load_config(recipe, [*args, "steps=2", "save_every=2"]), part, progress=False).train()  # stops at 2
    resumed = Trainer(load_config(part / "config.yaml", ["steps=5"]), part, resume=True, progress=False)
    resumed.train()
    a, b = strip_timing(read_metrics(full)), strip_timing(read_metrics(part))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for ra, rb in zip(a, b, strict=True):
        for key in set(ra) & set(rb):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), (ra["step"], key)


def test_run_plots_label_their_units_and_show_coinciding_series():
    """accuracy in % with its unit, whole-number steps, and an anchor equal to its policy drawn dashed and named
    "(= policy)" rather than hidden under it; the KL's axis says a step's estimate may be negative."""
    import matplotlib

    matplotlib.use("Agg")
    from emapg.run.metrics import run_figure

    rows = [{"step": s, "eval/policy_accuracy": 0.25, "eval/anchor_accuracy": 0.25, "kl": -1e-4 * s} for s in (1, 2, 3)]
    fig = run_figure(rows, "accuracy")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "accuracy (%)" and ax.get_xlabel() == "step"
    policy, anchor = ax.get_lines()
    assert list(policy.get_ydata()) == [25.0, 25.0, 25.0] and anchor.get_linestyle() == "--"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["policy", "EMA anchor (= policy)"]
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert "may be < 0" in run_figure(rows, "kl").axes[0].get_title()
    assert run_figure(rows, "entropy") is None  # nothing to draw: no empty panel


def test_under_mask_truncated_a_truncated_response_still_counts_its_length(tmp_path):
    """algo.mask_truncated takes a truncated response out of the loss, not out of the rollout's metrics: its
    length counts in response_length (the GPU check's tokens per second is computed from it)."""
    over = ("steps=1", "save_every=0", "eval.size=0", "algo.mask_truncated=true", "rollout.max_new_tokens=4")
    tr = Trainer(cfg(*over), tmp_path, progress=False)
    batch = tr.rollout(1)
    generated = float(batch.response_mask.sum(1).float().mean())
    truncated = batch.truncated.clone()
    assert truncated.any() and generated > 0  # a random model runs out of 4 tokens
    row = tr.update(batch)
    assert row["response_length"] == pytest.approx(generated)
    assert row["truncated_frac"] == float(truncated.float().mean())
    assert int(batch.response_mask[truncated].sum()) == 0  # ... and none of their tokens was trained on


def test_keep_every_keeps_the_checkpoints_a_recipe_documents_for_export(tmp_path):
    """keep_checkpoints prunes all but the newest; keep_every keeps every multiple of it besides, so that `emapg
    export RUN --step N` works on a finished run for the steps the recipes' documented commands name."""
    from emapg.run.export import export_checkpoint

    Trainer(cfg("steps=6", "save_every=1", "keep_checkpoints=1", "keep_every=3"), tmp_path, progress=False).train()
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert kept == ["step_000003", "step_000006"]
    assert (export_checkpoint(tmp_path, step=3) / "policy" / "config.json").exists()
    for recipe, step in (("math_r1_distill_1p5b", 240), ("math_r1_distill_1p5b_16k", 720),
                         ("search_qwen2p5_3b", 500), ("opd_r1_distill_1p5b", 200)):
        c = load_config(ROOT / "recipes" / f"{recipe}.yaml")
        assert c.keep_every and step % c.keep_every == 0 and step % c.save_every == 0 and step <= c.steps, recipe
