"""Every GPU recipe as shipped, under torchrun with 2 processes (3 for one), at CPU size.

What a user with one node runs, scaled down: the recipe's own flags stay (prefix sharing, gradient checkpointing,
offload, recompute_old, its KL, tail and head, the 16k and 24k stages started from the stage before with
``init_from``); only sizes change, the model is a tiny one of the same family (Qwen2), the rollout backend is the
HF decode loop (vLLM's CPU build lives in .venv-vllm) and data are fixtures in the real formats (DeepScaleR's JSON
list, AIME 2024's rows, Search-R1's parquet with a running ``emapg serve-retriever``). Prompts differ in length
between ranks, and ``mask_truncated`` leaves some micro-batches with no counted position on one rank only: the run
of issue 54 that aborted at step 2. The math recipes pack micro-batches by tokens, with a budget scaled to the CPU
rows (130 tokens of rows of 33-283: in both steps one rank needs 2 micro-batches of a mini-batch where the other
needs 1, and makes 2).

Each recipe trains 2 steps uninterrupted, then the same run is resumed from its step-1 checkpoint (as after a
crash during step 2's save) and must equal it: every metrics row, and the policy, anchor and optimizer state.
Collectives are checked by torch (TORCH_DISTRIBUTED_DEBUG=DETAIL: ranks disagreeing on a collective fail at once,
the collective named) and bounded (EMAPG_COLLECTIVE_TIMEOUT), and each launch by a timeout.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"),
       "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "EMAPG_COLLECTIVE_TIMEOUT": "90"}
LAUNCH_TIMEOUT = 300
CPU_SIZE = ["model=tiny-qwen2", "steps=2", "prompts_per_step=4", "mini_batch_prompts=2", "micro_batch_prompts=1",
            "rollout.n=2", "rollout.max_new_tokens=24", "rollout.backend=hf", "save_every=1", "keep_checkpoints=3",
            "eval.max_new_tokens=8", "threads=2"]
MATH_DATA = [f"task_args.train_file={FIXTURES / 'evalsets' / 'deepscaler_train.json'}",
             f"task_args.eval_file={FIXTURES / 'evalsets' / 'aime_2024.jsonl'}", "eval.size=1", "eval.samples=2",
             "micro_batch_tokens=130"]  # the recipes' 30,000 at CPU rows' size: ranks need unlike numbers of them
TIMING = ("step_seconds", "gen_seconds", "anchor_seconds")


def emapg(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N -m emapg ARGS``, as the recipes' headers write it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "emapg",
           *args]
    try:
        proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(args[:4])}: no end within {LAUNCH_TIMEOUT} s (a rank hangs)\n"
                             f"{(e.stderr or b'')[-4000:]}") from None
    assert proc.returncode == 0, f"{' '.join(args[:4])} failed:\n{proc.stderr[-6000:]}"
    return proc


def rows(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING and not k.startswith("peak_")}
            for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def same_run(full: Path, resumed: Path, steps: int) -> None:
    """The resumed run equals the uninterrupted one: every metrics row, the final checkpoint's tensors."""
    a, b = rows(full), rows(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] and a[-1]["step"] == steps
    for ra, rb in zip(a, b, strict=True):
        assert set(ra) == set(rb), ra["step"]
        for key, value in ra.items():
            assert rb[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (ra["step"], key)
    last = f"checkpoints/step_{steps:06d}"
    for name in ("policy", "anchor", "optimizer"):
        x, y = load_file(full / last / f"{name}.safetensors"), load_file(resumed / last / f"{name}.safetensors")
        assert set(x) == set(y), name
        for key in x:
            torch.testing.assert_close(y[key], x[key], rtol=0, atol=0, msg=f"{name}: {key}")


def train_and_resume(tmp: Path, recipe: str, overrides: list[str], nproc: int = 2, steps: int = 2,
                     resume: tuple[str, ...] = ()) -> Path:
    """Train ``recipe`` to ``steps`` (2 steps) on ``nproc`` processes; resume a copy from the step before the
    last (``resume``: more arguments of that call); check the two are equal."""
    full, resumed = tmp / "full", tmp / "resumed"
    emapg(nproc, "train", "--config", str(ROOT / "recipes" / f"{recipe}.yaml"), "--out", str(full),
          *CPU_SIZE, f"steps={steps}", *overrides)
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step_{steps:06d}")  # lost in a crash: the resume starts a step before
    emapg(nproc, "train", "--resume", str(resumed), *resume)
    same_run(full, resumed, steps)
    return full


_stages: dict[str, Path] = {}


def stage(recipe: str, tmp_path_factory) -> Path:
    """A math stage's uninterrupted run (the next stage's ``init_from``), trained once per session."""
    if recipe not in _stages:
        before, steps = {"math_r1_distill_1p5b_16k": ("math_r1_distill_1p5b", 4),
                         "math_r1_distill_1p5b_24k": ("math_r1_distill_1p5b_16k", 6)}.get(recipe, (None, 2))
        start = [f"init_from={stage(before, tmp_path_factory)}"] if before else []  # counts on from its step
        _stages[recipe] = train_and_resume(tmp_path_factory.mktemp(recipe), recipe, MATH_DATA + start, steps=steps)
    return _stages[recipe]


@pytest.mark.parametrize("recipe", ["math_r1_distill_1p5b", "math_r1_distill_1p5b_16k", "math_r1_distill_1p5b_24k"])
def test_math_stages_run_as_shipped_on_two_processes(recipe, tmp_path_factory):
    """Stage 1 (8k, mask_truncated), then 16k and 24k from the stage before's checkpoint, as the paper runs them."""
    run = stage(recipe, tmp_path_factory)
    assert json.loads((run / "eval.json").read_text())  # the held-out table was written by rank 0
    assert (run / "export" / "policy" / "config.json").exists()


def test_topk_math_variant_runs_on_two_processes(tmp_path):
    train_and_resume(tmp_path, "math_r1_distill_1p5b_topk", MATH_DATA)


def test_math_recipe_runs_on_three_processes(tmp_path):
    """An odd world: 3 ranks, each its share of every mini-batch of 3 prompts."""
    train_and_resume(tmp_path, "math_r1_distill_1p5b", [*MATH_DATA, "prompts_per_step=6", "mini_batch_prompts=3",
                                                         "threads=3"], nproc=3)


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    """``emapg serve-retriever`` over a BM25 index of the Wikipedia sample, on a free loopback port."""
    import socket
    import time
    import urllib.request

    ix = tmp_path_factory.mktemp("index") / "wiki"
    subprocess.run([sys.executable, "-m", "emapg", "index", "build", "--corpus",
                    str(FIXTURES / "corpus" / "flashrag_wiki_sample.jsonl"), "--out", str(ix)],
                   env=ENV, check=True, capture_output=True, timeout=120)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "emapg", "serve-retriever", "--index", str(ix), "--port", str(port)],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < end, "the retriever never answered /health"
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/retrieve"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def search_data(folder: Path) -> list[str]:
    """Search-R1's train.parquet and merged test.parquet, from the QA fixtures (questions of 6 to 30 words)."""
    from test_evalsets import write_search_r1_parquet

    def questions(*names):
        out = []
        for name in names:
            for line in (FIXTURES / "qa" / f"{name}.jsonl").read_text().splitlines():
                row = json.loads(line)
                out.append((name.split("_")[0], row["question"], row["answers"]))
        return out

    write_search_r1_parquet(folder / "train.parquet", questions("nq", "hotpotqa_dev"))
    write_search_r1_parquet(folder / "test.parquet", questions("nq", "hotpotqa_dev"))
    return [f"task_args.train_file={folder / 'train.parquet'}", f"task_args.eval_file={folder / 'test.parquet'}"]


