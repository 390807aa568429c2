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
    from emapg.rollout.hf import prefill

    ids = torch.randint(3, 250, (3, 11))
    state = prefill(model, ids, torch.ones_like(ids))
    cached = sum(layer.keys.numel() + layer.values.numel() for layer in state.cache.layers)
    assert cached == 3 * 11 * shape.kv_bytes_per_token  # elements: x bytes per element gives the cache's bytes


CALIBRATIONS = [P.Calibration("float32", None, False), P.Calibration("float32", None, True),
                P.Calibration("float32", "bf16", False), P.Calibration("float32", "bf16", True),
                P.Calibration("bfloat16", None, False),  # FSDP2's bf16 mixed precision: the whole pass in bf16
                P.Calibration("float32", None, False, (4, 8.0, ("q_proj", "v_proj", "down_proj"))),  # LoRA
                P.Calibration("float32", None, True, (4, 8.0, ("q_proj", "v_proj", "down_proj")))]


@pytest.mark.parametrize("how", [CALIBRATIONS[0], CALIBRATIONS[3]], ids=["float32", "bf16-checkpointed"])
def test_a_calibration_leaves_nothing_alive(how):
    """A measured pass keeps no tensor once it returns: its copies of the model and what the pass saved go (the
    graph holding every saved tensor made a cycle through grad_fn that Python's collector cannot free, and every
    calibration of a 3B model left ~5 GB alive: 18.8 GB in this file's process)."""
    import gc
    import weakref

    shape = P.shape_of(P.model_config("tiny-qwen2"))
    model = P._layers_model(shape.config, 2, how)
    gone = weakref.ref(model.get_input_embeddings().weight)
    P._saved_bytes(model, P._calibration_batch(2, 3, 20, 30), how.mixed_precision == "bf16")
    del model
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("how", CALIBRATIONS, ids=lambda c: f"{c.dtype}-{c.mixed_precision}-ck{int(c.checkpointing)}"
                         f"-lora{int(c.lora is not None)}")
