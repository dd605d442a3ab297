"""GPU paths (skipped without CUDA): CUDA-graph rounds give exactly the eager tokens,
and the fused sampling kernel matches the torch reference."""
import shutil

import pytest
import torch

from treeflash import LLM, SamplingParams
from treeflash.checkpoints import write_random_drafter, write_random_target

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["def fib(n):", "import os", "x", "class A:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    # head_dim 64: the Triton tree-attention kernel and fused ops are on the path
    target = write_random_target(root / "t", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                 head_dim=64, intermediate_size=512, peaked_tokens=8, std=0.2)
    return target, write_random_drafter(target, root / "d", num_layers=2, block_size=8)


@pytest.mark.parametrize("method,budget", [("ar", None), ("dflash", None), ("ddtree", 16), ("ddtree", 63)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graphs_match_eager(pair, method, budget, temperature):
    target, drafter = pair
    params = [SamplingParams(max_new_tokens=48, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    kw = dict(draft_model=None if method == "ar" else drafter, method=method, budget=budget,
              device="cuda", dtype="float32")
    eager = LLM(target, cuda_graphs=False, **kw).generate(PROMPTS, params)
    llm = LLM(target, cuda_graphs=True, **kw)
    graphed = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS, params)  # the captured graph is replayed on a second call
    ar = LLM(target, method="ar", device="cuda", dtype="float32", cuda_graphs=False).generate(PROMPTS, params)
    for e, g, a, r in zip(eager, graphed, again, ar):
        assert g.token_ids == e.token_ids == a.token_ids
        assert e.token_ids == r.token_ids  # and speculative == autoregressive on the GPU too


@pytest.mark.parametrize("method,budget", [("ar", None), ("dflash", None), ("ddtree", 31)])
def test_graphs_match_eager_in_bfloat16(tmp_path, method, budget):
    """In bf16, where one rounding decides a sampled token, `--eager` gives the graphed
    tokens: the eager state has the graphed one's cache length, so the kernel splits the
    prefix alike (with a cache of the batch's own length, 1 of ddtree's 5 streams here
    differed, 3 of 5 at two other shapes)."""
    target = write_random_target(tmp_path / "t", hidden_size=320, num_layers=3, num_heads=10, num_kv_heads=2,
                                 head_dim=64, intermediate_size=864, peaked_tokens=8, std=0.2)
    drafter = write_random_drafter(target, tmp_path / "d", num_layers=1, block_size=12)
    prompts = PROMPTS + ["for i in range(10):"]
    params = [SamplingParams(max_new_tokens=40, temperature=1.0, top_k=(0, 50)[i % 2], seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    kw = dict(draft_model=None if method == "ar" else drafter, method=method, budget=budget, device="cuda",
              dtype="bfloat16")
    graphed = LLM(target, cuda_graphs=True, **kw).generate(prompts, params)
    eager = LLM(target, cuda_graphs=False, **kw).generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


@pytest.mark.parametrize("window", [None, 300])
def test_long_contexts_through_the_kernel_equal_the_cpu(tmp_path, window):
    """Prompts of 8128 tokens (with 64 new: the context limit), 5000 and 2000 share a 16K
    cache, which the kernel reads in many splits; with a window of 300 (layers 1-2 slide)
    the splits skip what the window hides. Graphed dflash and ddtree-63, greedy and
    sampled, give the tokens of AR on the CPU (SDPA)."""
    import json
    target = write_random_target(tmp_path / "t", hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2,
                                 head_dim=128, intermediate_size=512, peaked_tokens=8, std=0.2,
                                 max_position_embeddings=8192)
    if window:
        config = json.loads((target / "config.json").read_text())
        config.update(use_sliding_window=True, sliding_window=window, max_window_layers=1)
        (target / "config.json").write_text(json.dumps(config))
    drafter = write_random_drafter(target, tmp_path / "d", num_layers=2, block_size=16)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (8192 - 64, 5000, 2000)]
    params = [SamplingParams(max_new_tokens=64, temperature=t, seed=i, ignore_eos=True)
              for i, t in enumerate((0.0, 1.0, 1.0))]
    cpu = LLM(target, method="ar", device="cpu", dtype="float32").generate(prompts, params)
    for method, budget in (("dflash", None), ("ddtree", 63)):
        llm = LLM(target, draft_model=drafter, method=method, budget=budget, device="cuda", dtype="float32")
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in cpu]


def assert_graphed_equals_eager_and_ar(target, drafter, method: str, budget: int | None, prompts: list,
                                       max_new_tokens: int) -> LLM:
    """Graphed generation (greedy and T = 1.0 prompts mixed) gives the eager engine's
    tokens and AR's; returns the graphed engine for further checks."""
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=(0.0, 1.0)[i % 2], seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    kw = dict(draft_model=None if method == "ar" else drafter, method=method, budget=budget, device="cuda",
              dtype="float32")
    eager = LLM(target, cuda_graphs=False, **kw).generate(prompts, params)
    llm = LLM(target, cuda_graphs=True, **kw)
    graphed = llm.generate(prompts, params)
    ar = LLM(target, method="ar", device="cuda", dtype="float32", cuda_graphs=False).generate(prompts, params)
    for e, g, a in zip(eager, graphed, ar):
        assert g.token_ids == e.token_ids == a.token_ids
    return llm


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_head_sizes_that_are_not_a_power_of_two(tmp_path, arch):
    """Head size 80 (as in some published models): the fused RoPE ops run with masked
    lanes. Graphed DDTree gives the eager and AR tokens, and AR on the GPU the CPU's."""
    target = write_random_target(tmp_path / "t", arch=arch, hidden_size=256, num_layers=3, num_heads=4,
                                 num_kv_heads=2, head_dim=80, intermediate_size=512, peaked_tokens=8, std=0.2)
    drafter = write_random_drafter(target, tmp_path / "d", num_layers=2, block_size=8)
    llm = assert_graphed_equals_eager_and_ar(target, drafter, "ddtree", 16, PROMPTS, 32)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    cpu = LLM(target, method="ar", device="cpu", dtype="float32").generate(PROMPTS, params)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in cpu]


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_qwen2_biases_and_mistral_windows_on_the_kernel_path(tmp_path, arch):
    """Qwen2's q/k/v biases (through the fused QKV product and RoPE) and a window of 96
    shorter than the prompts (Qwen2: layers 1-2 slide; Mistral: every layer): graphed
    DDTree gives the eager and AR tokens, and AR on the GPU the CPU's."""
    import json
    target = write_random_target(tmp_path / "t", arch=arch, hidden_size=256, num_layers=3, num_heads=8,
                                 num_kv_heads=2, head_dim=64, intermediate_size=512, peaked_tokens=8, std=0.2)
    config = json.loads((target / "config.json").read_text())
    config.update(sliding_window=96, **(dict(use_sliding_window=True, max_window_layers=1) if arch == "qwen2" else {}))
    (target / "config.json").write_text(json.dumps(config))
    drafter = write_random_drafter(target, tmp_path / "d", num_layers=2, block_size=8)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (300, 150, 40)]
    llm = assert_graphed_equals_eager_and_ar(target, drafter, "ddtree", 31, prompts, 48)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    cpu = LLM(target, method="ar", device="cpu", dtype="float32").generate(prompts, params)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in cpu]
    full = dict(config, sliding_window=None, use_sliding_window=False)  # the window must matter here
    (target / "config.json").write_text(json.dumps(full))
    unwindowed = LLM(target, method="ar", device="cpu", dtype="float32").generate(prompts, params)
    assert [o.token_ids for o in unwindowed] != [o.token_ids for o in cpu]


@pytest.fixture(scope="module")
def warm_pair(pair, tmp_path_factory):
    """`pair` with its 8 peaked LM-head rows cut from 25x to 5x and the head halved:
    broad enough at T = 1.5 that min-p changes the stream."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path_factory.mktemp("warm") / "t"
    shutil.copytree(pair[0], folder)
    w = load_file(str(folder / "model.safetensors"))
    w["lm_head.weight"][3:11] /= 5
    w["lm_head.weight"] *= 0.5
    save_file(w, str(folder / "model.safetensors"))
    return folder, write_random_drafter(folder, folder.parent / "d", num_layers=2, block_size=8)


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 16), ("ddtree", 63)])
def test_filtered_sampling_graphs_match_ar(warm_pair, method, budget):
    """min-p, top-k and top-p on the CUDA path (the same torch filter as on the CPU, in
    the round's graph): graphed and eager speculative streams equal AR's."""
    target, drafter = warm_pair
    params = [SamplingParams(max_new_tokens=40, temperature=1.5, min_p=0.4, seed=1, ignore_eos=True),
              SamplingParams(max_new_tokens=40, temperature=1.0, top_k=20, top_p=0.9, min_p=0.2, seed=2,
                             ignore_eos=True)]
    prompts = PROMPTS[:2]
    kw = dict(draft_model=drafter, method=method, budget=budget, device="cuda", dtype="float32")
    ar = LLM(target, method="ar", device="cuda", dtype="float32", cuda_graphs=False).generate(prompts, params)
    eager = LLM(target, cuda_graphs=False, **kw).generate(prompts, params)
    graphed = LLM(target, cuda_graphs=True, **kw).generate(prompts, params)
    for e, g, r in zip(eager, graphed, ar):
        assert g.token_ids == e.token_ids == r.token_ids
    unfiltered = SamplingParams(max_new_tokens=40, temperature=1.5, seed=1, ignore_eos=True)
    assert LLM(target, method="ar", device="cuda", dtype="float32", cuda_graphs=False).generate(
        prompts[:1], unfiltered)[0].token_ids != ar[0].token_ids  # min-p removed tokens here


def test_controls_on_graphed_rounds_equal_ar(warm_pair):
    """logit_bias, allowed_token_ids, min_tokens and penalties in graphed rounds: a state
    captured for plain requests takes the others (their buffers are made then and kept for
    those modes' graphs), replays them all later, and every output equals eager AR's."""
    target, drafter = warm_pair
    llm = LLM(target, draft_model=drafter, method="ddtree", budget=16, device="cuda", dtype="float32")
    ar = LLM(target, method="ar", device="cuda", dtype="float32", cuda_graphs=False)
    p = lambda **kw: SamplingParams(max_new_tokens=32, ignore_eos=True, **kw)  # noqa: E731
    modes = [p(temperature=1.0, seed=3),
             p(temperature=1.0, seed=3, logit_bias={5: 3.0, 6: -100.0}, min_tokens=12, stop_token_ids=[4]),
             p(allowed_token_ids=list(range(3, 60)), logit_bias={9: 2.0}),
             p(temperature=0.8, top_p=0.9, seed=4, logit_bias={7: -2.0}),
             p(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.2),
             p(temperature=1.0, seed=5, repetition_penalty=1.5, min_tokens=8, stop_token_ids=[5]),
             # fewer allowed tokens than the tree's per-depth candidates: -inf draft scores
             p(temperature=1.0, seed=6, allowed_token_ids=list(range(3, 13)))]
    prompts = PROMPTS[:2]
    captures = []
    for params in modes * 2:
        got = llm.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in ar.generate(prompts, params)], params
        captures.append(llm.graph_captures)
    assert captures[7:] == [captures[6]] * 7  # the second pass replays every mode
    assert ar.generate(prompts, modes[1])[0].token_ids != ar.generate(prompts, modes[0])[0].token_ids


def test_prefills_are_graphed_per_padded_length(pair):
    """With graphs on, a prompt's prefill is captured once per padded length (a multiple
    of 32) and replayed when that length comes back; past 512 padded tokens in the batch
    it runs eagerly. Every output equals the eager engine's."""
    target, drafter = pair
    kw = dict(draft_model=drafter, method="ddtree", budget=16, device="cuda", dtype="float32")
    prompts = [[5, 9, 3], list(range(3, 60)), [7, 8] * 300, [4] * 20, list(range(10, 50))]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    eager = LLM(target, cuda_graphs=False, **kw)
    llm = LLM(target, cuda_graphs=True, **kw)
    captures = []
    for p in prompts:
        assert llm.generate(p, params)[0].token_ids == eager.generate(p, params)[0].token_ids
        captures.append(llm.graph_captures)
    shapes = sorted(k[-1] for g in llm.states.graphed.values() for k in g.prefills)
    # round + prefill(32), prefill(64), the 600-token prompt eager, 32 and 64 again replayed
    assert captures == [2, 3, 3, 3, 3] and shapes == [32, 64]


def test_dependent_launches_read_what_the_previous_kernel_wrote():
    """On Hopper and later the Triton kernels are dependent launches (kernels/chained.py):
    each one's programs are placed while the previous kernel runs. A chain in which
    every kernel reads what the one before it wrote last, graphed and replayed, gives
    the bits of the same chain run a kernel at a time, and of torch."""
    from treeflash.engine.graphs import capture
    from treeflash.kernels.chained import chained
    from treeflash.kernels.gemv import gemv
    from treeflash.ops.fused import add_rms_norm
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9:
        pytest.skip("dependent launches need sm_90 or later")
    assert chained(dev) == {"PDL": True, "launch_pdl": True}
    g = torch.Generator(device="cuda").manual_seed(0)
    H, steps = 2048, 60
    weights = [torch.randn(H, H, device="cuda", generator=g) / H ** 0.5 for _ in range(steps)]
    norm = torch.rand(H, device="cuda", generator=g) + 0.5
    x0 = torch.randn(1, H, device="cuda", generator=g)

    def chain(sync: bool) -> torch.Tensor:
        x, residual = x0, torch.zeros_like(x0)
        for w in weights:
            residual, h = add_rms_norm(x, norm, 1e-6, residual)
            x = gemv(h, w)
            if sync:
                torch.cuda.synchronize()
        return add_rms_norm(x, norm, 1e-6, residual)[1]

    stepwise = chain(sync=True)
    graph, graphed = capture(lambda: chain(sync=False), warmup=1)
    for _ in range(20):
        graph.replay()
        assert torch.equal(graphed, stepwise)
    x, residual = x0.double(), torch.zeros_like(x0.double())
    for w in weights:
        residual = x + residual
        x = (residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * norm) @ w.double().T
    residual = x + residual
    ref = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    assert torch.allclose(stepwise.double(), ref, rtol=1e-3, atol=1e-3)


def test_norms_that_add_the_projections_shares_change_no_bit(tmp_path, monkeypatch):
    """Verify- and draft-sized products of the o and down projections split K in shares
    and leave them for the next RMSNorm to add (`SplitSums`: a launch fewer per product).
    A 16-token forward over a cache, graphed as the engine runs it, gives the hidden
    states and tapped features of the same forward whose products add their own shares,
    bit for bit (bf16), and both have taken the split path (K of 512 and 1024: 4 and 8
    steps of 128, shares of two steps or more)."""
    from treeflash.engine.graphs import capture
    from treeflash.layers import linear as linear_mod
    from treeflash.layers.attention import AttentionInputs
    from treeflash.ops import SplitSums
    target = write_random_target(tmp_path, hidden_size=512, num_layers=3, num_heads=8, num_kv_heads=2,
                                 head_dim=64, intermediate_size=1024)
    model = LLM(target, method="ar", device="cuda", dtype="bfloat16", cuda_graphs=False).target
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = model.new_cache(2, 256)
    for t in (cache.k, cache.v):
        t.normal_(generator=g)
    T, lens = 16, torch.tensor([100, 37], device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (2, T), device="cuda", generator=g)
    mask = torch.ones(T, T, dtype=torch.bool, device="cuda").tril().expand(2, T, T)
    inputs = AttentionInputs(lens[:, None] + torch.arange(T, device="cuda"), lens, mask, backend="triton")
    split = []
    forward = linear_mod.RowParallelLinear.forward

    def watched(self, x, gated=False, add_shares=True):
        y = forward(self, x, gated, add_shares)
        split.append(isinstance(y, SplitSums))
        return y

    def run():
        with torch.inference_mode():
            return model(ids, inputs, cache, taps=[1, 2])

    monkeypatch.setattr(linear_mod.RowParallelLinear, "forward", watched)
    graph, (h, features) = capture(run, warmup=1)
    graph.replay()
    assert split and all(split)  # every o and down product came unadded
    monkeypatch.setattr(linear_mod.RowParallelLinear, "forward",
                        lambda self, x, gated=False, add_shares=True: forward(self, x, gated))
    want_h, want_features = run()
    torch.cuda.synchronize()
    assert torch.equal(h, want_h) and torch.equal(features, want_features)


def test_fused_sampling_matches_reference():
    from treeflash.engine.sampling import gumbel_noise
    from treeflash.ops.gumbel_argmax import gumbel_argmax
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, V = 4, 33, 151936
    logits = torch.randn(B, T, V, device="cuda", generator=g) * 4
    seed = torch.tensor([0, 1, 2 ** 40 + 3, 987654321], device="cuda")
    pos = torch.randint(0, 100000, (B, T), device="cuda", generator=g)
    temp = torch.tensor([0.0, 0.3, 1.0, 1.5], device="cuda")
    out = gumbel_argmax(logits, seed, pos, temp)
    noisy = logits / temp.clamp_min(1e-6)[:, None, None] + gumbel_noise(seed, pos, 0, V)
    ref = torch.where(temp[:, None] > 0, noisy.argmax(-1), logits.argmax(-1))
    # tl.log and torch.log may differ in the last ulp: allow a rare near-tie to flip
    assert (out == ref).float().mean() > 0.99
    assert (out[0] == logits[0].argmax(-1)).all()


def test_sampling_modes_keep_their_graphs(pair):
    """Requests that alternate between greedy, sampled and top-p sampling (a server's
    traffic) capture each mode's round and prefill once, on one batch state, and replay
    them after; a mode first met after a long request (its state left near the end of
    its cache) is captured safely. Every output equals the eager engine's."""
    target, drafter = pair
    kw = dict(draft_model=drafter, method="ddtree", budget=16, device="cuda", dtype="float32")
    eager = LLM(target, cuda_graphs=False, **kw)
    llm = LLM(target, cuda_graphs=True, **kw)
    long_prompt = list(range(3, 40))
    first = SamplingParams(max_new_tokens=1024 - 33 - len(long_prompt), ignore_eos=True)  # max_len fills bucket 1024
    assert llm.generate(long_prompt, first)[0].token_ids == eager.generate(long_prompt, first)[0].token_ids
    assert llm.graph_captures == 2  # greedy round + prefill(64)
    modes = [SamplingParams(max_new_tokens=24, ignore_eos=True, seed=3, temperature=0.8),
             SamplingParams(max_new_tokens=24, ignore_eos=True, seed=3, temperature=0.8, top_p=0.9),
             SamplingParams(max_new_tokens=24, ignore_eos=True, seed=3, temperature=0.0)]
    captures = []
    for p in modes * 3:
        assert llm.generate(long_prompt, p)[0].token_ids == eager.generate(long_prompt, p)[0].token_ids
        captures.append(llm.graph_captures)
    assert captures == [4, 6] + [6] * 7  # greedy's were kept from the first request


def test_batch_sizes_keep_their_graphs(pair, monkeypatch):
    """The states of recent batch sizes are kept with their graphs (up to GRAPH_STATES,
    least recently used dropped first): a server's changing batch sizes replay graphs
    instead of capturing. Every output equals the eager engine's."""
    import treeflash.engine.states as states_module
    target, drafter = pair
    kw = dict(draft_model=drafter, method="ddtree", budget=16, device="cuda", dtype="float32")
    eager = LLM(target, cuda_graphs=False, **kw)
    llm = LLM(target, cuda_graphs=True, **kw)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    captures = []

    def run(batch):
        got = llm.generate(batch, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in eager.generate(batch, params)]
        captures.append(llm.graph_captures)

    for batch in (PROMPTS[:3], PROMPTS, PROMPTS[:1], PROMPTS[1:4], PROMPTS[:2], PROMPTS[:1]):
        run(batch)
    # each new size: round + prefill; 3 and 1 again: replayed
    assert captures == [2, 4, 6, 6, 8, 8]
    monkeypatch.setattr(states_module, "GRAPH_STATES", 2)
    for batch in (PROMPTS * 2, PROMPTS[:1], PROMPTS):
        run(batch)
    # 8 drops all but the most recent (1); 1 is replayed; 4 was dropped: captured again
    assert captures[6:] == [10, 10, 12]


def test_a_long_prompt_list_runs_in_graphed_batches(pair):
    """More prompts than max_batch run in batches (3, 3, 2): the second batch of 3
    replays the first one's graphs, and every output equals the eager engine's."""
    target, drafter = pair
    kw = dict(draft_model=drafter, method="ddtree", budget=16, device="cuda", dtype="float32", max_batch=3)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompts = PROMPTS * 2
    llm = LLM(target, cuda_graphs=True, **kw)
    got = llm.generate(prompts, params)
    want = LLM(target, cuda_graphs=False, **kw).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.graph_captures == 4  # round + prefill for 3, then for 2


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 16)])
def test_graphed_logprobs_match_eager(pair, method, budget):
    """Logprobs from graphed rounds and prefills (a mode of their own: captured, then
    replayed by a second call; and a prompt past the graphed prefill's size, prefilled
    eagerly on the graphed state) equal the eager engine's, alongside requests without
    them; the tokens do not change."""
    target, drafter = pair
    kw = dict(draft_model=drafter, method=method, budget=budget, device="cuda", dtype="float32")
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=5),
              SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=1.0, seed=2, logprobs=0),
              SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)]
    eager = LLM(target, cuda_graphs=False, **kw)
    llm = LLM(target, cuda_graphs=True, **kw)
    plain = llm.generate(PROMPTS[:3], [SamplingParams(**{**p.__dict__, "logprobs": None}) for p in params])
    long = [PROMPTS[0], [7, 8] * 300, PROMPTS[2]]  # 600 tokens: an eager prefill
    for prompts in (PROMPTS[:3], PROMPTS[:3], long):  # captured, replayed, eager prefill
        want, got = eager.generate(prompts, params), llm.generate(prompts, params)
        for e, g in zip(want, got):
            assert g.token_ids == e.token_ids
            assert (g.logprobs is None) == (e.logprobs is None)
            for a, b in zip(g.logprobs or [], e.logprobs or []):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [i for i, _ in a.top] == [i for i, _ in b.top]
                assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
        if prompts is not long:
            assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    assert [len(e.top) for e in got[0].logprobs] == [5] * 40 and got[2].logprobs is None
    # prompt logprobs: an eager prefill on the graphed state, then its graphed rounds
    scored = [SamplingParams(**{**p.__dict__, "prompt_logprobs": 3}) for p in params]
    want, got = eager.generate(PROMPTS[:3], scored), llm.generate(PROMPTS[:3], scored)
    assert [len(g.prompt_logprobs) for g in got] == [len(e.prompt_logprobs) for e in want]
    assert len(got[0].prompt_logprobs) > 1  # "def fib(n):" is several tokens ("x" is one)
    for e, g in zip(want, got):
        assert g.token_ids == e.token_ids
        for a, b in zip(g.prompt_logprobs[1:], e.prompt_logprobs[1:]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and [i for i, _ in a.top] == [i for i, _ in b.top]


def test_prefix_caching_on_graphed_engines(pair):
    """Prefix caching with CUDA graphs: a next turn prefills only its new tokens on the
    kept graphed state, through the rounds' attention kernel: replaying a suffix prefill
    graph (a short conversation), or eagerly (one past 512 padded tokens: a long one
    whose rest is long too); a turn that needs a larger cache bucket copies the
    conversation over from the state that holds it. The tokens equal an engine's without
    prefix caching."""
    target, drafter = pair
    kw = dict(draft_model=drafter, method="ddtree", budget=16, device="cuda", dtype="float32")
    llm, fresh = LLM(target, enable_prefix_caching=True, **kw), LLM(target, **kw)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=2)
    logprobs = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2)
    # 1024 slots; 2048 (its first 600 tokens copied from the first state); 1024 again
    cases = [([7, 8] * 300, [11, 12, 13]), ([7, 8] * 500, [11, 12] * 300), ([5, 9, 3], [11, 12])]
    for i, (first, question) in enumerate(cases):
        answer = llm.generate(first, params)[0]
        cached = answer.stats["cached_tokens"]
        assert cached >= 600 if i == 1 else cached == 0  # 600: [7, 8] * 300 and what follows alike
        assert answer.token_ids == fresh.generate(first, params)[0].token_ids
        turn = first + answer.token_ids + question
        got = llm.generate(turn, params)[0]
        assert got.token_ids == fresh.generate(turn, params)[0].token_ids
        assert got.stats["cached_tokens"] == len(first) + len(answer.token_ids) - 1
        got = llm.generate(turn, logprobs)[0]
        assert got.token_ids == fresh.generate(turn, logprobs)[0].token_ids
        if i == 0:  # a sampling mode new to the only state is captured there (warm-up rounds
            assert got.stats["cached_tokens"] == 0  # from slot 0): nothing to reuse
    assert any(key[-3] for g in llm.states.graphed.values() for key in g.prefills)  # a suffix prefill graph ran