@pytest.mark.parametrize("recipe", ["search_qwen2p5_3b", "search_qwen2p5_3b_unbiased"])
def test_search_recipes_run_on_two_processes(recipe, tmp_path, retriever):
    """The agent loop against a running retriever (the recipe's retriever_url, on this test's port)."""
    train_and_resume(tmp_path, recipe, [*search_data(tmp_path), f"task_args.retriever_url={retriever}",
                                        "task_args.max_turn_tokens=24", "task_args.max_info_tokens=64",
                                        "task_args.max_total_tokens=256", "eval.size=3"])


def test_distillation_recipe_runs_on_two_processes(tmp_path):
    """The OPD recipe with a teacher folder of the student's family (another seed), sharded like the policy."""
    from emapg.models.zoo import byte_tokenizer, tiny_model

    teacher = tmp_path / "teacher"
    tiny_model("qwen2", vocab_size=259, seed=7).save_pretrained(teacher)
    byte_tokenizer().save_pretrained(teacher)
    train_and_resume(tmp_path, "opd_r1_distill_1p5b", [*MATH_DATA, f"algo.teacher={teacher}"])


@pytest.mark.parametrize("nproc", [2, 3])
def test_search_episodes_that_really_search_run_on_ragged_processes(nproc, tmp_path, retriever):
    """The search recipe with a scripted policy (tests/fixtures/scripted_search_policy.py, a backend plugin: a
    random model never writes <search>) whose episodes search once or twice by question, against the running BM25
    retriever: ranks hold episodes of different numbers of turns and lengths, and the run resumes equal to the
    uninterrupted one on 2 and 3 processes."""
    plugin = FIXTURES / "scripted_search_policy.py"
    full = train_and_resume(tmp_path, "search_qwen2p5_3b", [
        *search_data(tmp_path), f"task_args.retriever_url={retriever}", "task_args.max_turn_tokens=48",
        "task_args.max_info_tokens=64", "task_args.max_total_tokens=384", "eval.size=0", f"plugins=[{plugin}]",
        "rollout.backend=scripted", f"prompts_per_step={2 * nproc}", f"mini_batch_prompts={nproc}"],
        nproc=nproc, resume=("--trust-plugins",))
    steps = [r for r in rows(full) if "searches_mean" in r]
    assert len(steps) == 2 and all(1.0 < r["searches_mean"] < 2.0 for r in steps)  # some searched twice, some once
    assert all(r["turns_mean"] > 2.0 and r["info_tokens_mean"] > 64 for r in steps)  # real passages, each answered
    assert all(r["truncated_frac"] == 0.0 for r in steps)
