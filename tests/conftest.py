"""Shared fixtures. Append new fixtures in their own section; do not rewrite others'."""
from __future__ import annotations

# ---------------------------------------------------------------------------
# Engine tests (issue 2): tiny random Qwen3 / Llama checkpoints written by
# transformers itself, with a small byte-level BPE tokenizer, built once per session.
# ---------------------------------------------------------------------------
import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Every model in the suite is tiny: one thread is faster (and steadier on a shared
    2-core machine) than two fighting over small matmuls."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

# Three prompts of different lengths (in tokens of the tiny tokenizer).
ENGINE_PROMPTS = [
    "def fib(n):",
    "import os\nimport sys\n\nclass Point:\n    def __init__(self, x, y):",
    "the quick brown fox",
]

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # small enough that the tiny head_dim has high, medium and low frequency bands
               "original_max_position_embeddings": 64}

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
             pad_token_id=1,
             # larger than HF's 0.02: tied tiny models otherwise just repeat their last token
             initializer_range=0.3)

# name -> (architecture, config overrides, save_pretrained kwargs, seed). The seeds are
# fixed per variant: a new one never changes the others' weights.
HF_VARIANTS = {
    # head_dim != hidden / heads, as in real Qwen3 checkpoints
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=False), {}, 2),
    "qwen3-tied-sharded": ("qwen3", dict(head_dim=16, tie_word_embeddings=True), {"max_shard_size": "50KB"}, 3),
    "llama3-rope": ("llama", dict(tie_word_embeddings=False, rope_theta=500000.0,
                                  rope_scaling=dict(LLAMA3_ROPE)), {}, 1),
    "llama-tied-bias": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True), {}, 0),
    # Qwen2: q/k/v biases, a window of 8 tokens (shorter than the prompts) in layer 1, the
    # layers from max_window_layers on
    "qwen2-window": ("qwen2", dict(tie_word_embeddings=False, use_sliding_window=True, sliding_window=8,
                                   max_window_layers=1), {}, 4),
    # tied, as Qwen2.5-0.5B
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True), {}, 5),
    # a window of 8 in every layer; head_dim given, not hidden / heads (as Mistral-Nemo's)
    "mistral-window": ("mistral", dict(tie_word_embeddings=False, sliding_window=8, head_dim=32), {}, 6),
}


@dataclass
class HFCheckpoint:
    name: str
    path: Path
    model: torch.nn.Module   # the transformers model (float32, eval) the files were saved from

    def copy_to(self, dest: Path) -> Path:
        """A private copy of the checkpoint folder (for tests that damage it)."""
        shutil.copytree(self.path, dest)
        return dest