def test_structured_outputs_on_graphed_rounds_equal_ar():
    """Structured outputs in graphed rounds (tree nodes' states, the masks, a table that
    grows between batches, beside unconstrained requests): graphed DFlash and DDTree give
    eager AR's tokens, and finished texts match their constraint."""
    import re

    from treeflash import StructuredOutputs
    from treeflash.engine.options import builtin_paths
    target, drafter = builtin_paths()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["name"]}
    constraints = [StructuredOutputs(choice=["yes", "no"]), StructuredOutputs(regex=r"(    [a-z_]+ = [a-z0-9_.()]+\n){2,4}"),
                   StructuredOutputs(json=schema)]
    batches = [[SamplingParams(max_new_tokens=48, structured_outputs=so, temperature=t, seed=7) for t in (0.0, 1.0)]
               for so in constraints]
    batches.append([b[0] for b in batches] + [SamplingParams(max_new_tokens=48, temperature=1.0, seed=8)])
    prompts = ["def add(a, b):\n", "class Config:\n"]
    ar = LLM(target, method="ar", device="cuda", dtype="float32", cuda_graphs=False)
    for method, budget in (("dflash", None), ("ddtree", 32)):
        llm = LLM(target, draft_model=drafter, method=method, budget=budget, device="cuda", dtype="float32")
        for params in batches * 2:
            for prompt in prompts:
                got = llm.generate([prompt] * len(params), params)
                want = ar.generate([prompt] * len(params), params)
                assert [o.token_ids for o in got] == [o.token_ids for o in want], (method, prompt, params[0])
                for o, p in zip(got, params):
                    if p.structured_outputs is not None and o.finish_reason == "stop":
                        assert re.fullmatch(p.structured_outputs.pattern(), o.text, flags=re.ASCII), o.text


