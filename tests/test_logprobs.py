import pytest
import torch

from emapg.models.lm import token_logprobs


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_logprobs_equal_naive_values_and_gradients(chunk_size, with_bias):
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    N, H, V, k = 50, 8, 97, 5
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    tokens = torch.randint(0, V, (N,), generator=g)
    ids = torch.randint(0, V, (N, k), generator=g)
    out = token_logprobs(hidden, weight, tokens, ids=ids, bias=bias, temperature=0.8, k_self=k, entropy=True,
                         chunk_size=chunk_size)
    logits = (hidden @ weight.T + (0 if bias is None else bias)) / 0.8  # fp64 throughout, as the fast path
    logp = torch.log_softmax(logits, -1)
    want_tok = logp.gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logp_tok.double(), want_tok, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logp_ids.double(), logp.gather(-1, ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.lse.double(), torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)
    assert torch.equal(out.topk_ids, logits.topk(k, -1).indices)
    torch.testing.assert_close(out.entropy.double(), -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=1e-5)
    params = [hidden, weight] + ([bias] if with_bias else [])
    # every differentiable output enters, with weights of both signs
    c = torch.linspace(-1, 1, N, dtype=torch.float64)
    loss_fast = (out.logp_tok * c).sum() + (out.logp_ids * 0.3).sum() - 0.7 * out.lse.sum()
    loss_naive = ((logp.gather(-1, tokens[:, None]).squeeze(-1) * c).sum() + (logp.gather(-1, ids) * 0.3).sum()
                  - 0.7 * torch.logsumexp(logits, -1).sum())
    for a, b in zip(torch.autograd.grad(loss_fast, params), torch.autograd.grad(loss_naive, params), strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


class _BigOutputs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op whose result is a new tensor of a given shape (views and in-place ops excluded)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.ops = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inplace = func._schema.name.endswith("_") or any(a.is_out for a in func._schema.arguments)
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape and not (inplace or func.is_view):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("chunks", [1, 4])
def test_backward_makes_one_weight_gradient_whatever_the_number_of_chunks(chunks):
    """Autograd would sum one [V, H] weight gradient per chunk out of place; the head's backward
    allocates the weight gradient once and accumulates into it."""
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    N, H, V = 64, 24, 300
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    tokens = torch.randint(0, V, (N,), generator=g)
    ids = torch.randint(0, V, (N, 4), generator=g)
    out = token_logprobs(hidden, weight, tokens, ids=ids, chunk_size=N // chunks)
    loss = out.logp_tok.sum() + out.logp_ids.exp().sum()
    with _BigOutputs((V, H)) as seen:
        loss.backward()
    assert len(seen.ops) == 1, seen.ops  # the zero-initialised gradient buffer, nothing per chunk


def test_autocast_bf16_matches_the_naive_computation_in_bf16():
    g = torch.Generator(torch.get_default_device()).manual_seed(2)
    N, H, V = 40, 32, 200
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) / 4).requires_grad_()
    tokens = torch.randint(0, V, (N,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = token_logprobs(hidden, weight, tokens, chunk_size=16)
        naive = torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    a = torch.autograd.grad(out.logp_tok.sum(), [hidden, weight])
    b = torch.autograd.grad(naive.sum(), [hidden, weight])
    torch.testing.assert_close(out.logp_tok, naive, atol=2e-2, rtol=2e-2)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype == torch.float32
        torch.testing.assert_close(x, y, atol=3e-2, rtol=3e-2)


def test_no_grad_path_and_empty_input():
    hidden, weight = torch.randn(0, 4), torch.randn(10, 4)
    out = token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), k_self=3, entropy=True)
    assert out.logp_tok.shape == (0,) and out.topk_ids.shape == (0, 3) and out.entropy.shape == (0,)
    # without autograd: no graph, and the same values as the naive log-softmax (and the grad path)
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    hidden, weight = torch.randn(5, 4, generator=g), torch.randn(10, 4, generator=g, requires_grad=True)
    tokens = torch.tensor([0, 3, 9, 3, 7])
    with torch.no_grad():
        out = token_logprobs(hidden, weight, tokens, k_self=3, entropy=True, chunk_size=2)
    assert not out.logp_tok.requires_grad
    logp = torch.log_softmax((hidden @ weight.T).detach().double(), -1)
    torch.testing.assert_close(out.logp_tok.double(), logp.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-6, rtol=0)
    assert torch.equal(out.topk_ids, logp.topk(3, -1).indices)
    torch.testing.assert_close(out.entropy.double(), -(logp.exp() * logp).sum(-1), atol=1e-6, rtol=0)
    grad_path = token_logprobs(hidden, weight, tokens, k_self=3, entropy=True, chunk_size=2)
    torch.testing.assert_close(grad_path.logp_tok.detach(), out.logp_tok, atol=0, rtol=0)


def _tiny(kind, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
                               bos_token_id=0, eos_token_id=1, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40)  # large logits: a cap or a scale matters
    return model


@pytest.mark.parametrize("kind,extra", [("gemma2", {"final_logit_softcapping": 5.0}),
                                        ("cohere", {"logit_scale": 0.25}),
                                        ("granite", {"logits_scaling": 4.0}),
                                        ("llama", {})])
def test_the_lean_path_applies_what_the_models_forward_does_to_its_logits(kind, extra):
    from emapg.models.forward import response_logprobs
    from emapg.models.lm import check_lean_head
    from emapg.rollout.sampling import RolloutBatch

    model = _tiny(kind, **extra)
    check_lean_head(model, kind)
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    prompt, resp = torch.randint(2, 300, (2, 5), generator=g), torch.randint(2, 300, (2, 7), generator=g)
    mb = RolloutBatch(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), response_ids=resp,
                      response_mask=torch.ones_like(resp), samp_logp=torch.zeros(2, 7), n=1)
    ids = torch.randint(0, 300, (14, 3), generator=g)
    for chunk in (4, 1024):  # recomputed in backward, and kept
        model.zero_grad()
        st = response_logprobs(model, mb, temperature=0.7, ids=ids, chunk_size=chunk, prefix_sharing=False)
        (st.logp_tok.sum() + st.logp_ids.exp().sum() + st.lse.sum()).backward()
        lean = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        full = model(input_ids=torch.cat([prompt, resp], 1)).logits[:, 4:-1].float() / 0.7
        logp = torch.log_softmax(full, -1).reshape(14, -1)
        want_tok = logp.gather(-1, resp.reshape(14, 1)).squeeze(-1)
        torch.testing.assert_close(st.logp_tok, want_tok, atol=1e-4, rtol=1e-4)
        (want_tok.sum() + logp.gather(-1, ids).exp().sum() + torch.logsumexp(full, -1).sum()).backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(lean[name], p.grad, atol=1e-4, rtol=1e-3)


def test_a_model_whose_logits_the_lean_path_cannot_reproduce_is_refused():
    from emapg.config import ConfigError
    from emapg.models.lm import check_lean_head

    model = _tiny("llama")
    forward = model.forward

    def odd(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits ** 2 / 50  # a post-processing no config field announces
        return out

    model.forward = odd
    with pytest.raises(ConfigError, match=r"post-processes the logits.*final_logit_softcapping"):
        check_lean_head(model, "odd-llama")
