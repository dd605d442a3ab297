"""Issue 2, point 1: treeflash loads tiny Qwen3 / Llama / Qwen2 / Mistral checkpoints
written by transformers and computes what transformers computes.

* logits: relative error < 1e-5 in float32, per prompt, over a batch of 3 prompts of
  different lengths (right-padded into one treeflash batch), on the cache-free path,
  the KV-cache prefill path and the incremental path (prefill, a multi-token block,
  then single-token decode steps through the KV cache);
* greedy generation of 48 tokens is token-identical to `model.generate(do_sample=False)`;
* float64 matches too; bfloat16 checkpoints load and run.

Relative error of a prompt = max |treeflash - HF| / max |HF| over its positions and
vocabulary (an elementwise ratio would be meaningless for logits near zero).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import ENGINE_PROMPTS, HF_VARIANTS, LLAMA3_ROPE
from safetensors import safe_open

from treeflash import LLM, SamplingParams, TreeflashError, UsageError
from treeflash.config import ModelConfig
from treeflash.layers.attention import AttentionInputs

VARIANTS = list(HF_VARIANTS)
NEW_TOKENS = 48


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def encode_all(llm: LLM) -> list[list[int]]:
    ids = [llm.encode(p) for p in ENGINE_PROMPTS]
    assert len({len(i) for i in ids}) == 3, "the three prompts must have different lengths"
    return ids


def padded(prompts: list[list[int]], pad: int = 1) -> torch.Tensor:
    T = max(len(p) for p in prompts)
    return torch.tensor([p + [pad] * (T - len(p)) for p in prompts])


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V] logits of transformers for one unpadded prompt."""
    return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def tf_logits(llm: LLM, batch: torch.Tensor, cache=None) -> torch.Tensor:
    B, T = batch.shape
    positions = torch.arange(T).expand(B, T)
    inputs = AttentionInputs.causal(positions, kv_len=T if cache is not None else None)
    h, _ = llm.target(batch, inputs, cache)
    return llm.target.logits(h)


# --------------------------------------------------------------------------- loading