def test_bad_words_on_graphed_rounds_equal_ar():
    """bad_words in graphed rounds (each tree node matched against its own path; a kept
    state's recent tokens reset per request): graphed DFlash and DDTree give eager AR's
    tokens, greedy and sampled, beside a request without them."""
    from treeflash.engine.options import builtin_paths
    target, drafter = builtin_paths()
    prompts = ["def add(a, b):\n    ", "def f(x):\n    if x:\n        return x\n    "]
    params = [SamplingParams(max_new_tokens=40, bad_words=["a + b", "return x", "self"]),
              SamplingParams(max_new_tokens=40, bad_words=["return"], temperature=1.0, seed=3),
              SamplingParams(max_new_tokens=40, temperature=1.0, seed=4)]
    ar = LLM(target, method="ar", device="cuda", dtype="float32", cuda_graphs=False)
    want = [[o.token_ids for o in ar.generate([p] * 3, params)] for p in prompts]
    free = ar.generate(prompts[0], SamplingParams(max_new_tokens=40))[0].token_ids
    assert want[0][0] != free  # the ban changed the greedy stream
    for method, budget in (("dflash", None), ("ddtree", 32)):
        llm = LLM(target, draft_model=drafter, method=method, budget=budget, device="cuda", dtype="float32")
        for _ in range(2):
            assert [[o.token_ids for o in llm.generate([p] * 3, params)] for p in prompts] == want, method