def test_the_activation_cost_fitted_at_short_rows_predicts_a_long_pass_to_the_byte(how):
    """Fitted on small prefix-shared micro-batches, the terms predict a held-out longer one (3 prompts x 4
    samples, a 70-token prompt, 150-token responses) and the plain pass of its rows, per layer and per pass."""
    shape = P.shape_of(P.model_config("tiny-qwen2"))
    cost = P.activation_cost(shape, how)
    one, two = (P._layers_model(shape.config, n, how) for n in (1, 2))
    torch.manual_seed(1)
    mb = P._calibration_batch(3, 4, 70, 150)
    auto = how.mixed_precision == "bf16"
    a, b = P._saved_bytes(one, mb, auto), P._saved_bytes(two, mb, auto)
    assert b - a == pytest.approx(cost.shared_layer_bytes(3, 12, 70, 150), rel=1e-6)
    assert 2 * a - b == pytest.approx(cost.pass_bytes(3, 12, 70, 150, sharing=True), rel=1e-3)
    a, b = P._saved_bytes(one, mb, auto, sharing=False), P._saved_bytes(two, mb, auto, sharing=False)
    assert b - a == pytest.approx(cost.layer_bytes(12, 70 + 150), rel=1e-6)
    assert 2 * a - b == pytest.approx(cost.pass_bytes(3, 12, 70, 150, sharing=False), rel=1e-3)
    # the terms are the pass's, not a fit that cancels: the prompt pass is the plain pass of a prompt, and
    # each row's response pass keeps the prompt's keys and values again (repeated and concatenated)
    if not how.checkpointing:
        assert cost.prompt_token == pytest.approx(cost.token, rel=1e-6)
        compute = 2 if how.mixed_precision == "bf16" else DTYPE_OF[how.dtype]
        assert cost.prefix_token == pytest.approx(2 * shape.kv_bytes_per_token // shape.layers * compute, rel=1e-6)
    else:  # a checkpointed layer keeps its input alone: the hidden state in the residual stream's dtype
        assert cost.token == pytest.approx(shape.hidden * DTYPE_OF[how.dtype], rel=0.05)
        assert cost.prefix_token == 0


DTYPE_OF = {"float32": 4, "bfloat16": 2}


def test_the_plan_agrees_with_a_measured_training_peak(tmp_path):
    """bench/memory_plan.py's smallest shape (2 training steps of a random 11M-parameter model, its own
    process): the plan within 15% of the measured peak (docs/BENCHMARKS.md holds the table of every shape)."""
    out = tmp_path / "rows.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "memory_plan.py"), "--shapes", "small", "--json",
                           str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["measured_mb"] > 300  # the run really ran (weights, anchor, optimizer state, activations)
    assert row["planned_mb"] == pytest.approx(row["measured_mb"], rel=0.15)
    for phase, measured in row["phases_measured_mb"].items():  # each phase, not only the peak: no terms cancel
        assert row["phases_planned_mb"][phase] == pytest.approx(measured, rel=0.15), phase


def test_the_plan_has_a_phase_for_every_part_of_a_run():
    """A distillation run with evaluations on 2 processes: its held-out decode loop, the teacher's answers and
    the float64 teacher KL are phases, and rank 0's export; without evaluation none of them; with vLLM the
    evaluation samples on the engine already counted."""
    teacher = P.shape_of(P.model_config("tiny-qwen2"))
    over = ["model=tiny-qwen2", "algo.teacher=tiny-qwen2", "eval.size=100", "eval.max_new_tokens=300",
            "rollout.max_new_tokens=64", "export=true"]
    cfg = load_config(ROOT / "recipes" / "smoke.yaml", over)
    p = P.plan(cfg, teacher, world=2, prompt_tokens=50, teacher=teacher, device="cpu")
    names = [ph.name for ph in p.phases]
    assert names == ["rollout", "reference", "update", "optimizer step", "evaluation",
                     "teacher's answers (evaluation)", "teacher KL passes (evaluation)",
                     "teacher KL log-probs (evaluation)", "export"]
    ev = {ph.name: ph.parts for ph in p.phases}
    # 50 problems a process (100 over 2), greedy: 50 rows of 50 + 300 tokens
    assert ev["evaluation"]["key/value cache"] == 50 * 350 * teacher.kv_bytes_per_token * 4
    assert ev["teacher KL log-probs (evaluation)"]["float64 log-probs of both models (256 positions)"] == \
        256 * teacher.vocab * (2 * 4 + 6 * 8)
    assert P.plan(cfg, teacher, world=1, prompt_tokens=50, teacher=teacher).host == {}  # one process: no gather
    quiet = load_config(ROOT / "recipes" / "smoke.yaml", [*over, "eval.size=0", "export=false"])
    assert [ph.name for ph in P.plan(quiet, teacher, world=2, teacher=teacher).phases] == \
        ["rollout", "reference", "update", "optimizer step"]


def test_fsdp2_bf16_plans_a_bf16_pass_and_one_process_autocast(monkeypatch):
    """Under FSDP2's mixed precision the weights are cast, so the whole pass (its residual stream) is bf16; one
    process autocasts around fp32 weights and keeps an fp32 residual stream: the plan calibrates each as it runs."""
    seen = []
    real = P.activation_cost
    monkeypatch.setattr(P, "activation_cost", lambda shape, how: seen.append(how) or real(shape, how))
    shape = P.shape_of(P.model_config("tiny-qwen2"))
    cfg = load_config(ROOT / "recipes" / "smoke.yaml", ["mixed_precision=bf16", "lora.r=4"])
    P.plan(cfg, shape, world=2, prompt_tokens=40)
    assert {(h.dtype, h.mixed_precision, h.lora is not None) for h in seen} == {("bfloat16", None, True)}
    seen.clear()
    P.plan(cfg, shape, world=1, prompt_tokens=40)
    assert {(h.dtype, h.mixed_precision) for h in seen} == {("float32", "bf16")}
    plain = load_config(ROOT / "recipes" / "smoke.yaml", ["mixed_precision=bf16"])
    one, two = (real(shape, P.calibration(plain, w, False)) for w in (1, 2))
    assert two.token < one.token and one.per_layer > 0  # bf16 residuals; autocast keeps weight copies, FSDP2 none
    assert two.per_layer == pytest.approx(0, abs=1e-3)


def test_the_paper_recipes_plans_from_their_configs():
    math = load_config(ROOT / "recipes" / "math_r1_distill_1p5b.yaml",
                       [f"model={CONFIGS / 'deepseek-r1-distill-qwen-1.5b'}"])
    text = P.report(math, gpus=8, gpu_memory_gb=80, prompt_tokens=512)
    assert "1.78B parameters" in text and "fits: peak" in text
    assert "vllm engine (weights and cache) | 68.00" in text  # 0.85 of 80 GiB, asleep during the update
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
    assert "\nlargest that fit" not in out and "\nwith offload=false (what one device runs), largest that fit" in out
    assert "does not run on 1 device(s): `emapg train` refuses it: offload: true needs FSDP2 shards" in out
    assert "with offload=false" in out and "a lower rollout.backend_args.gpu_memory" in out
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
    how = P.Calibration("float32", mixed, checkpointing)
    full = P._measured_cost(config, how)
    monkeypatch.setattr(P, "CALIBRATION_BYTES", 1)  # every width is "too wide": the narrowed path
    monkeypatch.setattr(P, "_COSTS", {})
    built = []
    real = P._layers_model
    monkeypatch.setattr(P, "_layers_model", lambda cfg, *a: built.append(cfg.hidden_size) or real(cfg, *a))
    narrow = P.activation_cost(shape, how)
    assert 256 not in built and set(built) == {128, 64, 32}
    for name in P.ActivationCost.__dataclass_fields__:
        assert getattr(narrow, name) == pytest.approx(getattr(full, name), rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("flags,chosen", [({"fpu", "avx2", "amx_bf16"}, "bf16"), ({"fpu", "avx512_bf16"}, "bf16"),
                                          ({"fpu", "avx2"}, None)])
def test_mixed_precision_auto_picks_bf16_where_the_cpu_has_it(flags, chosen, tmp_path, monkeypatch, capsys):
    """`mixed_precision: auto` is bf16 on a CPU with AMX-BF16 or AVX512-BF16 and fp32 elsewhere (where bf16 is
    emulated and slower), said at the start and recorded as chosen in config.yaml, so a resume keeps it."""
    import yaml

    from emapg.models import distributed
    from emapg.run.trainer import Trainer

    monkeypatch.setattr(distributed, "cpu_flags", lambda: flags)
    cfg = load_config(ROOT / "recipes" / "smoke.yaml", ["mixed_precision=auto", "eval.size=0", "steps=0"])
    tr = Trainer(cfg, tmp_path / "run", progress=False)
    assert tr.run.cfg.mixed_precision == chosen
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["mixed_precision"] == chosen
    said = capsys.readouterr().err
    assert f"mixed_precision auto: {'bf16' if chosen else 'fp32'} (this CPU has" in said
    text = P.report(cfg, gpus=1, gpu_memory_gb=80, prompt_tokens=64, device="cpu")
    assert ("autocast" in text) == (chosen == "bf16")  # the plan counts autocast's copies only when it is chosen
