"""The sharded log-prob pass on ranks whose rows differ in length: the agreed length-group plan (what emapg runs:
every rank makes the calls of the plan whose slowest rank pads least) against one call per pass (every row padded
to the micro-batch's longest), side by side in one run, forward and backward through FSDP2 on gloo.

    python bench/ragged_ranks.py [--reps 5]

Each of 2 processes holds micro-batches of 2 prompts x 2 responses whose lengths differ within and between ranks
(rank 0: 400, 300, 24, 8 tokens; rank 1: 380, 60, 30, 4), prefix sharing and gradient checkpointing on, a random
Qwen2 (hidden 256, 4 layers, 8,192-token vocabulary). Prints the median seconds per pass of each and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from _common import ROOT

LENGTHS = {0: [400, 300, 24, 8], 1: [380, 60, 30, 4]}


def worker(reps: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from emapg.models import distributed, forward
    from emapg.models.forward import SHARD_METHODS, model_logprobs
    from emapg.models.lm import set_pass_mode
    from emapg.rollout.sampling import RolloutBatch

    info = distributed.init("cpu")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model.gradient_checkpointing_enable()
    set_pass_mode(model, grad=True)
    distributed.shard(model, methods=SHARD_METHODS)
    g = torch.Generator().manual_seed(info.rank)
    lengths = LENGTHS[info.rank]
    width = max(lengths)
    mb = RolloutBatch(prompt_ids=torch.randint(3, 8192, (2, 64), generator=g), prompt_mask=torch.ones(2, 64).long(),
                      response_ids=torch.randint(3, 8192, (4, width), generator=g),
                      response_mask=(torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long(),
                      samp_logp=torch.zeros(4, width), n=2)
    agreed = forward._length_groups

    def one_call(need, sliding, agree=False):
        return [torch.argsort(need, descending=True, stable=True)]

    times = {"agreed plan": [], "one call": []}
    for rep in range(reps + 1):  # the first of each is a warm-up
        for name, plan in (("agreed plan", agreed), ("one call", one_call)):
            forward._length_groups = plan
            distributed.barrier()
            t0 = time.perf_counter()
            st = model_logprobs(model, mb)
            (st.logp_tok.sum() * info.world).backward()
            distributed.barrier()
            if rep:
                times[name].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    forward._length_groups = agreed
    if info.is_main:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"agreed plan {med['agreed plan']:.3f} s, one call {med['one call']:.3f} s per pass (median of {reps}); "
              f"one call / agreed plan = {med['one call'] / med['agreed plan']:.2f}x")
    distributed.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT / "bench")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                    "--worker", str(args.reps)], env=env, check=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]))
    else:
        main()