def _build_hf(name: str, folder: Path, dtype: torch.dtype = torch.float32) -> HFCheckpoint:
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    from treeflash.checkpoints import write_tiny_tokenizer

    arch, overrides, save_kwargs, seed = HF_VARIANTS[name]
    vocab = write_tiny_tokenizer(folder)
    cfg_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
                          "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    cfg = cfg_cls(vocab_size=vocab, **_TINY, **overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    biases = torch.Generator().manual_seed(seed)  # apart: the weights stay those of the seed
    with torch.no_grad():  # transformers makes biases zero, where a bias that never arrives changes nothing
        for param_name, p in model.named_parameters():
            if param_name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=biases) * 0.3)
    if dtype != torch.float32:
        copy.deepcopy(model).to(dtype).save_pretrained(folder, **save_kwargs)
        # round the weights only: `.to(dtype).float()` on the model would also round
        # the rotary inv_freq buffer of transformers
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    else:
        model.save_pretrained(folder, **save_kwargs)
    # HF generate must not stop at EOS: the engine tests compare exactly 48 tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 1
    return HFCheckpoint(name, folder, model)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name, dtype=float32) -> HFCheckpoint, built once per session.

    With dtype bfloat16 the files hold bf16 weights and `model` is the float32 model
    holding those same (rounded) values."""
    built: dict[tuple[str, torch.dtype], HFCheckpoint] = {}

    def get(name: str, dtype: torch.dtype = torch.float32) -> HFCheckpoint:
        key = (name, dtype)
        if key not in built:
            folder = tmp_path_factory.mktemp(f"hf-{name}-{str(dtype).replace('torch.', '')}")
            built[key] = _build_hf(name, folder, dtype)
        return built[key]

    return get


@pytest.fixture
def hf_model64(hf_checkpoint):
    """hf_model64(name): a float64 copy of the transformers model of checkpoint `name`."""
    def get(name: str):
        return copy.deepcopy(hf_checkpoint(name).model).double()
    return get


# ---------------------------------------------------------------------------
# Speculative decoding tests (issues 3-5): tiny random targets written by
# treeflash.checkpoints (peaked ones, where random drafters get real acceptances,
# and plain ones), random DFlash drafters, a "constant" target with a perfect and a
# useless drafter, and memoized single-prompt AR references. Built once per session.
# ---------------------------------------------------------------------------
import random as _random


def _spec_prompts() -> list[list[int]]:
    """20 token-id prompts of mixed lengths (four of length 1) over the tiny vocabulary."""
    rng = _random.Random(1234)
    lengths = [1, 5, 12, 3, 1, 8, 21, 2, 1, 30, 4, 9, 1, 16, 6, 2, 13, 7, 40, 3]
    return [[rng.randrange(3, 258) for _ in range(n)] for n in lengths]


SPEC_PROMPTS = _spec_prompts()
CONSTANT_TOKEN = 7  # the token the constant target always predicts (not EOS)


@pytest.fixture(scope="session")
def spec_target(tmp_path_factory):
    """spec_target(arch, kind) -> folder of a tiny random target (hidden 64, 4 layers,
    vocab 259, EOS 0). kind 'peaked': peaked_tokens=8, std=0.2 (random drafters get
    acceptances; nearly deterministic even at T = 1); 'warm': the same with the boost
    of those 8 LM-head rows cut from 25x to 5x and the head halved, so sampling at
    T >= 0.3 changes the stream while drafters still get acceptances; 'plain': the
    default random weights (broad distributions: top-k / top-p filters bite)."""
    from safetensors.torch import load_file, save_file

    from treeflash.checkpoints import write_random_target
    built: dict = {}

    def get(arch: str = "qwen3", kind: str = "peaked") -> Path:
        if (arch, kind) not in built:
            folder = tmp_path_factory.mktemp(f"spec-{arch}-{kind}")
            kw = dict(peaked_tokens=8, std=0.2) if kind in ("peaked", "warm") else {}
            target = write_random_target(folder, arch=arch, seed=3 if arch == "llama" else 0, **kw)
            if kind == "warm":
                w = load_file(str(target / "model.safetensors"))
                w["lm_head.weight"][3:11] /= 5
                w["lm_head.weight"] *= 0.5
                save_file(w, str(target / "model.safetensors"))
            built[arch, kind] = target
        return built[arch, kind]

    return get


@pytest.fixture(scope="session")
def spec_drafter(tmp_path_factory, spec_target):
    """spec_drafter(arch, kind, block_size) -> folder of a random 2-layer DFlash drafter for spec_target(arch, kind)."""
    from treeflash.checkpoints import write_random_drafter
    built: dict = {}

    def get(arch: str = "qwen3", kind: str = "peaked", block_size: int = 8) -> Path:
        key = (arch, kind, block_size)
        if key not in built:
            folder = tmp_path_factory.mktemp(f"spec-drafter-{arch}-{kind}-{block_size}")
            built[key] = write_random_drafter(spec_target(arch, kind), folder, block_size=block_size, seed=block_size)
        return built[key]

    return get


@pytest.fixture(scope="session")
def clone_checkpoint(tmp_path_factory):
    """clone_checkpoint(src, **config_overrides) -> a new folder holding checkpoint `src`
    (weights and tokenizer linked) with those config.json keys changed."""
    def make(src: Path, **config_overrides) -> Path:
        dest = tmp_path_factory.mktemp(f"clone-{Path(src).name}")
        for f in Path(src).iterdir():
            if f.name != "config.json":
                (dest / f.name).symlink_to(f.resolve())
        cfg = json.loads((Path(src) / "config.json").read_text())
        cfg.update(config_overrides)
        (dest / "config.json").write_text(json.dumps(cfg, indent=2))
        return dest

    return make


# Mixture-of-experts targets (tests/test_moe.py, and FP8 experts in tests/test_fp8.py)

MOE_TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, max_position_embeddings=256,
                bos_token_id=0, eos_token_id=0, pad_token_id=1, initializer_range=0.3)

# name -> (config overrides, save_pretrained kwargs)
MOE_VARIANTS = {
    # dense first layer (as Kimi-K2 / DeepSeek), 8 experts, top-2 renormalized (as Qwen3-30B-A3B)
    "moe": (dict(num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True), {}),
    # every second layer sparse, top-3 of 4 not renormalized; tied embeddings, sharded files
    "moe-step2": (dict(num_experts=4, num_experts_per_tok=3, decoder_sparse_step=2, norm_topk_prob=False,
                       tie_word_embeddings=True), {"max_shard_size": "40KB"}),
}


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """moe_checkpoint(name) -> HFCheckpoint written by transformers (float32)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from treeflash.checkpoints import write_tiny_tokenizer
    built: dict[str, HFCheckpoint] = {}

    def get(name: str) -> HFCheckpoint:
        if name not in built:
            folder = tmp_path_factory.mktemp(f"hf-{name}")
            write_tiny_tokenizer(folder)
            overrides, save_kwargs = MOE_VARIANTS[name]
            torch.manual_seed(list(MOE_VARIANTS).index(name))
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_TINY, **overrides)).eval()
            model.save_pretrained(folder, **save_kwargs)
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 1
            built[name] = HFCheckpoint(name, folder, model)
        return built[name]

    return get


