import pytest
import torch

from emapg.logprobs import token_logprobs


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_logprobs_equal_naive_values_and_gradients(chunk_size, with_bias):
    g = torch.Generator().manual_seed(0)
    N, H, V, k = 50, 8, 97, 5
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    tokens = torch.randint(0, V, (N,), generator=g)
    ids = torch.randint(0, V, (N, k), generator=g)
    out = token_logprobs(hidden, weight, tokens, ids=ids, bias=bias, temperature=0.8, k_self=k, entropy=True,
                         chunk_size=chunk_size)
    logits = (hidden @ weight.T + (0 if bias is None else bias)).float().double() / 0.8
    logp = torch.log_softmax(logits, -1)
    want_tok = logp.gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logp_tok.double(), want_tok, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logp_ids.double(), logp.gather(-1, ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.lse.double(), torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)
    assert torch.equal(out.topk_ids, logits.topk(k, -1).indices)
    torch.testing.assert_close(out.entropy.double(), -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=1e-5)
    params = [hidden, weight] + ([bias] if with_bias else [])
    loss_fast = out.logp_tok.sum() + (out.logp_ids * 0.3).sum()
    loss_naive = logp.gather(-1, tokens[:, None]).sum() + (logp.gather(-1, ids) * 0.3).sum()
    for a, b in zip(torch.autograd.grad(loss_fast, params), torch.autograd.grad(loss_naive, params), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_no_grad_path_and_empty_input():
    hidden, weight = torch.randn(0, 4), torch.randn(10, 4)
    out = token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), k_self=3, entropy=True)
    assert out.logp_tok.shape == (0,) and out.topk_ids.shape == (0, 3) and out.entropy.shape == (0,)
    with torch.no_grad():
        out = token_logprobs(torch.randn(5, 4), weight, torch.zeros(5, dtype=torch.long))
    assert not out.logp_tok.requires_grad and out.logp_tok.shape == (5,)