def test_checkpoint_layouts_are_the_ones_claimed(hf_checkpoint):
    """The fixtures really exercise tied embeddings (no lm_head tensor), a sharded
    checkpoint with an index, and a transformers-5 Llama-3 rope config."""
    sharded = hf_checkpoint("qwen3-tied-sharded").path
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]
    tied = hf_checkpoint("llama-tied-bias").path
    with safe_open(str(tied / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.layers.0.self_attn.q_proj.bias" in keys
    cfg = ModelConfig.from_pretrained(hf_checkpoint("llama3-rope").path)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 4.0
    assert ModelConfig.from_pretrained(hf_checkpoint("qwen3").path).head_dim == 32


def test_tokenizer_matches_transformers(hf_checkpoint):
    """treeflash's tokenizer encodes (as transformers does by default, with special
    tokens) and decodes like transformers' AutoTokenizer."""
    from transformers import AutoTokenizer

    path = hf_checkpoint("qwen3").path
    hf_tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(path, device="cpu", dtype="float32")
    for text in ENGINE_PROMPTS + ["  spaces\tand\nnewlines  ", "unicode: é ü 日本"]:
        ids = llm.tokenizer.encode(text)
        assert ids == hf_tok(text)["input_ids"]
        assert llm.tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == text
    assert 0 in llm.eos_token_ids  # <|endoftext|>, from config.json and tokenizer_config.json


def test_llama3_style_tokenizer_adds_bos_like_transformers(hf_checkpoint, tmp_path):
    """Llama-3 tokenizers add <|begin_of_text|> through the tokenizer.json post-processor
    (tokenizer_config.json says nothing about it): a text prompt must reach the model
    with it, as it does with transformers, or every output changes."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer

    ck = hf_checkpoint("llama3-rope")
    folder = ck.copy_to(tmp_path / "bos")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos_text = "<|pad|>"  # a special token of the tiny vocabulary, standing in for <|begin_of_text|>
    bos = tok.token_to_id(bos_text)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B",
                                      special_tokens=[(bos_text, bos)])])
    tok.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "bos_token": bos_text}))
    hf_tok = AutoTokenizer.from_pretrained(folder)
    llm = LLM(folder, device="cpu", dtype="float32")
    for text in ENGINE_PROMPTS:
        ids = hf_tok(text)["input_ids"]
        assert ids[0] == bos
        assert llm.tokenizer.encode(text) == ids
    out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(ck.model, hf_tok(ENGINE_PROMPTS[0])["input_ids"], 16)


# --------------------------------------------------------------------------- float32 logits


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_transformers(hf_checkpoint, name):
    """One padded batch of 3 prompts, cache-free and through the KV cache, per prompt
    against transformers run on that prompt alone."""
    ck = hf_checkpoint(name)
    llm = LLM(ck.path, device="cpu", dtype="float32")
    assert llm.target.lm_head.weight.dtype == torch.float32
    prompts = encode_all(llm)
    batch = padded(prompts)
    free = tf_logits(llm, batch)
    cached = tf_logits(llm, batch, llm.target.new_cache(3, batch.shape[1] + 4))
    for b, ids in enumerate(prompts):
        ref = hf_logits(ck.model, ids)
        n = len(ids)
        assert rel_err(free[b, :n], ref) < 1e-5, f"{name} prompt {b} (cache-free)"
        assert rel_err(cached[b, :n], ref) < 1e-5, f"{name} prompt {b} (KV cache)"


@pytest.mark.parametrize("name", VARIANTS)
@torch.no_grad()
def test_incremental_decoding_matches_full_forward(hf_checkpoint, name):
    """Prefill part of each prompt, then a 3-token block, then single-token steps, each
    request at its own position (different lengths in one batch): every step's logits
    equal transformers' full forward over the whole prompt."""
    ck = hf_checkpoint(name)
    llm = LLM(ck.path, device="cpu", dtype="float32")
    # longer sequences than the prompts, so the decode steps reach positions beyond 64
    # (the Llama-3 rope's original context in the fixture)
    seqs = [p * 4 for p in encode_all(llm)]
    refs = [hf_logits(ck.model, s) for s in seqs]
    B = len(seqs)
    steps, block = 6, 3
    pre = [len(s) - steps - block for s in seqs]
    cache = llm.target.new_cache(B, max(len(s) for s in seqs) + 1)
    target = llm.target

    def check(logits, starts, T, what):
        for b in range(B):
            got = logits[b, :T]
            ref = refs[b][starts[b]:starts[b] + T]
            assert rel_err(got, ref) < 1e-5, f"{name} request {b}: {what}"

    # 1. prefill of different lengths (right-padded)
    ids = padded([s[:n] for s, n in zip(seqs, pre)])
    T = ids.shape[1]
    h, _ = target(ids, AttentionInputs.causal(torch.arange(T).expand(B, T), kv_len=T), cache)
    logits = target.logits(h)
    for b in range(B):
        assert rel_err(logits[b, :pre[b]], refs[b][:pre[b]]) < 1e-5, f"{name} request {b}: prefill"
    # 2. a causal block of 3 tokens after each request's own prefix
    n = torch.tensor(pre)
    ids = torch.stack([torch.tensor(s[p:p + block]) for s, p in zip(seqs, pre)])
    positions = n[:, None] + torch.arange(block)
    h, _ = target(ids, AttentionInputs.causal(positions, n, kv_len=int(n.max()) + block), cache)
    check(target.logits(h), pre, block, "3-token block")
    n = n + block
    # 3. single-token decode steps
    for step in range(steps):
        ids = torch.tensor([[s[int(k)]] for s, k in zip(seqs, n)])
        h, _ = target(ids, AttentionInputs.causal(n[:, None], n, kv_len=int(n.max()) + 1), cache)
        check(target.logits(h), n.tolist(), 1, f"decode step {step}")
        n = n + 1
    assert [int(k) for k in n] == [len(s) for s in seqs]


# --------------------------------------------------------------------------- greedy generation


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n)
    new = out[0, len(ids):].tolist()
    assert len(new) == n
    return new


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_generation_matches_transformers(hf_checkpoint, name):
    """48 greedy tokens per prompt, the 3 prompts in one batch, token-identical to
    transformers' generate on each prompt alone."""
    ck = hf_checkpoint(name)
    llm = LLM(ck.path, device="cpu", dtype="float32")
    outs = llm.generate(ENGINE_PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(ENGINE_PROMPTS, outs):
        expected = hf_greedy(ck.model, llm.encode(prompt), NEW_TOKENS)
        assert out.token_ids == expected, f"{name}: {prompt!r}"
        assert out.finish_reason == "length"
        decoded = llm.tokenizer.decode(expected)  # less the part of a character the length cut left
        assert decoded.startswith(out.text) and set(decoded[len(out.text):]) <= {"\ufffd"}
    # a real comparison: the model does not just repeat one token
    assert len(set(outs[0].token_ids)) > 5


def test_transformers4_style_llama3_config_gives_same_logits(hf_checkpoint, tmp_path):
    """Published Llama-3 configs use transformers-4 keys (`rope_theta`, `rope_scaling`,
    `torch_dtype`); they must load exactly like the transformers-5 `rope_parameters`."""
    ck = hf_checkpoint("llama3-rope")
    folder = ck.copy_to(tmp_path / "v4")
    cfg = json.loads((folder / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (folder / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_pretrained(folder).rope_scaling["rope_type"] == "llama3"
    llm = LLM(folder, device="cpu", dtype="float32")
    ids = encode_all(llm)[1] * 4  # past the original 64-token context of the rope scaling
    got = tf_logits(llm, torch.tensor([ids]))[0]
    assert rel_err(got, hf_logits(ck.model, ids)) < 1e-5
    # and the scaling matters at these positions: without it the logits differ
    del cfg["rope_scaling"]
    (folder / "config.json").write_text(json.dumps(cfg))
    plain = tf_logits(LLM(folder, device="cpu", dtype="float32"), torch.tensor([ids]))[0]
    assert rel_err(plain, hf_logits(ck.model, ids)) > 1e-3
    assert LLAMA3_ROPE["original_max_position_embeddings"] < len(ids)


def test_llama3_rope_without_its_original_context_reads_max_position_embeddings(hf_checkpoint, tmp_path):
    """A llama3 rope_scaling without original_max_position_embeddings: transformers takes
    the config's max_position_embeddings (not Llama-3's 8192); without either, LlamaConfig's
    default max_position_embeddings (2048), as transformers does."""
    from transformers import AutoModelForCausalLM
    ck = hf_checkpoint("llama3-rope")
    folder = ck.copy_to(tmp_path / "no-original")
    cfg = json.loads((folder / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    del cfg[key]["original_max_position_embeddings"]
    cfg["max_position_embeddings"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, device="cpu", dtype="float32")
    ids = encode_all(llm)[1] * 2
    want = hf_logits(ref, ids)
    assert rel_err(tf_logits(llm, torch.tensor([ids]))[0], want) < 1e-5
    assert rel_err(hf_logits(ck.model, ids), want) > 1e-3  # (the original context matters here)
    del cfg["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(cfg))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, device="cpu", dtype="float32")
    assert llm.config.rope_scaling["original_max_position_embeddings"] == ref.config.max_position_embeddings == 2048
    assert rel_err(tf_logits(llm, torch.tensor([ids]))[0], hf_logits(ref, ids)) < 1e-5


def _legacy_type_key(cfg, rope):
    rope["type"] = rope.pop("rope_type")
    cfg["rope_parameters"] = rope


def _theta_inside_rope_scaling(cfg, rope):
    cfg["rope_scaling"] = rope           # its rope_theta wins over the top-level one
    cfg["rope_theta"] = 10000.0


def _original_context_at_top_level(cfg, rope):
    cfg["original_max_position_embeddings"] = rope.pop("original_max_position_embeddings")
    cfg["rope_parameters"] = rope


@pytest.mark.parametrize("layout", [_legacy_type_key, _theta_inside_rope_scaling, _original_context_at_top_level])
def test_rope_layouts_transformers_reads_alike_give_the_same_logits(hf_checkpoint, tmp_path, layout):
    """Other ways a config.json says the same llama3 RoPE, as transformers 5 reads them:
    each was read as plain RoPE or with another theta or context, a silent wrong answer."""
    from transformers import AutoModelForCausalLM
    ck = hf_checkpoint("llama3-rope")
    folder = ck.copy_to(tmp_path / layout.__name__)
    cfg = json.loads((folder / "config.json").read_text())
    layout(cfg, cfg.pop("rope_parameters"))
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(folder, device="cpu", dtype="float32")
    ids = encode_all(llm)[1] * 4  # past the scaling's original context
    want = hf_logits(ck.model, ids)
    assert rel_err(tf_logits(llm, torch.tensor([ids]))[0], want) < 1e-5
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert rel_err(hf_logits(ref, ids), want) < 1e-5  # transformers reads the layout alike


@pytest.mark.parametrize("change,words", [
    # transformers 4 reads the scaling's own context, 5 the top-level one
    (lambda cfg: cfg.update(original_max_position_embeddings=16), "transformers 4 reads the second, 5 the first"),
    (lambda cfg: cfg.update(rope_parameters={"full_attention": cfg["rope_parameters"]}), "per layer type"),
])
def test_rope_layouts_read_differently_are_refused(hf_checkpoint, tmp_path, change, words):
    folder = hf_checkpoint("llama3-rope").copy_to(tmp_path / "rope")
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TreeflashError, match=words):
        LLM(folder, device="cpu")


# --------------------------------------------------------------------------- other dtypes


@pytest.mark.parametrize("name", ["qwen3", "llama3-rope", "qwen2-window", "mistral-window"])
def test_float64_matches_transformers(hf_checkpoint, hf_model64, name):
    ck = hf_checkpoint(name)
    ref_model = hf_model64(name)
    llm = LLM(ck.path, device="cpu", dtype="float64")
    assert llm.target.lm_head.weight.dtype == torch.float64
    prompts = encode_all(llm)
    logits = tf_logits(llm, padded(prompts))
    assert logits.dtype == torch.float64
    for b, ids in enumerate(prompts):
        # transformers computes RMSNorm in float32 even for float64 models, so the
        # bound is the float32 one; treeflash keeps float64 there.
        assert rel_err(logits[b, :len(ids)], hf_logits(ref_model, ids)) < 1e-5
    outs = llm.generate(ENGINE_PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref_model, ids, NEW_TOKENS)


@pytest.mark.parametrize("name", ["qwen3", "llama-tied-bias"])
def test_bfloat16_checkpoint_loads_and_runs(hf_checkpoint, name):
    """A checkpoint saved in bfloat16 loads (float32 on CPU by default, bfloat16 on
    request) and generates; bf16 logits stay close to the float32 ones."""
    ck = hf_checkpoint(name, torch.bfloat16)
    assert json.loads((ck.path / "config.json").read_text()).get("dtype") == "bfloat16"
    auto = LLM(ck.path, device="cpu")
    assert auto.target.lm_head.weight.dtype == torch.float32
    llm = LLM(ck.path, device="cpu", dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in llm.target.parameters())
    prompts = encode_all(llm)
    low = tf_logits(llm, padded(prompts))
    assert low.dtype == torch.bfloat16
    for b, ids in enumerate(prompts):
        ref = hf_logits(ck.model, ids)  # float32 model holding the same bf16 weights
        assert rel_err(low[b, :len(ids)], ref) < 0.05
        assert rel_err(tf_logits(auto, torch.tensor([ids]))[0], ref) < 1e-5
    outs = llm.generate(ENGINE_PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for out in outs:
        assert len(out.token_ids) == NEW_TOKENS and out.finish_reason == "length"
        assert all(0 <= t < llm.config.vocab_size for t in out.token_ids)
    sampled = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=16, temperature=1.0, seed=3,
                                                              ignore_eos=True))[0]
    assert len(sampled.token_ids) == 16


def test_a_batch_of_draft_rows_reads_each_weight_once():
    """The draft's LM head gets h[:, 1:] of [B, block, H]: rows not evenly strided. As
    B products (torch's matmul does not fold such a tensor) each read the whole weight:
    an 8B shape's draft step took 3.3 ms at 8 requests against 1.1 at 4. `linear`
    flattens the rows first, one product for the batch, and its values are F.linear's."""
    from treeflash.ops import linear
    h, w, b = torch.randn(8, 16, 32, dtype=torch.float64), torch.randn(48, 32, dtype=torch.float64), None
    rows = h[:, 1:]
    assert not rows.is_contiguous()
    for x in (rows, rows[0, 0], rows[:0]):  # a batch, one row, no rows
        with torch.profiler.profile() as prof:
            y = linear(x, w, b)
        ops = [e.key for e in prof.key_averages()]
        assert "aten::bmm" not in ops and y.shape == (*x.shape[:-1], 48)
        assert torch.allclose(y, F.linear(x, w, b), rtol=0, atol=1e-12)


# ------------------------------------------------------------------------ weights and configs a real checkpoint has


def _retrained_copy(ck, folder, rms_norm_eps: float):
    """transformers' model of checkpoint `ck` with another rms_norm_eps and its norm weights
    and biases drawn away from their init (ones, zeros: where a swapped norm or a dropped
    bias or eps changes nothing), saved to `folder` with ck's tokenizer."""
    cfg = copy.deepcopy(ck.model.config)
    cfg.rms_norm_eps = rms_norm_eps
    model = type(ck.model)(cfg).eval()
    model.load_state_dict(ck.model.state_dict())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    for f in ck.path.iterdir():
        if f.name.startswith("tokenizer"):
            (folder / f.name).write_bytes(f.read_bytes())
    return model


@pytest.mark.parametrize("name", ["qwen3", "llama-tied-bias", "qwen2-tied", "mistral-window"])
def test_trained_norm_weights_biases_and_eps_match_transformers(hf_checkpoint, tmp_path, name):
    """A real checkpoint's norms (q/k norms included) have their own weights, its biases are
    not zero and its rms_norm_eps is its own: each reaches the layer it belongs to."""
    ck = hf_checkpoint(name)
    model = _retrained_copy(ck, tmp_path, rms_norm_eps=0.05)
    llm = LLM(tmp_path, device="cpu", dtype="float32")
    prompts = encode_all(llm)
    batch = padded(prompts)
    cached = tf_logits(llm, batch, llm.target.new_cache(3, batch.shape[1]))
    for b, ids in enumerate(prompts):
        ref = hf_logits(model, ids)
        assert rel_err(cached[b, :len(ids)], ref) < 1e-5, f"{name} prompt {b}"
        assert rel_err(hf_logits(ck.model, ids), ref) > 1e-3  # the changes matter


def test_qwen3_sliding_window_through_the_kv_cache_matches_transformers(hf_checkpoint, clone_checkpoint):
    """The engine prefills a prompt through the KV cache and decodes from it: with a
    Qwen3 sliding window (no sinks) shorter than the prompt, both give transformers'
    logits and greedy tokens."""
    from transformers import AutoModelForCausalLM
    folder = clone_checkpoint(hf_checkpoint("qwen3").path, layer_types=None, use_sliding_window=True,
                              sliding_window=8, max_window_layers=0)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    llm = LLM(folder, device="cpu", dtype="float32")
    assert llm.config.sliding_layers == (0, 1)
    ids = encode_all(llm)[1]
    assert len(ids) > 2 * llm.config.sliding_window
    cached = tf_logits(llm, torch.tensor([ids]), llm.target.new_cache(1, len(ids)))[0]
    assert rel_err(cached, hf_logits(ref, ids)) < 1e-5
    out = llm.generate([ids], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(ref, ids, 12)


def test_qwen2_and_mistral_checkpoints_are_the_layouts_claimed(hf_checkpoint):
    """The Qwen2 and Mistral variants the tests above run hold what they claim: Qwen2's
    q/k/v biases (not zero) and no o_proj or MLP bias, no lm_head when tied, windows of 8
    (shorter than every prompt) in the layers transformers slides, a Mistral head_dim
    other than hidden / heads."""
    def tensors(name: str) -> dict:
        with safe_open(str(hf_checkpoint(name).path / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    for name in ("qwen2-window", "qwen2-tied"):
        w = tensors(name)
        assert all(w[f"model.layers.0.self_attn.{p}_proj.bias"].abs().max() > 0.1 for p in "qkv")
        assert not any(k.endswith(("o_proj.bias", "mlp.gate_proj.bias", "mlp.down_proj.bias")) for k in w)
        assert ("lm_head.weight" in w) == (name == "qwen2-window")
    assert not any(k.endswith(".bias") for k in tensors("mistral-window"))
    ck = hf_checkpoint("qwen2-window")
    assert ck.model.config.layer_types == ["full_attention", "sliding_attention"]
    cfg = ModelConfig.from_pretrained(ck.path)
    assert (cfg.arch, cfg.sliding_window, cfg.sliding_layers) == ("qwen2", 8, (1,))
    assert ModelConfig.from_pretrained(hf_checkpoint("qwen2-tied").path).sliding_layers == ()
    cfg = ModelConfig.from_pretrained(hf_checkpoint("mistral-window").path)
    assert (cfg.arch, cfg.sliding_window, cfg.sliding_layers, cfg.head_dim) == ("mistral", 8, (0, 1), 32)
    assert cfg.head_dim != cfg.hidden_size // cfg.num_heads
    assert min(len(ids) for ids in encode_all(LLM(ck.path, device="cpu", dtype="float32"))) > 8


@pytest.mark.parametrize("name,unslid", [("qwen2-window", dict(use_sliding_window=False, layer_types=None)),
                                         ("mistral-window", dict(sliding_window=None))])
def test_the_windows_change_the_logits(hf_checkpoint, clone_checkpoint, name, unslid):
    """Attending fully, the windowed variants' logits are not transformers' (which slides):
    the comparisons above check the window, not attention it never cuts."""
    ck = hf_checkpoint(name)
    llm = LLM(clone_checkpoint(ck.path, **unslid), device="cpu", dtype="float32")
    assert llm.config.sliding_layers == ()
    ids = encode_all(llm)[1]
    assert rel_err(tf_logits(llm, torch.tensor([ids]))[0], hf_logits(ck.model, ids)) > 1e-3


@pytest.mark.parametrize("name", ["qwen2-window", "mistral-window"])
@torch.no_grad()
def test_the_training_forward_slides_as_transformers(hf_checkpoint, name):
    """Drafter training reads the target through the mask-free causal path
    (`train.target.causal_inputs`), not the engine's: its logits are transformers' too."""
    from treeflash.train.target import causal_inputs
    ck = hf_checkpoint(name)
    llm = LLM(ck.path, device="cpu", dtype="float32")
    ids = encode_all(llm)[1]
    h, _ = llm.target(torch.tensor([ids]), causal_inputs(torch.tensor([ids])))
    assert rel_err(llm.target.logits(h)[0], hf_logits(ck.model, ids)) < 1e-5


@pytest.mark.parametrize("rope", [
    # Qwen3's documented YaRN: beta_fast / beta_slow / truncate left to their defaults (32, 1, true)
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 65536},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 65536, "attention_factor": 0.8,
     "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    # a factor below 1 takes no attention factor (1, not 0.1 ln(factor) + 1), as in transformers
    {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 65536},
], ids=["defaults", "explicit", "factor-below-1"])
def test_qwen3_yarn_rope_matches_transformers(hf_checkpoint, clone_checkpoint, rope):
    """A Qwen3 with YaRN rope scaling, as Qwen documents it for long contexts (theta and
    original context picked so that the ramp reaches past the middle of the head)."""
    from transformers import AutoModelForCausalLM
    ck = hf_checkpoint("qwen3")
    folder = clone_checkpoint(ck.path, rope_parameters={**rope, "rope_theta": 10000.0})
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, device="cpu", dtype="float32")
    ids = encode_all(llm)[1]
    want = hf_logits(ref, ids)
    assert rel_err(tf_logits(llm, torch.tensor([ids]))[0], want) < 1e-5
    assert rel_err(hf_logits(ck.model, ids), want) > 1e-3  # the scaling matters


def test_yarn_serves_its_original_context_times_its_factor(hf_checkpoint, clone_checkpoint):
    """Qwen3's YaRN recipe stretches 32768 positions 4 times, past the config's
    max_position_embeddings of 40960: the model serves original x factor positions (as
    vLLM derives them), and a prompt past max_position_embeddings decodes as
    transformers' (it was refused with 'maximum context length is 40960')."""
    from transformers import AutoModelForCausalLM
    folder = clone_checkpoint(hf_checkpoint("qwen3").path, max_position_embeddings=48, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0})
    llm = LLM(folder, device="cpu", dtype="float32", method="ar")
    assert llm.config.context_length == llm.max_model_len == 128
    ids = [(5 * i) % 40 + 3 for i in range(90)]
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert llm.generate([ids], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids == hf_greedy(ref, ids, 12)
    with pytest.raises(UsageError, match="max_model_len 129 exceeds the model's context of 128 positions \\(YaRN's "
                                         "original_max_position_embeddings 32 x factor 4\\)"):
        LLM(folder, device="cpu", max_model_len=129)


def test_tapped_features_are_transformers_hidden_states(hf_checkpoint):
    """The drafter reads the target's residual stream after each tapped layer: what
    transformers returns as hidden_states[id + 1] (after the final norm for the last
    layer), which published drafters were trained on."""
    ck = hf_checkpoint("qwen3")
    llm = LLM(ck.path, device="cpu", dtype="float32")
    ids = encode_all(llm)[1]
    T = len(ids)
    with torch.no_grad():
        _, feats = llm.target(torch.tensor([ids]), AttentionInputs.causal(torch.arange(T)[None]), taps=[0, 1])
        hidden = ck.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    H = llm.config.hidden_size
    for j, layer in enumerate([0, 1]):
        assert rel_err(feats[0, :, j * H:(j + 1) * H], hidden[layer + 1][0]) < 1e-5, layer


def test_vocabulary_shards_embed_each_id_once():
    """Under tensor parallelism each rank embeds only the ids of its vocabulary slice and
    the all-reduce sums the shares: the ids at the slices' edges get their own row, once."""
    from treeflash.distributed import TPGroup
    from treeflash.layers.embedding import VocabParallelEmbedding

    class Unreduced(TPGroup):   # each rank's share, before the all-reduce
        def all_reduce(self, x):
            return x

    V, D, n = 12, 5, 3
    table = torch.randn(V, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids = torch.arange(V)[None]
    total = torch.zeros(1, V, D, dtype=torch.float64)
    for rank in range(n):
        emb = VocabParallelEmbedding(V, D, Unreduced(rank=rank, size=n)).double()
        emb.weight.data.copy_(table[rank * V // n:(rank + 1) * V // n])
        total += emb(ids)
    assert torch.equal(total, table[None])


def test_rms_norm_in_bfloat16_rounds_as_transformers(hf_checkpoint):
    """A bf16 model's RMSNorm: computed in float32, cast back, then times the weight in
    bf16, bit for bit as transformers' (any other order rounds differently)."""
    from treeflash.layers.norm import RMSNorm
    theirs = copy.deepcopy(hf_checkpoint("qwen3").model.model.norm)
    ours = RMSNorm(theirs.weight.shape[0], theirs.variance_epsilon)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ours.weight.copy_(1 + torch.randn(ours.weight.shape, generator=gen))
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    x = (3 * torch.randn(4, 7, ours.weight.shape[0], generator=gen)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("rope", [
    None,
    {**LLAMA3_ROPE, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},   # gpt-oss's
    # one beta for both ends of the ramp, untruncated: a ramp 0.001 dims wide, as transformers'
    {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 8.0, "truncate": False,
     "original_max_position_embeddings": 65536, "rope_theta": 10000.0},
    # Qwen3's YaRN recipe (x4 over 32768, the default betas, truncated), here on head_dim 32: its
    # interpolated frequencies round 1 ulp apart unless blended in transformers' order
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1000000.0},
], ids=["default", "llama3", "yarn", "yarn-one-beta", "yarn-qwen3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rotary_cos_sin_are_transformers_bit_for_bit(hf_checkpoint, clone_checkpoint, rope, dtype):
    """The cos and sin a model's attention rotates by, at positions far into a long context:
    the angles are float32 products of the position and the float32 frequencies, and YaRN's
    factor multiplies them before the cast to the model's dtype (bf16 included), as in
    transformers: any other order or precision rounds differently, position by position."""
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from treeflash.layers.rotary import RotaryEmbedding
    ck = hf_checkpoint("qwen3")
    folder = ck.path if rope is None else clone_checkpoint(ck.path, rope_parameters=rope)
    cfg = ModelConfig.from_pretrained(folder)
    theirs = Qwen3RotaryEmbedding(AutoConfig.from_pretrained(folder))
    ours = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    positions = torch.tensor([[0, 1, 7, 255, 256, 1000, 4095, 4097, 20011, 65537, 131071]])
    cos, sin = ours.cos_sin(positions, dtype)
    want_cos, want_sin = theirs(torch.zeros(1, dtype=dtype), positions)
    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_float64_norms_stay_in_float64(hf_checkpoint, hf_model64, monkeypatch):
    """A float64 model is the reference the speculative tests hold the engine to: its
    RMSNorms (q/k norms included) compute in float64, not in the float32 transformers
    uses for them, so its logits are transformers' with float64 norms to 1e-10."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def float64_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(Qwen3RMSNorm, "forward", float64_norm)
    ck = hf_checkpoint("qwen3")
    llm = LLM(ck.path, device="cpu", dtype="float64")
    ids = encode_all(llm)[1]
    want = hf_logits(hf_model64("qwen3"), ids)
    assert rel_err(tf_logits(llm, torch.tensor([ids]))[0], want) < 1e-10