@pytest.fixture(scope="session")
def spec_moe(moe_checkpoint, tmp_path_factory):
    """(target, drafter): the "moe" checkpoint with a shared expert added (DeepSeek's key
    names) and a peaked LM head (ids 3..10 boosted: random drafts get accepted), and a
    random 1-layer DFlash drafter of block size 8."""
    from safetensors.torch import load_file, save_file

    from treeflash.checkpoints import write_random_drafter
    src = moe_checkpoint("moe").path
    root = tmp_path_factory.mktemp("spec-moe")
    target = root / "target"
    target.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (target / f).write_bytes((src / f).read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "n_shared_experts": 1}))
    w = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    for i in range(1, cfg["num_hidden_layers"]):
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w[f"model.layers.{i}.mlp.shared_experts.{name}.weight"] = torch.randn(shape, generator=gen) * 0.3
    w["lm_head.weight"][3:11] *= 10
    save_file(w, str(target / "model.safetensors"))
    return target, write_random_drafter(target, root / "drafter", num_layers=1, block_size=8, seed=2)


@pytest.fixture(scope="session")
def constant_pair(tmp_path_factory):
    """constant_pair(block_size) -> (target, perfect drafter, useless drafter).

    The target always predicts CONSTANT_TOKEN: every token embedding is the same vector
    and every o_proj / down_proj is zero, so the residual stream never changes; its LM
    head puts a margin of ~40 logits on CONSTANT_TOKEN. The perfect drafter has zero
    o_proj / down_proj and the target's final-norm weights, so (sharing the target's
    embedding and head) it predicts CONSTANT_TOKEN at every slot with probability ~1.
    The useless drafter negates those norm weights: CONSTANT_TOKEN becomes its least
    likely token."""
    from safetensors.torch import load_file, save_file

    from treeflash.checkpoints import write_random_drafter, write_random_target
    built: dict = {}

    def get(block_size: int = 8):
        if block_size in built:
            return built[block_size]
        root = tmp_path_factory.mktemp(f"constant-{block_size}")
        target = write_random_target(root / "target", num_layers=2, seed=7)
        w = load_file(str(target / "model.safetensors"))
        w["model.embed_tokens.weight"][:] = w["model.embed_tokens.weight"][5].clone()
        for k in w:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                w[k].zero_()
        e = w["model.embed_tokens.weight"][0]
        final = e * torch.rsqrt(e.pow(2).mean() + 1e-6) * w["model.norm.weight"]
        w["lm_head.weight"][CONSTANT_TOKEN] += 40 * final / final.pow(2).sum()
        save_file(w, str(target / "model.safetensors"))
        drafters = []
        for name, sign in (("perfect", 1.0), ("useless", -1.0)):
            d = write_random_drafter(target, root / name, block_size=block_size, seed=1)
            dw = load_file(str(d / "model.safetensors"))
            for k in dw:
                if k.endswith(("o_proj.weight", "down_proj.weight")):
                    dw[k].zero_()
            dw["norm.weight"] = sign * w["model.norm.weight"].clone()
            save_file(dw, str(d / "model.safetensors"))
            drafters.append(d)
        built[block_size] = (target, *drafters)
        return built[block_size]

    return get


