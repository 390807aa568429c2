"""Data parallelism on CPU (gloo, FSDP2): 2 processes compute what 1 process computes, and their
checkpoints resume in either. The processes are real: torchrun runs tests/dist_worker.py."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from emapg.models import distributed

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def run(nproc: int, *args: str, worker: Path = WORKER, timeout: int = 300) -> None:
    """``worker`` with ``args`` in ``nproc`` processes (torchrun for more than one); asserts it succeeded."""
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.run([*launcher, str(worker), *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.parametrize("overrides", [
    [],  # one PPO epoch, prefix sharing, top-k reverse KL, EMA update
    ["algo.ppo_epochs=2", "mini_batch_prompts=2", "algo.kl=k3"],  # 4 optimizer steps, pi_old recomputed
    ["lora.r=4", "lora.target_modules=[q_proj,v_proj]"],  # adapters sharded, anchor = EMA of adapters
    ["algo.teacher=tiny-llama-h32", "algo.teacher_dtype=bfloat16", "algo.pg_coef=0.5", "algo.beta=0.5"],  # sharded too
    ["algo.eta=1.0", "algo.kl=k3", "weight_ema=0.5"],  # a weight EMA of its own beside the frozen anchor, sharded
    ["algo.eta=1.0", "weight_ema=0.5", "lora.r=4", "lora.target_modules=[q_proj,v_proj]"],  # ... of the adapters
], ids=["topk", "ppo-epochs", "lora", "teacher", "weight-ema", "weight-ema-lora"])
def test_two_processes_equal_one_process(tmp_path, overrides):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    run(1, "update", str(one), *overrides)
    run(2, "update", str(two), *overrides)
    a, b = load_file(one / "result.safetensors"), load_file(two / "result.safetensors")
    assert set(a) == set(b)
    assert any(k.startswith("grad.") for k in a) and any(k.startswith("anchor.") for k in a)
    assert any(k.startswith("vllm.") for k in a)  # the vLLM weight push gathers shards (and merges LoRA) alike
    if any("weight_ema" in o for o in overrides):  # the weight EMA moved off the frozen anchor, equal on 1 and 2
        ema = [k for k in a if k.startswith("ema.")]
        assert ema and any(not torch.equal(a[k], a["anchor." + k[len("ema."):]]) for k in ema)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
    grads = [a[k] for k in a if k.startswith("grad.")]
    assert sum(float(g.abs().sum()) for g in grads) > 0  # the comparison is not between zeros
    ra, rb = json.loads((one / "row.json").read_text()), json.loads((two / "row.json").read_text())
    assert set(ra) == set(rb)
    for key, value in ra.items():
        assert rb[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert ra["clip_frac"] > 0  # the fixed batch is off-policy: the clipped path is exercised too


def test_micro_batches_packed_by_tokens_give_the_unpartitioned_gradient(tmp_path):
    """One update on the fixed batch (ragged prompts and responses): micro-batches packed by tokens under budgets
    of one row each, of runs that cut prompts' groups (20: 5 micro-batches of 1-2 rows) and of the whole batch, and
    on 2 processes (20: rank 0 needs 3 micro-batches, rank 1 2 and makes 3, of other rows), give the gradient of
    the unpartitioned step (one micro-batch of the 4 prompts). The parameters and anchor after it agree to 1e-5:
    Adam's first step divides each gradient element by its size, so an element that is float noise (1e-9 here)
    moves by up to lr x noise / eps whatever the order of the sums."""
    run(1, "update", str(tmp_path), "micro_batch_prompts=4")
    whole = load_file(tmp_path / "result.safetensors")
    for nproc, budget in ((1, 1), (1, 20), (1, 10**6), (2, 20)):
        out = tmp_path / f"{nproc}-{budget}"
        out.mkdir()
        run(nproc, "update", str(out), f"micro_batch_tokens={budget}")
        got = load_file(out / "result.safetensors")
        assert set(got) == set(whole)
        for key in whole:
            grad = key.startswith("grad.")
            torch.testing.assert_close(got[key], whole[key], rtol=1e-5, atol=1e-7 if grad else 1e-5,
                                       msg=f"{nproc} processes, {budget} tokens: {key}")


def test_ranks_make_the_same_collectives_whatever_their_rows(tmp_path):
    """The sharded log-prob pass with prefix sharing on rows that make each rank want another length-group
    plan (4 groups on one, 1 on the other) and a micro-batch whose responses count no position on one rank:
    every rank makes the same collectives, and the log-probs and gradients equal one unsharded model's."""
    run(2, "ragged", str(tmp_path), timeout=180)
    a, b = load_file(tmp_path / "plain.safetensors"), load_file(tmp_path / "sharded.safetensors")
    assert set(a) == set(b) and sum(float(g.abs().sum()) for g in a.values()) > 0
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6, msg=key)


