"""One process of EMAPGTrainer under DDP, as torchrun starts it (gloo on CPU: TRL's and accelerate's
multi-process code path). Trains 3 steps with an EMA reference, then 3 distilling from a teacher, and
writes, per rank, the policy's parameters, the reference's, and for the EMA the closed form the
reference should equal; tests/test_trl_plugin.py compares them.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/trl_ddp_worker.py TINY TEACHER OUT
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trl_plugin import Record, closed_form, config, dataset, reward  # noqa: E402

from emapg.integrations.trl import EMAPGTrainer  # noqa: E402


def train(mode: str, tiny: str, teacher: str, out: Path) -> None:
    kw = {"eta": 0.6} if mode == "ema" else {"teacher": teacher, "pg_coef": 0.5}
    tr = EMAPGTrainer(tiny, [reward], args=config(out, max_steps=3), train_dataset=dataset(16),
                      processing_class=AutoTokenizer.from_pretrained(tiny), **kw)
    theta0 = {n: p.detach().double().clone() for n, p in tr.model.named_parameters()}
    rec = Record(tr)
    tr.add_callback(rec)
    tr.train()
    result = {f"policy.{n}": p.detach().contiguous() for n, p in tr.model.named_parameters()}
    ref = tr.accelerator.unwrap_model(tr.ref_model)
    result |= {f"ref.{n}": p.detach().contiguous() for n, p in ref.named_parameters()}
    if mode == "ema":
        result |= {f"want.{n}": v.float().contiguous() for n, v in closed_form(theta0, rec.seen, 0.6).items()}
    rank = dist.get_rank() if dist.is_initialized() else 0
    save_file(result, str(out / f"{mode}{rank}.safetensors"))
    (out / f"{mode}{rank}.json").write_text(json.dumps({"processes": tr.accelerator.num_processes,
                                                      "steps": tr.state.global_step,
                                                      "distributed_type": str(tr.accelerator.distributed_type)}))


if __name__ == "__main__":
    for which in ("ema", "teacher"):  # one launch for both: the processes' start is most of the time
        train(which, sys.argv[1], sys.argv[2], Path(sys.argv[3]))
