"""Peak memory per rank while a run saves and resumes a checkpoint, on 1, 2 and 3 processes (torchrun, FSDP2
on gloo), side by side: emapg's per-shard files (each rank writes and reads its own rows of whole-tensor
safetensors files) against gathering whole tensors (rank 0 gathers policy, anchor and AdamW state to save;
every rank loads all of them to resume: emapg before 2026-12-06, and the common way).

    python bench/checkpoint_memory.py [--out docs/results/checkpoint_memory.json]

The model is a random Qwen2 of 62M parameters (hidden 768, 6 layers, 32,000-token vocabulary): its checkpoint
(fp32 policy, anchor and AdamW moments) is 0.99 GB. Each (mode, world) runs in its own launch; each rank reports
the peak of its resident memory above its level before the save (or the resume), sampled every 2 ms.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, PeakRSS, commit, machine, worker_env

SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=0,
             eos_token_id=1, pad_token_id=1)


def make_model(folder: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from emapg.models.zoo import byte_tokenizer

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**SHAPE)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


def worker(mode: str, model: str, out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from emapg.config import load_config
    from emapg.models import distributed
    from emapg.run.checkpoint import load_checkpoint, optimizer_state_dict, optimizer_tensors, restore_training
    from emapg.run.trainer import Trainer

    cfg = load_config(ROOT / "recipes" / "smoke.yaml", [f"model={model}", "eval.size=0", "export=false",
                                                         "prompts_per_step=6", "micro_batch_prompts=1", "threads=1"])
    tr = Trainer(cfg, out / "run", progress=False)
    for p in tr.run.params:  # AdamW's moments exist after a step
        p.grad = torch.zeros_like(p)
    tr.run.optimizer.step()
    sharded, main = tr.run.dist.enabled, tr.run.dist.is_main
    ckpt_dir = out / "run" / "checkpoints"
    distributed.barrier()
    with PeakRSS() as save:
        if mode == "shards":
            path = tr.save()
        else:  # gather whole tensors, rank 0 writes
            policy = distributed.model_state(tr.run.model)
            anchor = tr.run.anchor.state_dict(gather=True)
            opt = distributed.optimizer_state(tr.run.model, tr.run.optimizer, whole=True)
            path = ckpt_dir / "whole"
            if main:  # safetensors' own writer, as emapg wrote checkpoints before
                path.mkdir(parents=True)
                tensors, meta = optimizer_tensors(opt)
                for name, state in (("policy", policy), ("anchor", anchor), ("optimizer", tensors)):
                    seen, plain = set(), {}
                    for k, v in state.items():  # a tied head shares its storage: a copy (as emapg did)
                        plain[k] = v.detach().clone() if v.data_ptr() in seen else v.detach().contiguous()
                        seen.add(v.data_ptr())
                    save_file(plain, path / f"{name}.safetensors")
                (path / "state.json").write_text(json.dumps({"step": 0, "optimizer": meta}))
            distributed.barrier()
            del policy, anchor, opt
    distributed.barrier()
    with PeakRSS() as resume:
        if mode == "shards":
            restore_training(load_checkpoint(path), tr.run.model, tr.run.anchor, tr.run.optimizer, cfg, sharded)
        else:  # every rank loads the whole files
            policy, anchor = load_file(path / "policy.safetensors"), load_file(path / "anchor.safetensors")
            tensors, meta = load_file(path / "optimizer.safetensors"), json.loads((path / "state.json").read_text())
            if sharded:
                distributed.load_model_state(tr.run.model, policy)
            else:
                tr.run.model.load_state_dict(policy, strict=False)
            tr.run.anchor.load_state_dict(anchor)
            distributed.load_optimizer_state(tr.run.model, tr.run.optimizer,
                                             optimizer_state_dict(tensors, meta["optimizer"]))
    rows = distributed.all_gather_objects({"rank": tr.run.dist.rank, "save_mb": save.extra, "resume_mb": resume.extra})
    if main:
        (out / "ranks.json").write_text(json.dumps(rows))
    distributed.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the measurements as JSON here")
    ap.add_argument("--worlds", default="1,2,3")
    args = ap.parse_args()
    env = worker_env()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_model(model)
        for world in [int(w) for w in args.worlds.split(",")]:
            for mode in ("whole", "shards"):
                out = Path(tmp) / f"{mode}-{world}"
                out.mkdir()
                launcher = [sys.executable] if world == 1 else [
                    sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
                subprocess.run([*launcher, __file__, "--worker", mode, str(model), str(out)], env=env, check=True,
                               stdout=subprocess.DEVNULL)
                ranks = json.loads((out / "ranks.json").read_text())
                results.append({"mode": mode, "world": world, "ranks": ranks,
                                 "save_mb_max": max(r["save_mb"] for r in ranks),
                                 "resume_mb_max": max(r["resume_mb"] for r in ranks)})
                print(f"{mode:6s} world {world}: save +{results[-1]['save_mb_max']:7.1f} MiB, resume "
                      f"+{results[-1]['resume_mb_max']:7.1f} MiB (the largest rank)", flush=True)
    print("\n| processes | save, whole tensors gathered | save, per shard | resume, whole files on every rank "
          "| resume, per shard |\n|---|---|---|---|---|")
    for world in sorted({r["world"] for r in results}):
        w = {r["mode"]: r for r in results if r["world"] == world}
        print(f"| {world} | {w['whole']['save_mb_max']:.0f} MiB | {w['shards']['save_mb_max']:.0f} MiB | "
              f"{w['whole']['resume_mb_max']:.0f} MiB | {w['shards']['resume_mb_max']:.0f} MiB |")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "commit": commit(), "shape": SHAPE,
                                              "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    else:
        main()