def test_an_unequal_plan_fails_fast_and_names_the_collective(tmp_path):
    """The same passes with each rank planning alone (the code before the plan was agreed): the run fails
    within its bound, and the message names the collective the ranks disagree on."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run([*launcher, str(WORKER), "ragged", str(tmp_path), "--no-agree"],
                          env={**ENV, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "Detected mismatch between collectives on ranks" in proc.stderr, proc.stderr[-3000:]
    assert "OpType=" in proc.stderr


def _same_checkpoint(a: Path, b: Path, more: tuple[str, ...] = ()) -> None:
    for name in ("policy", "anchor", "optimizer", *more):
        x, y = load_file(a / f"{name}.safetensors"), load_file(b / f"{name}.safetensors")
        assert set(x) == set(y), name
        for key in x:
            assert torch.equal(x[key], y[key]), f"{name}: {key}"
    sa, sb = json.loads((a / "state.json").read_text()), json.loads((b / "state.json").read_text())
    assert {k: v for k, v in sa.items() if k != "world"} == {k: v for k, v in sb.items() if k != "world"}


def test_checkpoints_resume_across_process_counts(tmp_path):
    """1 -> 2 -> 3 -> 1 processes: each loads the checkpoint the last wrote (each rank reading its rows only),
    writes it back bit for bit (each rank writing its rows only), and trains on. (Ranks sample with seeds of
    their own, so a run's samples depend on its number of processes: the resumed steps are not those of one
    process; resume on the same number equals the uninterrupted run: tests/test_recipe_matrix.py.)"""
    one = tmp_path / "one"
    run(1, "train", str(one), "1")
    # 1 -> 2: two processes load the 1-process checkpoint and write it back unchanged
    two = tmp_path / "two"
    shutil.copytree(one, two)
    run(2, "resave", str(two))
    _same_checkpoint(one / "checkpoints" / "step_000001", two / "checkpoints" / "step_000001")
    assert json.loads((two / "checkpoints" / "step_000001" / "state.json").read_text())["world"] == 2
    # ... and train on from it
    run(2, "train", str(two), "2", "--resume")
    # 2 -> 3: an odd world (rows of a shard no longer equal), then train on
    three = tmp_path / "three"
    shutil.copytree(two, three)
    run(3, "resave", str(three))
    _same_checkpoint(two / "checkpoints" / "step_000002", three / "checkpoints" / "step_000002")
    run(3, "train", str(three), "3", "--resume")
    # 3 -> 1: one process loads the 3-process checkpoint and writes it back unchanged, then trains on
    back = tmp_path / "back"
    shutil.copytree(three, back)
    run(1, "resave", str(back))
    _same_checkpoint(three / "checkpoints" / "step_000003", back / "checkpoints" / "step_000003")
    run(1, "train", str(back), "4", "--resume")
    steps = [json.loads(line)["step"] for line in (back / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_weight_ema_checkpoint_moves_between_process_counts_bit_for_bit(tmp_path):
    """weight_ema beside a frozen anchor under FSDP2: 2 processes write its file by rows, 3 read theirs and write
    it back unchanged, 1 resumes it and trains on (a weight EMA that moved: not the initial weights)."""
    two = tmp_path / "two"
    # (a random model's rewards are all 0 on this task, so no advantage moves it: weight decay does)
    run(2, "train", str(two), "2", "algo.eta=1.0", "algo.kl=k3", "weight_ema=0.5", "weight_decay=0.5")
    three = tmp_path / "three"
    shutil.copytree(two, three)
    run(3, "resave", str(three))
    _same_checkpoint(two / "checkpoints" / "step_000002", three / "checkpoints" / "step_000002", ("weight_ema",))
    ema = load_file(two / "checkpoints" / "step_000002" / "weight_ema.safetensors")
    anchor = load_file(two / "checkpoints" / "step_000002" / "anchor.safetensors")
    assert any(not torch.equal(ema[k], anchor[k]) for k in ema if k.startswith("average."))
    run(1, "train", str(three), "3", "--resume")
    assert (three / "checkpoints" / "step_000003" / "weight_ema.safetensors").exists()


def test_cli_nproc_runs_a_whole_run(tmp_path):
    """`emapg train --nproc 2`: eval split over ranks, metrics and checkpoints from rank 0, exports."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "emapg", "train", "--nproc", "2", "--config", str(ROOT / "recipes" / "smoke.yaml"),
         "--out", str(out), "steps=2", "eval.size=6", "threads=2", "save_every=1"],
        env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    table = (out / "eval.md").read_text()
    assert table in proc.stdout and "| policy |" in table and "| anchor |" in table  # printed once, from rank 0
    assert proc.stdout.count("| policy |") == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/anchor_accuracy" in rows[-1]
    assert (out / "checkpoints" / "step_000002" / "policy.safetensors").exists()
    from transformers import AutoModelForCausalLM

    # the exports, gathered from the shards by rank 0, hold the final step's weights: those of the
    # step-2 checkpoint, policy and anchor each, and the two differ (eta < 1 after two updates)
    exported = {}
    for which in ("policy", "anchor"):
        state = AutoModelForCausalLM.from_pretrained(out / "export" / which).state_dict()
        saved = load_file(out / "checkpoints" / "step_000002" / f"{which}.safetensors")
        saved = {n.removeprefix("average."): t for n, t in saved.items()}  # the anchor's file holds its average
        common = [n for n in saved if n in state]
        assert len(common) >= len(state) - 1  # all but a tied head
        for name in common:
            torch.testing.assert_close(state[name].float(), saved[name].float(), atol=1e-6, rtol=0, msg=name)
        exported[which] = state
    assert any(not torch.equal(exported["policy"][n], exported["anchor"][n]) for n in exported["policy"])
    # `emapg export` of the 2-process run's step-1 checkpoint: folders that transformers loads, holding that
    # checkpoint's policy and anchor, and that `emapg eval` evaluates
    step1 = tmp_path / "step1"
    proc = subprocess.run([sys.executable, "-m", "emapg", "export", str(out), "--step", "1", "--out", str(step1)],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and str(step1 / "policy") in proc.stdout, proc.stderr[-3000:]
    for which in ("policy", "anchor"):
        state = AutoModelForCausalLM.from_pretrained(step1 / which).state_dict()
        saved = load_file(out / "checkpoints" / "step_000001" / f"{which}.safetensors")
        saved = {n.removeprefix("average."): t for n, t in saved.items() if n not in ("num_steps", "num_updates")}
        assert len([n for n in saved if n in state]) >= len(state) - 1
        for name in saved:
            if name in state:
                torch.testing.assert_close(state[name], saved[name], atol=0, rtol=0, msg=name)
        assert any(not torch.equal(state[n], exported[which][n]) for n in state)  # step 1, not the final step
    models = [str(step1 / "policy"), str(step1 / "anchor")]
    proc = subprocess.run([sys.executable, "-m", "emapg", "eval", "--run", str(out), "--model", *models, "--size", "4",
                           "--max-new-tokens", "8", "--out", str(tmp_path / "ev")],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads((tmp_path / "ev" / "eval.json").read_text())) >= 1
    bad = subprocess.run([sys.executable, "-m", "emapg", "export", str(out), "--step", "7"], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--step 7" in bad.stderr and "step_000001, step_000002" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_process_group_serves_offloaded_shards_on_gpus():
    """On CUDA the group carries CPU tensors too (offloaded shards, their norm, the anchor's average): an
    NCCL-only group would refuse them (pytorch#148532); on a CPU gloo serves everything."""
    assert distributed.backend("cuda") == "cpu:gloo,cuda:nccl"
    assert distributed.served(distributed.backend("cuda")) == {"cpu": "gloo", "cuda": "nccl"}
    assert distributed.served(distributed.backend("cpu")) == {"cpu": "gloo"}
    assert "cpu" not in distributed.served("nccl")  # what the group was before: offload broke there


def test_a_rank_that_cannot_see_the_run_folder_is_named(tmp_path):
    """Several nodes without a shared filesystem (here: each rank in a folder of its own): every rank stops
    with a one-line error naming the rank and host that cannot see the run folder, before any model loads."""
    import socket

    run(2, "blind", str(tmp_path), timeout=120)
    for rank in (0, 1):
        message = (tmp_path / f"error{rank}.txt").read_text()
        assert f"rank 1 on {socket.gethostname()} cannot see the run folder" in message and "rank 0 on" not in message
        assert "filesystem every node shares" in message and "\n" not in message


def test_a_batch_that_does_not_split_is_refused():
    from emapg.config import ConfigError, check_world, load_config

    cfg = load_config(ROOT / "recipes" / "smoke.yaml", ["prompts_per_step=4", "micro_batch_prompts=2"])
    check_world(cfg, 2)
    with pytest.raises(ConfigError, match="prompts_per_step"):
        check_world(cfg, 3)
    with pytest.raises(ConfigError, match="micro_batch_prompts"):
        check_world(load_config(ROOT / "recipes" / "smoke.yaml", ["prompts_per_step=4", "micro_batch_prompts=4"]), 2)


def test_each_rank_holds_its_share_of_every_mini_batch():
    from emapg.run.trainer import rank_prompts

    assert rank_prompts(8, 8, 2, 0) == [0, 1, 2, 3] and rank_prompts(8, 8, 2, 1) == [4, 5, 6, 7]
    assert rank_prompts(8, 4, 2, 0) == [0, 1, 4, 5] and rank_prompts(8, 4, 2, 1) == [2, 3, 6, 7]
    assert rank_prompts(6, 6, 1, 0) == list(range(6))
    for world in (1, 2, 4):
        shares = [rank_prompts(16, 8, world, r) for r in range(world)]
        assert sorted(i for s in shares for i in s) == list(range(16))


def test_offloaded_shards_compute_what_one_process_computes(tmp_path):
    """offload: true keeps the shards in CPU memory (FSDP2's CPUOffloadPolicy): the same gradients, update
    and anchor as one process without it; one process refuses it."""
    from emapg.config import ConfigError, check_world, load_config

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    run(1, "update", str(one))
    run(2, "update", str(two), "offload=true")
    a, b = load_file(one / "result.safetensors"), load_file(two / "result.safetensors")
    assert set(a) == set(b) and any(k.startswith("grad.") for k in a)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
    assert json.loads((two / "offload.json").read_text()) == ["CPUOffloadPolicy"]  # every unit offloaded
    # every collective of the update, the checkpoint's gathers, the gradient norm and the vLLM push had its
    # tensors on a device the group serves (recorded at the dispatcher: FSDP2's, DTensor's and ours)
    seen = json.loads((two / "collectives.json").read_text())
    kinds = " ".join(seen["ops"])
    assert "allgather" in kinds and "reduce_scatter" in kinds and "allreduce" in kinds
    serves = distributed.served(seen["backend"])
    for op, devices in seen["ops"].items():
        assert set(devices) <= set(serves), (op, devices, seen["backend"])
    with pytest.raises(ConfigError, match="offload: true needs FSDP2 shards"):
        check_world(load_config(None, ["offload=true"]), 1)


def test_when_rank_0_refuses_a_data_file_the_other_ranks_say_one_line_not_a_traceback(tmp_path):
    """Rank 0 reads the data first (the other ranks wait in a collective): its one-line refusal, and from rank 1
    one line pointing at it, never rank 1's traceback from the collective that rank 0 left."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": null}\n')
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run([*launcher, "-m", "emapg", "train", "--config", "math_cpu", "--out", str(tmp_path / "run"),
                           "model=tiny-qwen2", f"task_args.train_file={bad}", f"task_args.eval_file={bad}",
                           "threads=1", "micro_batch_prompts=1"], env=ENV, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "field 'answer' is null" in proc.stderr and "rank 1 stops: rank 0 could not start the run" in proc.stderr
    assert "[rank1]: Traceback" not in proc.stderr and "terminate called" not in proc.stderr


@pytest.mark.parametrize("kill", ["torchrun", "rank 0", "rank 1", "emapg train"])
def test_a_killed_launcher_worker_or_emapg_train_is_said_in_one_line_with_how_to_resume(tmp_path, kill):
    """`emapg train --nproc 2` where SIGKILL ends torchrun (which prints nothing: it exited 247, silent), the rank-0
    worker (as the out-of-memory killer would: torch's error report and traceback only), rank 1 (rank 0's gloo
    traceback, 40 lines, before the launcher's line) or the user's emapg train
    itself (torchrun's traceback last, a resume line without --nproc): each is one line from emapg saying what
    ended and the resume command with --nproc 2; every process ends."""
    import signal
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "emapg", "train", "--nproc", "2", "--config",
                             str(ROOT / "recipes" / "smoke.yaml"), "--out", str(out), "steps=200", "eval.size=0",
                             "threads=1", "save_every=1", "export=false"],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 120
    while not (out / "checkpoints" / "latest").exists():
        assert proc.poll() is None and time.monotonic() < end, "the run never saved a checkpoint"
        time.sleep(0.2)
    (launcher,) = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    workers = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    rank = {r: next(w for w in workers if f"\0RANK={r}\0".encode() in b"\0" + Path(f"/proc/{w}/environ").read_bytes())
            for r in (0, 1)}
    os.kill(int({"torchrun": launcher, "rank 0": rank[0], "rank 1": rank[1]}.get(kill, proc.pid)), signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    resume = f"Continue from the last checkpoint: emapg train --resume {out} --nproc 2"
    if kill == "torchrun":
        assert proc.returncode == 137, err[-2000:]
        said = f"the torchrun launcher (PID {launcher}) was killed by SIGKILL; its workers stop with it."
    elif kill.startswith("rank"):
        assert proc.returncode == 137, err[-2000:]
        r = int(kill[-1])
        said = f"worker rank {r} (PID {rank[r]}) was killed by SIGKILL (the kernel's out-of-memory killer"
    else:
        said = (f"emapg: torchrun (PID {launcher}) was told to stop by SIGTERM (the emapg train that started it, "
                f"PID {proc.pid}, ended); its workers were stopped.")
    assert said in err and resume in err and "Traceback" not in err, err[-3000:]
    time.sleep(2)
    assert workers and not [w for w in [*workers, launcher] if Path(f"/proc/{w}").exists()]
