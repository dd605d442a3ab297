"""Tokens sampled through DDTree follow the target's distribution (issue 5).

Many requests, each with its own seed, share one prompt; after the prefill, the
first token that a DDTree round commits sits at position L+1. Given the request's
anchor (the prefill's sample at L), its law must be softmax(logits(prompt, anchor)/T),
whatever the tree. We compare the observed counts with the expected ones by a
chi-square test, and check that the test has power: a verifier that "accepts the
draft child matched by any of several independent target samples" (a common way to
lose exactness) is rejected by the same test on the same trees.
"""
import math

import pytest
import torch

from treeflash import LLM, SamplingParams
from treeflash.checkpoints import write_random_drafter, write_random_target
from treeflash.engine.sampling import SamplingBatch
from treeflash.layers.attention import AttentionInputs

REQUESTS = 3000
T = 1.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    # a warm (not peaked) target: its next-token law is spread over many tokens
    target = write_random_target(root / "t", hidden_size=32, num_layers=2, num_heads=2,
                                 num_kv_heads=1, head_dim=16, intermediate_size=64, std=0.3, seed=3)
    drafter = write_random_drafter(target, root / "d", num_layers=1, block_size=4, std=0.3, seed=4)
    llm = LLM(target, draft_model=drafter, method="ddtree", budget=16, device="cpu", dtype="float64")
    prompt = [5, 9, 11, 3, 7]
    params = [SamplingParams(max_new_tokens=4, temperature=T, seed=1000 + i) for i in range(REQUESTS)]
    dec = llm.decoder
    st = dec.new_state(REQUESTS, 64, SamplingBatch.from_params(params, llm.device))
    dec.prefill(st, [prompt] * REQUESTS)
    anchors = st.anchor.clone()
    tree = dec.build(st)                    # the round's tree, kept for the biased verifier
    children = torch.where(tree.depths[:, 1:] == 1, tree.tokens[:, 1:], -1)  # depth-1 proposals, -1 pads
    new, counts, _ = dec.round(st)
    # the target's law at position L+1 given each request's anchor
    ids = torch.tensor(prompt).expand(REQUESTS, -1)
    ids = torch.cat([ids, anchors[:, None]], 1)
    pos = torch.arange(ids.shape[1]).expand(REQUESTS, -1)
    with torch.inference_mode():
        h, _ = llm.target(ids, AttentionInputs.causal(pos))
        probs = torch.softmax(llm.target.logits(h[:, -1]).double() / T, -1)
    return new[:, 0], probs, children


def chi_square_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed token counts against expected sum_b probs[b] (bins with an
    expected count < 5 are pooled)."""
    V = probs.shape[1]
    observed = torch.bincount(tokens, minlength=V).double()
    expected = probs.sum(0)
    small = expected < 5
    o = torch.cat([observed[~small], observed[small].sum()[None]])
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = e > 0
    stat = (((o - e) ** 2) / e)[keep].sum().item()
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square upper tail
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_ddtree_samples_follow_the_target_distribution(setup):
    first, probs, _ = setup
    p = chi_square_p(first, probs)
    assert p > 1e-3, f"DDTree samples deviate from the target's distribution (chi-square p = {p:.2e})"
    # total variation between the empirical and expected laws: sampling noise alone is
    # about sqrt(V / n) / 2 ~ 0.07 here; require < 0.1
    V = probs.shape[1]
    tv = 0.5 * (torch.bincount(first, minlength=V).double() / len(first) - probs.mean(0)).abs().sum()
    assert tv < 0.1


def test_a_biased_verifier_fails_the_same_test(setup):
    """'Accept a draft child if any of 4 independent target samples equals it' favours
    the drafter's proposals: the chi-square test must reject it."""
    first, probs, children = setup
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(probs, 4, replacement=True, generator=gen)        # [B, 4]
    hit = (draws[:, :, None] == children[:, None, :]).any(-1)                    # [B, 4]
    biased = torch.where(hit.any(-1), draws.gather(1, hit.float().argmax(-1, keepdim=True))[:, 0], draws[:, 0])
    assert chi_square_p(biased, probs) < 1e-6
    # and the exact sampler's p-value is far from that
    assert chi_square_p(first, probs) > 1e-3