def test_a_sliding_drafter_layer_on_the_kernel_path_sees_its_window(pair):
    """A drafter with sliding layers (window 40 over a 100-token context): its block, drafted
    with the fused cache writes and the Triton attention, equals the same weights under
    the window's explicit mask in the dense path."""
    import json

    from treeflash.config import DraftConfig
    from treeflash.layers.attention import AttentionInputs
    from treeflash.models.dflash import DFlashDraftModel
    data = json.loads((pair[1] / "config.json").read_text())
    L, W, P, b = data["num_hidden_layers"], 40, 100, data.get("block_size", 8)
    dcfg = DraftConfig.from_dict({**data, "use_sliding_window": True, "sliding_window": W, "is_causal": False,
                                  "layer_types": ["sliding_attention"] * L})
    torch.manual_seed(0)
    with torch.device("cuda"):
        drafter = DFlashDraftModel(dcfg).float()
    for p in drafter.parameters():
        p.data.normal_(0, 0.1)
    H = dcfg.layers.hidden_size
    features = torch.randn(1, P, len(dcfg.target_layer_ids) * H, device="cuda")
    block = torch.randn(1, b, H, device="cuda")
    cache = drafter.new_cache(1, 256)
    with torch.inference_mode():
        drafter.commit_context(cache, features, torch.arange(P, device="cuda")[None],
                               torch.zeros(1, dtype=torch.long, device="cuda"))
        positions = P + torch.arange(b, device="cuda")[None]
        inputs = AttentionInputs(positions, torch.tensor([P], device="cuda"),
                                 torch.ones(1, b, b, dtype=torch.bool, device="cuda"), backend="triton")
        got = drafter(block, inputs, cache)
        query = positions[0][:, None]
        mask = torch.cat([torch.arange(P, device="cuda")[None] > query - W,
                          torch.ones(b, b, dtype=torch.bool, device="cuda")], 1)[None]
        for layer in drafter.layers:  # the dense path refuses a window: the mask carries it here
            layer.self_attn.window = None
        want = drafter.forward_dense(block, positions, features, torch.arange(P, device="cuda")[None], mask)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
