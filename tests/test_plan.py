"""The memory plan (emapg.models.plan, `emapg plan`): its counts equal a real model's, its measured activation cost
extrapolates to a longer row, it agrees with a measured training peak on this CPU, the paper's recipes get a
plan from their hand-written configs, and a run the plan says cannot fit is refused before it starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from emapg.config import ConfigError, load_config
from emapg.models import plan as P
from emapg.models.zoo import load_model

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "model_configs"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_the_shape_counts_equal_the_real_models(name):
    model, tok = load_model(name)
    shape = P.shape_of(P.model_config(name))
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    assert shape.largest_param == max(p.numel() for p in model.parameters())
    from emapg.rollout.decode import prefill

    ids = torch.randint(3, 250, (3, 11))
    state = prefill(model, ids, torch.ones_like(ids))
    cached = sum(layer.keys.numel() + layer.values.numel() for layer in state.cache.layers)
    assert cached == 3 * 11 * shape.kv_bytes_per_token  # elements: x bytes per element gives the cache's bytes


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("mixed", [None, "bf16"])
def test_the_activation_cost_fitted_at_short_rows_predicts_a_long_one(checkpointing, mixed):
    shape = P.shape_of(P.model_config("tiny-qwen2"))
    cost = P.activation_cost(shape, "float32", mixed, checkpointing)
    one, two = (P._layers_model(shape.config, n, "float32", checkpointing) for n in (1, 2))
    measured = P._saved_bytes(two, 256, mixed == "bf16") - P._saved_bytes(one, 256, mixed == "bf16")
    assert cost.layer_bytes(1, 256) == pytest.approx(measured, rel=1e-6)
    if checkpointing:  # a checkpointed layer keeps its input alone: the hidden state, fp32 residual stream
        assert cost.per_token == pytest.approx(shape.hidden * 4, rel=0.05)


def test_the_plan_agrees_with_a_measured_training_peak(tmp_path):
    """bench/memory_plan.py's smallest shape (2 training steps of a random 11M-parameter model, its own
    process): the plan within 25% of the measured peak (docs/BENCHMARKS.md holds the table of every shape)."""
    out = tmp_path / "rows.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "memory_plan.py"), "--shapes", "small", "--json",
                           str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["measured_mb"] > 300  # the run really ran (weights, anchor, optimizer state, activations)
    assert row["planned_mb"] == pytest.approx(row["measured_mb"], rel=0.25)


def test_the_paper_recipes_plans_from_their_configs():
    math = load_config(ROOT / "recipes" / "math_r1_distill_1p5b.yaml",
                       [f"model={CONFIGS / 'deepseek-r1-distill-qwen-1.5b'}"])
    text = P.report(math, gpus=8, gpu_memory_gb=80, prompt_tokens=512)
    assert "1.78B parameters" in text and "fits: peak" in text
    assert "vLLM engine (weights and cache) | 68.00" in text  # 0.85 of 80 GiB, asleep during the update
    search = P.shape_of(P.model_config(str(CONFIGS / "qwen2.5-3b")))
    assert (search.params, search.layers, search.kv_heads, search.head_dim) == (3_085_938_688, 36, 2, 128)


def test_a_plan_that_does_not_fit_names_the_fixes():
    """The math recipe on one 80 GiB GPU with the HF sampler, no checkpointing, no offload: the rollout (1,024
    rows x 8.7k tokens of cache) and the update (8 rows' activations) do not fit; the largest row bound that
    fits is found, and with it the rollout phase fits."""
    over = [f"model={CONFIGS / 'deepseek-r1-distill-qwen-1.5b'}", "rollout.backend=hf", "offload=false",
            "gradient_checkpointing=false"]
    cfg = load_config(ROOT / "recipes" / "math_r1_distill_1p5b.yaml", over)
    shape = P.shape_of(P.model_config(cfg.model))
    p = P.plan(cfg, shape, world=1, prompt_tokens=512)
    assert p.phases[0].parts["key/value cache"] == 1024 * (512 + 8192) * 2 * 28 * 2 * 128 * 2  # bf16, 28 KiB a token
    reason = P.too_big(p, 80 * P.GIB, cfg)
    assert reason and "rollout.max_rows" in reason and "gradient_checkpointing=true" in reason
    best = P.largest_fitting(cfg, shape, 80 * P.GIB, world=1, prompt_tokens=512)
    assert 8 <= best["rollout.max_rows"] < 1024
    bounded = load_config(ROOT / "recipes" / "math_r1_distill_1p5b.yaml",
                          [*over, f"rollout.max_rows={best['rollout.max_rows']}"])
    assert P._phase(P.plan(bounded, shape, world=1, prompt_tokens=512), "rollout") <= 80 * P.GIB


def test_training_refuses_a_run_the_plan_says_cannot_fit(tmp_path, monkeypatch):
    from emapg.run import assembly, trainer

    monkeypatch.setattr(assembly, "device_capacity", lambda device: 2**20)  # a 1 MiB device
    smoke = ROOT / "recipes" / "smoke.yaml"
    with pytest.raises(ConfigError, match="the memory plan needs .* more than the device's 0.0 GiB"):
        trainer.Trainer(load_config(smoke, ["eval.size=0"]), tmp_path / "a", progress=False)
    trainer.Trainer(load_config(smoke, ["eval.size=0", "memory_check=false"]), tmp_path / "b", progress=False)


def test_on_the_cpu_a_run_that_cannot_fit_the_host_is_refused(tmp_path, monkeypatch):
    """`emapg train` on the CPU checks the plan too, against the host's memory shared by its processes (it never
    checked: a run too big was killed for memory minutes in)."""
    from emapg.run import assembly, trainer

    assert assembly.device_capacity(torch.device("cpu")) == assembly.host_memory() > 2**30  # this host's RAM
    monkeypatch.setattr(assembly, "host_memory", lambda: 2**20)  # a 1 MiB host
    smoke = ROOT / "recipes" / "smoke.yaml"
    with pytest.raises(ConfigError, match="the memory plan needs .* more than the device's 0.0 GiB"):
        trainer.Trainer(load_config(smoke, ["eval.size=0"]), tmp_path / "a", progress=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(assembly, "host_memory", lambda: 8.0 * 2**30)
    assert assembly.device_capacity(torch.device("cpu")) == 2.0 * 2**30  # 4 processes share the host


def test_the_plan_command(capsys):
    from emapg.cli import main

    assert main(["plan", "--config", "smoke", "--gpus", "1", "--gpu-memory", "1", "--prompt-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "| **peak (" in out and "fits: peak" in out
    assert main(["plan", "--config", "smoke", "--gpus", "0"]) == 2
    assert "--gpus: must be a finite number > 0" in capsys.readouterr().err
    from emapg.run.assembly import host_memory

    assert main(["plan", "--config", "smoke", "--device", "cpu", "--gpus", "2"]) == 0  # this host, shared by 2
    assert f"of {host_memory() / 2**30 / 2:.1f} GiB" in capsys.readouterr().out


PAPER_MODELS = {"math": CONFIGS / "deepseek-r1-distill-qwen-1.5b", "search": CONFIGS / "qwen2.5-3b",
                "opd": CONFIGS / "deepseek-r1-distill-qwen-1.5b"}
GPU_RECIPES = ["math_r1_distill_1p5b", "math_r1_distill_1p5b_16k", "math_r1_distill_1p5b_24k",
               "math_r1_distill_1p5b_topk", "search_qwen2p5_3b", "search_qwen2p5_3b_unbiased", "opd_r1_distill_1p5b"]


def _recipe_models(recipe: str) -> list[str]:
    overrides = [f"model={PAPER_MODELS[recipe.split('_')[0]]}"]
    if recipe.startswith("opd"):
        overrides.append(f"algo.teacher={CONFIGS / 'deepseek-r1-distill-qwen-7b'}")
    return overrides


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_every_shipped_recipe_fits_its_own_plan_on_one_node(recipe):
    """On the node the recipes are written for (8 GPUs of 80 GiB), with the paper's models' shapes (the OPD
    recipe with its 7B teacher): `emapg plan` says fits."""
    cfg = load_config(ROOT / "recipes" / f"{recipe}.yaml", _recipe_models(recipe))
    out = P.report(cfg, gpus=8, gpu_memory_gb=80, prompt_tokens=1024)
    assert "\nfits: peak" in out, out[-600:]


def test_plan_on_one_device_runs_the_checks_train_runs():
    """The paper's math recipe offloads (2+ processes): on one GPU `emapg plan` says train refuses it, plans what
    one device would run (offload off) and names the fixes that apply there."""
    cfg = load_config(ROOT / "recipes" / "math_r1_distill_1p5b.yaml", _recipe_models("math"))
    out = P.report(cfg, gpus=1, gpu_memory_gb=80, prompt_tokens=1024)
    assert "\nfits" not in out
    assert "does not run on 1 device(s): `emapg train` refuses it: offload: true needs FSDP2 shards" in out
    assert "with offload=false" in out and "a lower rollout.vllm_gpu_memory" in out
    # a batch that does not split over the devices is refused the same way
    out = P.report(load_config(ROOT / "recipes" / "math_r1_distill_1p5b.yaml", _recipe_models("math")), gpus=3,
                   gpu_memory_gb=80, prompt_tokens=1024)
    assert "does not run on 3 device(s)" in out and "prompts_per_step: 128 does not split over 3" in out
    # weights and optimizer state alone past the device: LoRA and offload are what helps
    big = load_config(ROOT / "recipes" / "search_qwen2p5_3b.yaml", [*_recipe_models("search"), "offload=false"])
    out = P.report(big, gpus=1, gpu_memory_gb=24, prompt_tokens=1024)
    assert "lora.r > 0" in out and "offload=true" in out


@pytest.mark.parametrize(("change", "args", "message"), [
    ({"hidden_size": 0}, [], "model: its config.json's hidden_size is 0, expected a whole number >= 1"),
    ({"num_hidden_layers": 0}, [], "num_hidden_layers is 0, expected a whole number >= 1"),  # was an IndexError
    ({}, ["--gpu-memory", "nan"], "--gpu-memory: must be a finite number > 0, got nan"),  # was accepted
    ({}, ["--gpus", "0"], "--gpus: must be a finite number > 0, got 0"),
])
def test_the_plan_refuses_what_no_run_could_be(tmp_path, change, args, message):
    """A config.json no model could have, or a device that cannot be, is one line naming the field (a plan of
    "0.00B parameters, fits" before)."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((ROOT / "tests/fixtures/model_configs/qwen2.5-3b/config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    res = subprocess.run([sys.executable, "-m", "emapg", "plan", "--config", "smoke", f"model={folder}", *args],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_model_name_that_is_nowhere_is_named_not_a_connection_error():
    res = subprocess.run([sys.executable, "-m", "emapg", "plan", "--config", "smoke", "model=Qwen/Qwen2.5-0.5B-Typo"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2 and "model: 'Qwen/Qwen2.5-0.5B-Typo' is neither a built-in name" in res.stderr


@pytest.mark.parametrize("mixed", [None, "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_layer_too_wide_to_build_is_measured_narrower_and_scaled_exactly(monkeypatch, mixed, checkpointing):
    """A 70B layer's calibration built 10.9 GB of full-width layers (57 s); a layer over the budget is measured at
    three narrower widths (head size kept) and extrapolated: equal to the full-width measurement, term by term."""
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=32)
    shape = P.shape_of(config)
    full = P._measured_cost(config, "float32", mixed, checkpointing)
    monkeypatch.setattr(P, "CALIBRATION_BYTES", 1)  # every width is "too wide": the narrowed path
    monkeypatch.setattr(P, "_COSTS", {})
    built = []
    real = P._layers_model
    monkeypatch.setattr(P, "_layers_model", lambda cfg, *a: built.append(cfg.hidden_size) or real(cfg, *a))
    narrow = P.activation_cost(shape, "float32", mixed, checkpointing)
    assert 256 not in built and set(built) == {128, 64, 32}
    for name in ("per_token", "per_token_sq", "per_layer"):
        assert getattr(narrow, name) == pytest.approx(getattr(full, name), rel=1e-9, abs=1e-6)