@pytest.fixture(scope="session")
def ar_reference():
    """ar_reference(target, prompt, params) -> GenerationOutput of float64 AR decoding of
    that single prompt (memoized per target, prompt and sampling parameters)."""
    from treeflash import LLM
    llms: dict = {}
    memo: dict = {}

    def get(target: Path, prompt: list[int], params):
        key = (str(target), tuple(prompt), repr(params))
        if key not in memo:
            if str(target) not in llms:
                llms[str(target)] = LLM(target, method="ar", device="cpu", dtype="float64")
            memo[key] = llms[str(target)].generate([list(prompt)], copy.deepcopy(params))[0]
        return memo[key]

    return get


# ---------------------------------------------------------------------------
# Engine tests (issue 2), continued: a checkpoint whose EOS is the greedy choice
# at a known step.
# ---------------------------------------------------------------------------
@dataclass
class EOSCheckpoint:
    path: Path
    full: list[int]      # greedy tokens of ENGINE_PROMPTS[0] with EOS ignored
    step: int            # index in `full` where EOS is the greedy token
    eos: int


@pytest.fixture(scope="session")
def eos_checkpoint(hf_checkpoint, tmp_path_factory):
    """The untied "qwen3" checkpoint with lm_head row 0 (<|endoftext|>) replaced by the
    row of the token greedy decoding picks at step >= 5 for the first time: logits tie,
    argmax takes the lower id, so greedy decoding emits EOS exactly there (and the
    tokens before it are unchanged)."""
    from safetensors.torch import load_file, save_file

    from treeflash import LLM, SamplingParams

    src = hf_checkpoint("qwen3")
    base = LLM(src.path, device="cpu", dtype="float32")
    before = base.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=48, ignore_eos=True))[0].token_ids
    step = next(i for i in range(5, len(before)) if before[i] not in before[:i])
    folder = src.copy_to(tmp_path_factory.mktemp("eos") / "ckpt")
    weights = load_file(str(folder / "model.safetensors"))
    weights["lm_head.weight"][0] = weights["lm_head.weight"][before[step]]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(folder, device="cpu", dtype="float32")
    assert llm.eos_token_ids == [0]
    full = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=48, ignore_eos=True))[0].token_ids
    assert full[:step] == before[:step] and full[step] == 0
    return EOSCheckpoint(folder, full, step, 0)


# ---------------------------------------------------------------------------
# Triton interpreter (TRITON_INTERPRET=1: kernels on the CPU). It turns a scalar
# kernel argument used as a loop bound into a one-element array, which numpy >= 2.3
# no longer converts with int(): take its one element instead.
# ---------------------------------------------------------------------------
def _patch_triton_interpreter() -> None:
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patch_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_index


_patch_triton_interpreter()


# ---------------------------------------------------------------------------
# A SentencePiece-style tokenizer.json (Llama 2, Mistral): "▁" for spaces, byte
# fallback, a decoder that strips a text's first space.
# ---------------------------------------------------------------------------
SP_PIECES = (["<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
             + ["\u2581", "a", "b", "\u2581a", "\u2581ab", "\u2581\u2581", "\u2581\u2581\u2581\u2581"])


def write_sentencepiece_model(folder: Path, spaced: bool = False) -> Path:
    """A one-layer random target with that tokenizer; `spaced`: its LM head favours the
    pieces that start with a space (the model writes " ab", not "ab")."""
    from safetensors.torch import load_file, save_file

    from treeflash.checkpoints import write_random_target
    write_random_target(folder, num_layers=1, vocab_size=write_sentencepiece_tokenizer(folder), seed=1)
    if spaced:
        w = load_file(str(folder / "model.safetensors"))
        w["lm_head.weight"][[i for i, p in enumerate(SP_PIECES) if p.startswith("\u2581")]] *= 25
        save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def write_sentencepiece_tokenizer(folder: Path) -> int:
    """Write it to folder/tokenizer.json; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    vocab = {p: i for i, p in enumerate(SP_PIECES)}
    merges = [("\u2581", "a"), ("\u2581a", "b"), ("\u2581", "\u2581"), ("\u2581\u2581", "\u2581\u2581")]
    sp = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    Path(folder).mkdir(parents=True, exist_ok=True)
    sp.save(str(Path(folder) / "tokenizer.json"))
    return len(SP_PIECES)


# ---------------------------------------------------------------------------
# Triton interpreter runs (TRITON_INTERPRET=1, CI's kernel tests on the CPU)
# ---------------------------------------------------------------------------
import os  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter import skip_repatching_inside_launches
    skip_repatching_inside_launches()
