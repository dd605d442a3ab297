"""Smoke tests of the training code on tiny shapes (CPU, well under a minute):
tokenizer + corpus, target training / resume / export, drafter training / export,
target-generated data, and the one-line errors for bad input."""
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from treeflash import LLM, SamplingParams
from treeflash.errors import TreeflashError, UsageError
from treeflash.checkpoints import write_random_target
from treeflash.config import default_target_layer_ids
from treeflash.engine.options import builtin_paths
from treeflash.train.cli import main as cli_main
from treeflash.train.common import DEFAULT_OPTIONS, Trainer, TrainOptions, tf32_products
from treeflash.train.corpus import collect, load_corpus, write_corpus
from treeflash.train.drafter import DrafterShape, generate_continuations, target_fingerprint, train_drafter
from treeflash.train.target import TargetShape, train_target
from treeflash.train.tokenizer import train_tokenizer

TINY = TargetShape(hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
OPTS = dict(batch_size=8, seq_len=32, lr=1e-2, warmup_steps=5, log_every=5, eval_every=20, eval_tokens=256,
            save_every=10, device="cpu")
PROMPT = "def add(a, b):\n"


def _source(i: int) -> str:
    name = ["add", "scale", "clip", "mean", "norm", "pairs", "count", "merge"][i % 8]
    return (f'"""Module {i}."""\nimport math\n\n\ndef {name}(a, b):\n    """Return {name} of a and b."""\n'
            f"    if a > b:\n        return a - b + {i}\n    return math.sqrt(a * a + b * b) * {i}\n\n\n"
            f"class Point{i}:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
            f"    def {name}(self, other):\n        return Point{i}(self.x + other.x, self.y + other.y)\n")


def _corpus_files(root, n=24):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"mod_{i}.py").write_text(_source(i))
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("corpus")
    src = _corpus_files(base / "src")
    corpus = collect([src], heldout_fraction=0.25)
    assert corpus.train and corpus.heldout
    train_tokenizer(corpus.train, base / "tok", vocab_size=320)
    meta = write_corpus(base / "tok", base / "data", [src], heldout_fraction=0.25, compress=True)
    assert meta["vocab_size"] == 320 and meta["dtype"] == "uint16" and meta["train_tokens"] > 1000
    return base / "data"


@pytest.fixture(scope="module")
def target(tmp_path_factory, data_dir):
    base = tmp_path_factory.mktemp("target")
    summary = train_target(data_dir, base / "run", base / "model", TINY, TrainOptions(max_steps=40, **OPTS))
    return base, summary


def _losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if "loss" in r]


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def test_corpus_dedup_split_cap(tmp_path):
    src = _corpus_files(tmp_path / "src", 8)
    (src / "copy.py").write_text(_source(0))                       # duplicate content
    (src / "latin1.py").write_bytes(b"x = '\xe9'\n")               # not UTF-8
    (src / "empty.py").write_text("\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "cached.py").write_text("x = 1\n")
    a = collect([src], heldout_fraction=0.3)
    assert a.stats["duplicates"] == 1 and a.stats["skipped"] == 2 and a.stats["files_seen"] == 11
    assert len(a.train) + len(a.heldout) == 8
    b = collect([src], heldout_fraction=0.3)
    assert (a.train, a.heldout) == (b.train, b.heldout)             # deterministic split
    capped = collect([src], heldout_fraction=0.3, max_bytes=int(len(_source(0).encode()) * 3.5))
    assert capped.stats["capped"] and len(capped.train) + len(capped.heldout) == 3


def test_a_vocabulary_with_unused_ids_is_stored_by_its_largest_id(tmp_path):
    """A tokenizer may leave ids unused (a WordLevel vocabulary with words at 70000+): the
    corpus is stored for its largest id, not its count of tokens (uint16 overflowed), and
    its vocab_size is that id + 1, which the target's must reach."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "x": 2, "=": 3, "1": 70_000}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"m{i}.py").write_text(f"x = 1\n# {i}\n")
    meta = write_corpus(tmp_path / "tok", tmp_path / "data", [src], heldout_fraction=0.25)
    assert meta["vocab_size"] == 70_001 and meta["dtype"] == "int32"
    assert 70_000 in np.load(tmp_path / "data" / "train.npy")


def test_corpus_of_your_own_text(tmp_path, data_dir):
    """--suffixes: a drafter for a chat or prose target trains on text like its own. Text
    files are whole documents (long lines and large files kept: paragraphs, books); a
    .jsonl file holds one document per line, split line by line; a line without a
    string 'text' is an error naming the file and line."""
    src = tmp_path / "text"
    src.mkdir()
    (src / "notes.md").write_text("# Notes\n" + "A long paragraph. " * 200 + "\n")
    (src / "book.txt").write_text("Chapter one.\n" * 50_000)  # 650 KB: past the .py size limit
    (src / "chats.jsonl").write_text("".join(json.dumps({"text": f"User: question {i}?\nAssistant: answer {i}."})
                                             + "\n" for i in range(40)) + "\n")
    (src / "skip.py").write_text("x = 1\n")
    corpus = collect([src], heldout_fraction=0.2, suffixes=(".md", ".txt", ".jsonl"))
    docs = corpus.train + corpus.heldout
    assert len(docs) == 42 and corpus.heldout and "x = 1\n" not in docs
    assert "User: question 7?\nAssistant: answer 7." in docs and "Chapter one.\n" * 50_000 in docs
    assert collect([src], heldout_fraction=0.2, suffixes=(".jsonl",)).heldout == \
        [d for d in corpus.heldout if d.startswith("User")]  # the split is per line, stable
    meta = write_corpus(data_dir, tmp_path / "ids", [src], heldout_fraction=0.2, suffixes=(".jsonl",))
    assert meta["train_files"] + meta["heldout_files"] == 40 and meta["suffixes"] == [".jsonl"]
    (src / "chats.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"prompt": "no"}) + "\n")
    with pytest.raises(UsageError, match=r"chats.jsonl:2: .* string 'text'"):
        collect([src], suffixes=(".jsonl",))
    with pytest.raises(UsageError, match="suffixes must look like"):
        collect([src], suffixes=("txt",))


def test_rendered_chats_keep_their_special_tokens(tmp_path, data_dir):
    """A .jsonl line is a chat rendered with the target's template: its special-token text
    becomes the special token, as in the target's prompts; a source file that spells one
    keeps it as text (no stray EOS or PAD). Neither keeps a byte-order mark."""
    from treeflash.tokenizer import Tokenizer
    chat = "<|pad|>user\nhello<|endoftext|>\n<|pad|>assistant\nhi there<|endoftext|>\n"
    engine_ids = Tokenizer(data_dir).encode(chat, special=False)
    assert engine_ids.count(1) == 2 and engine_ids.count(0) == 2
    for name, suffix, body in (("chats", ".jsonl", json.dumps({"text": chat}) + "\n"), ("code", ".py", chat)):
        root = tmp_path / name
        root.mkdir()
        (root / f"a{suffix}").write_bytes(b"\xef\xbb\xbf" + body.encode())
        assert collect([root], heldout_fraction=0, suffixes=(suffix,)).train == [chat]
        write_corpus(data_dir, tmp_path / f"{name}_ids", [root], heldout_fraction=0, suffixes=(suffix,))
        ids = load_corpus(tmp_path / f"{name}_ids").train.tolist()
        if suffix == ".jsonl":
            assert ids == engine_ids + [0]
        else:
            assert 1 not in ids and ids.count(0) == 1 and ids[-1] == 0


def test_tokenizer_files(data_dir, tmp_path):
    from treeflash.tokenizer import Tokenizer
    tok = Tokenizer(data_dir)
    assert [tok.tok.token_to_id(t) for t in ("<|endoftext|>", "<|pad|>", "<|mask|>")] == [0, 1, 2]
    assert tok.eos_token_ids == [0]
    text = "def f(x_1):\n        return 'é' + 12345\n"
    assert tok.decode(tok.encode(text)) == text
    data = load_corpus(data_dir)
    assert data.train.dtype == np.uint16 and (data.train == 0).sum() == data.meta["train_files"]
    write_corpus(data_dir, tmp_path, [data_dir.parent / "src"], heldout_fraction=0.25)  # uncompressed
    plain = load_corpus(tmp_path)
    assert (tmp_path / "train.npy").exists() and np.array_equal(plain.train, data.train)


def interrupt_after_saving(monkeypatch, step: int) -> None:
    """Ctrl-C right after the run's state is saved at `step` (a resume starts there)."""
    save = Trainer._save

    def save_then_die(self):
        save(self)
        if self.step == step:
            raise KeyboardInterrupt
    monkeypatch.setattr(Trainer, "_save", save_then_die)


def test_target_loss_decreases_and_resume_continues(target, data_dir, monkeypatch):
    base, summary = target
    losses = _losses(base / "run")
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0]
    assert summary["steps"] == 40 and np.isfinite(summary["eval_ppl"])
    # Through the CLI: a run that dies after its state save at step 20, resumed to step 40,
    # sees the same batches and ends with the same weights.
    args = ["target", "--data", str(data_dir), "--run", str(base / "half"), "--hidden-size", "32",
            "--num-layers", "4", "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "16",
            "--intermediate-size", "64", "--max-steps", "40"] + [f"--{k.replace('_', '-')}={v}"
                                                                 for k, v in OPTS.items()]
    interrupt_after_saving(monkeypatch, 20)
    assert cli_main(args) == 130  # Ctrl-C: the CLI says "interrupted" and exits 130
    monkeypatch.undo()
    assert cli_main(args + ["--resume", "--max-shard-mb", "0.02"]) == 0
    half = json.loads((base / "half" / "summary.json").read_text())
    assert half["steps"] == 40
    assert _losses(base / "half") == losses
    sharded = base / "half" / "model"
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 1
    full, resumed = _tensors(base / "model"), _tensors(sharded)
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)


def test_exported_target_loads_in_treeflash_and_transformers(target):
    base, _ = target
    folder = base / "model"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["tie_word_embeddings"]
    names = set(_tensors(folder))
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.3.mlp.up_proj.weight" in names
    assert "lm_head.weight" not in names and not any("qkv" in n or "gate_up" in n for n in names)
    out = LLM(folder, device="cpu").generate(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    import transformers  # the test extra: the oracle
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                        eos_token_id=None, pad_token_id=tok.pad_token_id)
    assert hf[0, ids.shape[1]:].tolist() == out.token_ids


def test_drafter_trains_exports_and_loads(target, data_dir, tmp_path):
    base, _ = target
    shape = DrafterShape(num_layers=2, block_size=4)
    opts = TrainOptions(max_steps=30, **OPTS)
    summary = train_drafter(base / "model", data_dir, tmp_path / "run", tmp_path / "drafter", shape, opts,
                            blocks_per_seq=6, tau_prompts=2, tau_new_tokens=16)
    losses = _losses(tmp_path / "run")
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0]
    assert summary["tau_dflash"] >= 1 and summary["same_as_ar_dflash"] == summary["same_as_ar_ddtree"] == 1.0
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["num_target_layers"] == 4 and config["dflash_config"]["mask_token_id"] == 2
    assert config["dflash_config"]["target_layer_ids"] == default_target_layer_ids(4, 2)  # the published taps
    assert config["hidden_act"] == "silu" and config["attention_bias"] is False  # as the published configs
    names = set(_tensors(tmp_path / "drafter"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_proj.weight",
            "layers.0.mlp.gate_proj.weight"} <= names and not any(n.startswith("model.") for n in names)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ar = LLM(base / "model", device="cpu").generate(PROMPT, params)[0].token_ids
    spec = LLM(base / "model", draft_model=tmp_path / "drafter", device="cpu").generate(PROMPT, params)[0]
    assert spec.token_ids == ar
    # resume continues the step counter
    more = train_drafter(base / "model", data_dir, tmp_path / "run", tmp_path / "drafter",
                         opts=TrainOptions(max_steps=35, **OPTS), resume=True, blocks_per_seq=6, tau_prompts=0)
    assert more["steps"] == 35


@pytest.mark.parametrize("arch", ["llama-tied", "qwen3-moe", "gpt-oss", "qwen2", "mistral"])
def test_drafter_trains_for_every_target_architecture(arch, data_dir, tmp_path):
    """A drafter for any target treeflash loads: a tied Llama, a Qwen3-MoE, a gpt-oss
    (experts, sinks, a sliding window), a Qwen2 (q/k/v biases, a window in its last
    layers) and a Mistral (a window in every layer) written by transformers with the
    corpus's tokenizer. Trained a few steps, exported and loaded beside its target, it drafts without
    changing a token."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    config, model = {
        "llama-tied": (lambda: transformers.LlamaConfig(**common, tie_word_embeddings=True),
                       transformers.LlamaForCausalLM),
        "qwen3-moe": (lambda: transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                          moe_intermediate_size=32), transformers.Qwen3MoeForCausalLM),
        "gpt-oss": (lambda: transformers.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                                      layer_types=["sliding_attention", "full_attention"] * 2),
                    transformers.GptOssForCausalLM),
        "qwen2": (lambda: transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=8,
                                                   max_window_layers=2), transformers.Qwen2ForCausalLM),
        "mistral": (lambda: transformers.MistralConfig(**common, sliding_window=8), transformers.MistralForCausalLM),
    }[arch]
    torch.manual_seed(0)
    target = tmp_path / "target"
    model(config()).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / name, target / name)
    summary = train_drafter(target, data_dir, tmp_path / "run", tmp_path / "drafter",
                            DrafterShape(num_layers=1, block_size=4), TrainOptions(max_steps=6, **OPTS),
                            blocks_per_seq=4, tau_prompts=1, tau_new_tokens=8)
    assert summary["steps"] == 6 and summary["same_as_ar_dflash"] == summary["same_as_ar_ddtree"] == 1.0
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ar = LLM(target, device="cpu", dtype="float32").generate(PROMPT, params)[0].token_ids
    for method in ("dflash", "ddtree"):
        spec = LLM(target, draft_model=tmp_path / "drafter", method=method, device="cpu", dtype="float32")
        assert spec.generate(PROMPT, params)[0].token_ids == ar


@pytest.mark.parametrize("stored,exported", [(torch.float64, "bfloat16"), (torch.float32, "float32")])
def test_drafter_for_a_target_whose_config_has_no_dtype(target, data_dir, tmp_path, stored, exported):
    """A target without torch_dtype in config.json: the drafter trains against it (in
    float32 at most) and is exported in the target's stored dtype, or bf16 past float32."""
    from safetensors.torch import load_file, save_file
    model = shutil.copytree(target[0] / "model", tmp_path / "model")
    weights = load_file(str(model / "model.safetensors"))
    save_file({k: v.to(stored) for k, v in weights.items()}, str(model / "model.safetensors"))
    config = json.loads((model / "config.json").read_text())
    config.pop("torch_dtype"), config.pop("dtype", None)
    (model / "config.json").write_text(json.dumps(config))
    train_drafter(model, data_dir, tmp_path / "run", tmp_path / "drafter", DrafterShape(num_layers=1, block_size=4),
                  TrainOptions(max_steps=2, **OPTS), tau_prompts=0)
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["torch_dtype"] == exported


def test_training_forward_matches_cached_drafter(target, tmp_path):
    """The dense training pass (many masked blocks) gives the logits of the engine's path:
    context K/V committed once into the drafter cache, then one block forward."""
    from treeflash.checkpoints import write_random_drafter
    from treeflash.layers.attention import AttentionInputs
    from treeflash.models.dflash import DFlashDraftModel
    from treeflash.models.loader import load_weights
    from treeflash.config import DraftConfig
    from treeflash.train.drafter import draft_logits, load_frozen_target
    base, _ = target
    write_random_drafter(base / "model", tmp_path, num_layers=2, block_size=4, mask_token_id=2,
                         target_layer_ids=[1, 2], std=0.1)
    tgt = load_frozen_target(base / "model", torch.device("cpu"))
    drafter = DFlashDraftModel(DraftConfig.from_pretrained(tmp_path))
    load_weights(drafter, tmp_path)
    ids = torch.randint(3, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[5, 17, 9], [1, 20, 12]])
    with torch.no_grad():
        dense, _ = draft_logits(tgt, drafter, ids, anchors)
        for b in range(2):
            for j, a in enumerate(anchors[b].tolist()):
                cache = drafter.new_cache(1, 32)
                pos = torch.arange(a)[None]
                _, feats = tgt(ids[b:b + 1, :a], AttentionInputs.causal(pos), None, drafter.target_layer_ids)
                drafter.commit_context(cache, feats, pos, torch.zeros(1, dtype=torch.long))
                block = torch.tensor([[int(ids[b, a])] + [2] * 3])
                inputs = AttentionInputs(a + torch.arange(4)[None], torch.tensor([a]),
                                         torch.ones(1, 4, 4, dtype=torch.bool))
                cached = tgt.logits(drafter(tgt.embed(block), inputs, cache)[:, 1:])
                torch.testing.assert_close(dense[b, j], cached[0], atol=1e-4, rtol=1e-4)


def test_an_export_replaces_only_its_own_runs(target, data_dir, tmp_path, capsys, monkeypatch):
    """An export into a folder that holds something else (another model) is refused before
    training, not written over; a resumed run re-exports into its own folder; a tokenizer
    or a corpus is not written into a model's folder; a target without tokenizer.json
    cannot be checked against the corpus, so a drafter is not trained for it."""
    base, _ = target
    model = base / "model"
    victim = shutil.copytree(model, tmp_path / "victim")
    files = {f.name: f.read_bytes() for f in victim.iterdir()}
    opts = TrainOptions(max_steps=2, **OPTS)
    with pytest.raises(UsageError, match=r"output folder .*victim is not empty \(config.json, "):
        train_drafter(model, data_dir, tmp_path / "d", victim, DrafterShape(block_size=4), opts, tau_prompts=0)
    with pytest.raises(UsageError, match="is not empty"):
        train_target(data_dir, tmp_path / "t", victim, TINY, opts)
    assert {f.name: f.read_bytes() for f in victim.iterdir()} == files
    assert not (tmp_path / "d" / "state.pt").exists() and not (tmp_path / "t" / "state.pt").exists()
    out = tmp_path / "drafter"
    train_drafter(model, data_dir, tmp_path / "d", out, DrafterShape(block_size=4), opts, tau_prompts=0)
    more = train_drafter(model, data_dir, tmp_path / "d", opts=TrainOptions(max_steps=3), resume=True, tau_prompts=0)
    assert more["steps"] == 3 and json.loads((out / "config.json").read_text())["block_size"] == 4
    exported = {f.name: f.read_bytes() for f in out.iterdir()}

    def interrupted(*args, **kwargs):  # Ctrl-C while the next export writes its weights
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr("treeflash.train.common.save_file", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train_drafter(model, data_dir, tmp_path / "d", opts=TrainOptions(max_steps=4), resume=True, tau_prompts=0)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == exported  # the earlier export, whole
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing half-written
    other = tmp_path / "data2"  # the same tokenizer, other text: the run's stream of batches would change
    write_corpus(data_dir, other, [_corpus_files(tmp_path / "src2", 12)], heldout_fraction=0.25)
    with pytest.raises(UsageError, match="is not the one this run trained on"):
        train_drafter(model, other, tmp_path / "d", opts=TrainOptions(max_steps=4), resume=True, tau_prompts=0)
    with pytest.raises(UsageError, match="is not empty"):  # a fresh run may not replace another run's export
        train_drafter(model, data_dir, tmp_path / "d2", out, DrafterShape(block_size=4), opts, tau_prompts=0)
    for argv in (["tokenizer", "--roots", str(tmp_path), "--out", str(victim)],
                 ["corpus", "--tokenizer", str(data_dir), "--roots", str(tmp_path), "--out", str(victim)]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "holds a model (config.json or weights)" in err and "\n" not in err, err
    assert {f.name: f.read_bytes() for f in victim.iterdir()} == files
    (victim / "tokenizer.json").unlink()
    with pytest.raises(UsageError, match="has no tokenizer.json: the corpus's tokenizer cannot be checked"):
        train_drafter(victim, data_dir, tmp_path / "d3", None, DrafterShape(block_size=4), opts, tau_prompts=0)


def test_drafter_on_generated_continuations(target, data_dir, tmp_path, capsys):
    base, _ = target
    meta = generate_continuations(base / "model", data_dir, tmp_path / "gen", num_prompts=6, prompt_len=8,
                                  new_tokens=24, batch_size=4, device="cpu", heldout_prompts=3)
    with np.load(meta["path"]) as f:
        ids, held = f["ids"], f["heldout_ids"]
        assert ids.shape == (6, 32) and held.shape == (3, 32) and int(f["prompt_len"]) == 8
    # every row is a prompt of its split followed by the target's greedy continuation
    data = load_corpus(data_dir)
    llm = LLM(base / "model", device="cpu")
    for row, split in ((ids[0], data.train), (held[0], data.heldout)):
        prompt = row[:8].tolist()
        assert any(split[s:s + 8].tolist() == prompt for s in range(split.size - 7))
        ar = llm.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0].token_ids
        assert row[8:].tolist() == ar
    assert meta["path"] == str(tmp_path / "gen.npz")  # numpy's name; --generated finds it by the name given
    summary = train_drafter(base / "model", data_dir, tmp_path / "run", None, DrafterShape(block_size=4),
                            TrainOptions(max_steps=5, **OPTS), generated=tmp_path / "gen", blocks_per_seq=30,
                            tau_prompts=0)
    assert summary["steps"] == 5 and np.isfinite(summary["eval_loss"]) and summary["data"] == meta["path"]
    assert summary["heldout_text"] == "generated"  # selected on the text it learns, not the corpus
    out, err = capsys.readouterr()
    assert f"note: --seq-len sets the corpus windows' length; the rows of {meta['path']} are 32 tokens" \
        in err  # OPTS gives a seq_len
    # anchors from the last prompt token (7) to the last block start (28): 22, not the 30 asked for
    assert "note: --blocks-per-seq 30 is more anchors than a sequence of 32 tokens has for blocks of 4: " \
           "22 are drawn" in err and "22 blocks/sequence" in out
    # OPTS warms up for 5 steps: a run of 5 never gets to its learning rate, and says so
    assert "note: the run ended at step 5, within its 5 warmup steps: its learning rate never reached --lr 0.01" \
        in out
    # a corpus without a held-out split: τ takes the prompts of the generated held-out rows
    write_corpus(data_dir, tmp_path / "no-heldout", [data_dir.parent / "src"], heldout_fraction=0)
    tau = train_drafter(base / "model", tmp_path / "no-heldout", tmp_path / "run-tau", None, DrafterShape(block_size=4),
                        TrainOptions(max_steps=2, **OPTS), generated=meta["path"], tau_prompts=2, tau_new_tokens=8)
    assert "tau_error" not in tau and tau["same_as_ar_dflash"] == tau["same_as_ar_ddtree"] == 1.0
    # resumed, it keeps training on them: from the run's path, or from where the file moved
    capsys.readouterr()
    more = train_drafter(base / "model", data_dir, tmp_path / "run", opts=TrainOptions(max_steps=6), resume=True)
    assert more["steps"] == 6 and more["data"] == str(meta["path"]) and more["heldout_text"] == "generated"
    assert "warmup" not in capsys.readouterr().out  # 5 warmup steps of 6: no note
    moved = shutil.copy(meta["path"], tmp_path / "moved.npz")
    more = train_drafter(base / "model", data_dir, tmp_path / "run", opts=TrainOptions(max_steps=7), resume=True,
                         generated=moved)
    assert more["steps"] == 7 and more["data"] == str(moved)
    # but not other continuations: the run's training text would change under it
    other_gen = generate_continuations(base / "model", data_dir, tmp_path / "gen2", num_prompts=4, prompt_len=8,
                                       new_tokens=12, device="cpu", heldout_prompts=0)
    with pytest.raises(UsageError, match="is not the file of generated sequences this run trained on"):
        train_drafter(base / "model", data_dir, tmp_path / "run", opts=TrainOptions(max_steps=8), resume=True,
                      generated=other_gen["path"])
    for missing, what in ((tmp_path / "nowhere.npz", "no such file"), (tmp_path, "a folder")):
        with pytest.raises(UsageError, match=f"--generated .*: {what}; give the .npz file"):
            train_drafter(base / "model", data_dir, tmp_path / "run-missing", None, DrafterShape(block_size=4),
                          TrainOptions(max_steps=1, **OPTS), generated=missing, tau_prompts=0)
    with pytest.raises(UsageError, match="--heldout-prompts must be >= 0"):
        generate_continuations(base / "model", data_dir, tmp_path / "bad", num_prompts=2, heldout_prompts=-1)
    # a count off by a few zeros is refused before the target loads (it took gigabytes, then was killed)
    with pytest.raises(UsageError, match=r"--num-prompts 100000000000 \(and 0 held out\) of 12 tokens take about "
                                         r"[\d,.]+ GiB to hold, more than the [\d,.]+ GiB free on this host"):
        generate_continuations(base / "model", data_dir, tmp_path / "huge", num_prompts=10 ** 11, prompt_len=8,
                               new_tokens=4, heldout_prompts=0)
    # damaged files: refused before training, not an internal error (or a silent run) after it
    context, vocab = (json.loads((base / "model" / "config.json").read_text())[k]
                      for k in ("max_position_embeddings", "vocab_size"))
    with np.load(meta["path"]) as f:
        good = dict(f)
    for damage, what in (({"ids": np.full_like(ids, vocab + 7)}, "'ids' holds token ids outside"),
                         ({"heldout_ids": np.full_like(held, vocab + 7)}, "'heldout_ids' holds token ids outside"),
                         ({"prompt_len": np.array([1, 2])}, "'prompt_len' must be one integer"),
                         ({"prompt_len": np.array(-5)}, "'prompt_len' must be one integer"),
                         ({"heldout_ids": held[:, :10]}, "'heldout_ids' must be a 2-D array"),
                         ({"heldout_ids": held[0]}, "'heldout_ids' must be a 2-D array"),
                         ({"ids": np.zeros((2, context + 1), ids.dtype), "heldout_ids": np.zeros((1, context + 1),
                                                                                    ids.dtype)},
                          "exceed the target's context")):
        np.savez(tmp_path / "damaged.npz", **{**good, **damage})
        with pytest.raises(UsageError, match=what):
            train_drafter(base / "model", data_dir, tmp_path / "run-damaged", None, DrafterShape(block_size=4),
                          TrainOptions(max_steps=1, **OPTS), generated=tmp_path / "damaged.npz", tau_prompts=0)
    # another target (its config differs) may not train on these continuations
    other = shutil.copytree(base / "model", tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    with pytest.raises(UsageError, match="generated by another target"):
        train_drafter(other, data_dir, tmp_path / "run-other", None, DrafterShape(block_size=4),
                      TrainOptions(max_steps=1, **OPTS), generated=meta["path"], tau_prompts=0)
    assert (tmp_path / "run" / "model" / "config.json").exists()


def test_bad_inputs(target, data_dir, tmp_path, capsys):
    base, _ = target
    opts = TrainOptions(max_steps=1, **OPTS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TreeflashError, match="empty corpus"):
        collect([tmp_path / "empty"])
    with pytest.raises(UsageError, match="not a folder"):
        collect([tmp_path / "nowhere"])
    with pytest.raises(UsageError, match="vocab size"):
        train_tokenizer(["x = 1\n"], tmp_path / "tok", vocab_size=100)
    with pytest.raises(UsageError, match="no tokenized corpus"):
        load_corpus(tmp_path / "empty")
    with pytest.raises(UsageError, match="training budget"):
        TrainOptions().validate()
    with pytest.raises(UsageError, match="--max-steps must be an integer >= 1"):  # untrained weights, exported
        TrainOptions(**{**OPTS, "max_steps": 0}).validate()
    with pytest.raises(UsageError, match="--seq-len must be >= 2"):  # a model that can take no prompt
        TrainOptions(**{**OPTS, "max_steps": 1, "seq_len": 1}).validate()
    # a batch whose logits cannot fit was killed by the OS after minutes: refused first
    big = TrainOptions(**{**OPTS, "max_steps": 1, "batch_size": 10 ** 9})
    with pytest.raises(UsageError, match=r"--batch-size 1000000000 x --seq-len 32 computes .* logits a step"):
        train_target(data_dir, tmp_path / "run-big", shape=TINY, opts=big)
    with pytest.raises(UsageError, match=r"--batch-size 1000000000 x --blocks-per-seq .* logits a step"):
        train_drafter(base / "model", data_dir, tmp_path / "run-big-d", opts=big, tau_prompts=0)
    with pytest.raises(UsageError, match="target checkpoint not found"):
        train_drafter(tmp_path / "no-target", data_dir, tmp_path / "run", opts=opts)
    with pytest.raises(UsageError, match="--block-size must be an integer >= 2, got 1"):
        train_drafter(base / "model", data_dir, tmp_path / "run", shape=DrafterShape(block_size=1), opts=opts)
    with pytest.raises(UsageError, match="--num-layers must be a positive integer, got 0"):
        train_drafter(base / "model", data_dir, tmp_path / "run", shape=DrafterShape(num_layers=0), opts=opts)
    # a target shape is refused in the words of the options that set it (not config.json's keys)
    for shape, words in ((TargetShape(num_layers=0), "--num-layers must be a positive integer, got 0"),
                         (TargetShape(num_heads=6, num_kv_heads=4), "--num-heads 6 is not a multiple of --num-kv-heads 4"),
                         (TargetShape(head_dim=3), "--head-dim 3 is odd"),
                         (TargetShape(rope_theta=math.inf), "--rope-theta must be a finite number > 0, got inf")):
        with pytest.raises(UsageError, match=words):
            train_target(data_dir, tmp_path / "run-shape", shape=shape, opts=opts)
        assert not (tmp_path / "run-shape" / "state.pt").exists()
    with pytest.raises(UsageError, match="already holds a training run"):
        train_target(data_dir, base / "run", shape=TINY, opts=opts)
    with pytest.raises(UsageError, match="no training state"):
        train_target(data_dir, tmp_path / "fresh", shape=TINY, opts=opts, resume=True)
    with pytest.raises(UsageError, match="differs from the run"):
        train_target(data_dir, base / "run", shape=TargetShape(hidden_size=64), opts=opts, resume=True)
    other = write_random_target(tmp_path / "other-tokenizer", vocab_size=None)
    with pytest.raises(UsageError, match="another tokenizer"):
        train_drafter(other, data_dir, tmp_path / "run-other", opts=opts)
    with pytest.raises(UsageError, match="another tokenizer"):
        generate_continuations(other, data_dir, tmp_path / "gen.npz", num_prompts=1, prompt_len=8, new_tokens=4)
    with pytest.raises(UsageError, match="--tau-prompts"):
        train_drafter(base / "model", data_dir, tmp_path / "run-tau", opts=opts, tau_prompts=-1)
    damaged = tmp_path / "bad-state"
    damaged.mkdir()
    shutil.copy(base / "run" / "run.json", damaged)
    (damaged / "state.pt").write_bytes(b"not a state" * 10)
    with pytest.raises(TreeflashError, match="damaged, or not a treeflash training state") as e:
        train_target(data_dir, damaged, shape=TINY, opts=opts, resume=True)
    assert "\n" not in str(e.value) and "weights_only" not in str(e.value)
    state = torch.load(base / "run" / "state.pt", weights_only=True)
    for what, damage in (("not a treeflash training state", torch.zeros(3)),
                         ("missing: step", {k: v for k, v in state.items() if k != "step"}),
                         ("damaged random-number state", {**state, "gen": torch.zeros(3, dtype=torch.uint8)})):
        torch.save(damage, damaged / "state.pt")   # files torch reads: internal errors before
        with pytest.raises(TreeflashError, match=what) as e:
            train_target(data_dir, damaged, shape=TINY, opts=opts, resume=True)
        assert "\n" not in str(e.value)
    # values of the wrong type; an elapsed time of NaN never reached a --max-minutes budget (it trained on)
    for field, value in (("step", "five"), ("history", None), ("elapsed", float("nan")), ("elapsed", -5.0)):
        torch.save({**state, field: value}, damaged / "state.pt")
        with pytest.raises(TreeflashError, match="is damaged: its step, elapsed time or loss history"):
            train_target(data_dir, damaged, shape=TINY, opts=opts, resume=True)
    for metrics in ({}, None, {"eval_loss": "low"}, {"eval_loss": 1.0}):  # a KeyError at the end of the run, before
        torch.save({**state, "best_model": {"w": torch.zeros(1)}, "best_metrics": metrics}, damaged / "state.pt")
        with pytest.raises(TreeflashError, match="is damaged: its best model's metrics"):
            train_target(data_dir, damaged, shape=TINY, opts=opts, resume=True)
    for field, value in (("loss_sum", "1.5"), ("loss_steps", -1)):
        torch.save({**state, field: value}, damaged / "state.pt")
        with pytest.raises(TreeflashError, match="is damaged: its pending loss"):
            train_target(data_dir, damaged, shape=TINY, opts=opts, resume=True)
    torch.save(state, damaged / "state.pt")
    spec = json.loads((base / "run" / "run.json").read_text())
    for change, what in (({"lr": "abc"}, "lr must be a number, got 'abc'"),
                         ({"out": 7}, "run.json is damaged: its options")):
        (damaged / "run.json").write_text(json.dumps({**spec, "options": {**spec["options"], **change}}))
        with pytest.raises(TreeflashError, match=what):
            train_target(data_dir, damaged, shape=TINY, opts=TrainOptions(max_steps=50), resume=True)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UsageError, match="not a folder"):
        train_target(data_dir, tmp_path / "run-file", tmp_path / "a-file", TINY, opts)
    # an empty --out was the current folder (a tokenizer written there, an export renamed over it)
    for argv in (["tokenizer", "--out", "", "--roots", str(data_dir.parent / "src")],
                 ["corpus", "--tokenizer", str(data_dir), "--out", "", "--roots", str(data_dir.parent / "src")]):
        assert cli_main(argv) == 2
        assert capsys.readouterr().err.strip() == "treeflash: error: --out is empty: give a path"
    with pytest.raises(UsageError, match="--out is empty"):
        train_target(data_dir, tmp_path / "run-empty-out", "", TINY, opts)
    with pytest.raises(UsageError, match="--generated is empty"):  # (it was the current folder)
        train_drafter(base / "model", data_dir, tmp_path / "run-empty-gen", opts=opts, generated="")
    assert cli_main(["drafter", "--target", str(tmp_path / "no-target"), "--data", str(data_dir),
                     "--run", str(tmp_path / "r"), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treeflash: error: target checkpoint not found") and "\n" not in err
    drafter = builtin_paths()[1]  # a drafter given for the target: said so, in train's own words
    for command, given in (("drafter", ["--run", str(tmp_path / "r"), "--max-steps", "1"]),
                           ("generate", ["--out", str(tmp_path / "g.npz"), "--num-prompts", "2"])):
        assert cli_main([command, "--target", str(drafter), "--data", str(data_dir), *given]) == 2, command
        assert capsys.readouterr().err.strip() == \
            f"treeflash: error: --target {drafter} is a DFlash drafter: give the target model the drafter is for"


def test_bad_data_files_are_one_line_errors(target, data_dir, tmp_path, capsys):
    base, _ = target
    opts = TrainOptions(max_steps=1, **OPTS)
    np.save(tmp_path / "gen.npy", np.zeros((4, 40), dtype=np.uint16))  # an array, not generate's .npz
    with pytest.raises(UsageError, match=r"cannot read generated sequences .*gen\.npy: not an \.npz"):
        train_drafter(base / "model", data_dir, tmp_path / "run", None, DrafterShape(block_size=4), opts,
                      generated=tmp_path / "gen.npy", tau_prompts=0)
    assert cli_main(["drafter", "--target", str(base / "model"), "--data", str(data_dir), "--run",
                     str(tmp_path / "run"), "--generated", str(tmp_path / "gen.npy"), "--max-steps", "1",
                     "--block-size", "4", "--tau-prompts", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treeflash: error: cannot read generated sequences") and "\n" not in err
    broken = shutil.copytree(data_dir, tmp_path / "broken")
    (broken / "train.npz").unlink()
    (broken / "train.npy").write_bytes(b"")                              # 0 bytes
    with pytest.raises(TreeflashError, match=r"cannot read .*train\.npy: empty file"):
        load_corpus(broken)
    np.save(broken / "train.npy", np.full(100, 320, dtype=np.uint16))   # ids outside the vocabulary of 320
    with pytest.raises(TreeflashError, match="outside its vocabulary of 320"):
        load_corpus(broken)
    with pytest.raises(UsageError, match="exceeds the target's context of 32"):  # the target saw 32 positions
        train_drafter(base / "model", data_dir, tmp_path / "run", None, DrafterShape(block_size=4),
                      TrainOptions(max_steps=1, **{**OPTS, "seq_len": 64}), tau_prompts=0)


def test_out_folder_refused_before_training(target, data_dir, tmp_path):
    """An export over an input (the target, the corpus) or the run would destroy it; an
    unwritable one would only fail once training is over."""
    base, _ = target
    model = base / "model"
    files = {f.name: f.read_bytes() for f in model.iterdir()}
    opts, run = TrainOptions(max_steps=1, **OPTS), tmp_path / "run"
    for out, what in ((model, "is the target folder"), (model / "sub", "is inside the target folder"),
                      (base, "holds the target folder"), (data_dir, "is the data folder")):
        with pytest.raises(UsageError, match=what):
            train_drafter(model, data_dir, run, out, DrafterShape(block_size=4), opts, tau_prompts=0)
    with pytest.raises(UsageError, match="is the data folder"):
        train_target(data_dir, run, data_dir, TINY, opts)
    with pytest.raises(UsageError, match="is the run folder"):
        train_target(data_dir, run, run, TINY, opts)
    if os.geteuid() == 0:  # root may write in any folder, but not in /proc
        unwritable = Path("/proc/treeflash-test-out")
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        unwritable = tmp_path / "ro" / "out"
    with pytest.raises(UsageError, match="cannot write in"):
        train_target(data_dir, run, unwritable, TINY, opts)
    # so is a run folder that cannot be made (it failed with the OS's words once the inputs were read)
    with pytest.raises(UsageError, match=f"run folder {unwritable / 'run'}: cannot write in"):
        train_target(data_dir, unwritable / "run", tmp_path / "out", TINY, opts)
    assert {f.name: f.read_bytes() for f in model.iterdir()} == files
    assert not (run / "state.pt").exists() and not (data_dir / "config.json").exists()


def test_special_token_text_in_sources_is_plain_text(data_dir, tmp_path):
    """A source that spells a special token ("<|endoftext|>" in a tokenizer's code) gets
    no EOS / PAD / MASK id: EOS only ends files."""
    from treeflash.tokenizer import Tokenizer
    src = tmp_path / "src"
    src.mkdir()
    texts = ['EOS = "<|endoftext|>"\nPAD, MASK = "<|pad|>", "<|mask|>"\n', "x = 1\n"]
    for i, text in enumerate(texts):
        (src / f"m{i}.py").write_text(text)
    write_corpus(data_dir, tmp_path / "data", [src], heldout_fraction=0)
    ids = load_corpus(tmp_path / "data").train
    assert (ids == 0).sum() == 2 and ids[-1] == 0 and not np.isin(ids, [1, 2]).any()
    tok = Tokenizer(data_dir).tok
    ends = np.flatnonzero(ids == 0)
    assert {tok.decode(ids[a + 1:b].tolist()) for a, b in zip([-1, ends[0]], ends)} == set(texts)
    assert tok.encode("<|mask|>", add_special_tokens=False).ids == [2]  # the tokenizer itself is unchanged


def test_corpora_and_runs_stay_tied_to_their_tokenizer_and_target(target, data_dir, tmp_path, capsys):
    """Token ids mean text only under the tokenizer that made them, and a drafter fits one
    target: a corpus whose tokenizer.json was replaced, a run resumed on another corpus
    or against another target of the same shape, and continuations of another target
    are refused (each once trained on silently, and exported with the wrong tokenizer)."""
    base, _ = target
    corpus = tmp_path / "data"
    shutil.copytree(data_dir, corpus)
    # a new tokenizer written into a corpus folder (TRAINING.md's flow, run again)
    assert cli_main(["tokenizer", "--out", str(corpus), "--roots", str(data_dir.parent / "src"),
                     "--vocab-size", "300"]) == 0
    with pytest.raises(TreeflashError, match="not the one its ids were made with"):
        load_corpus(corpus)
    meta = json.loads((corpus / "corpus.json").read_text())
    del meta["tokenizer_sha256"]   # a corpus from before the hash: a new tokenizer there is refused
    (corpus / "corpus.json").write_text(json.dumps(meta))
    assert cli_main(["tokenizer", "--out", str(corpus), "--roots", str(data_dir.parent / "src"),
                     "--vocab-size", "300"]) == 2
    assert "does not record its tokenizer" in capsys.readouterr().err
    other = write_random_target(tmp_path / "other-tokenizer", vocab_size=None)
    shutil.copy(other / "tokenizer.json", corpus / "tokenizer.json")
    shutil.copy(data_dir / "corpus.json", corpus / "corpus.json")
    with pytest.raises(TreeflashError, match="not the one its ids were made with"):
        load_corpus(corpus)
    (corpus / "tokenizer.json").unlink()
    with pytest.raises(TreeflashError, match="no tokenizer.json"):
        load_corpus(corpus)

    def resumed_with(run, key):  # a copy of a run that recorded another corpus tokenizer / target
        spec = json.loads((run / "run.json").read_text())
        assert len(spec[key]) == 16
        spec[key] = "0" * 16
        (run / "run.json").write_text(json.dumps(spec))
        return run

    run = resumed_with(shutil.copytree(base / "run", tmp_path / "run"), "corpus_tokenizer")
    with pytest.raises(UsageError, match="--resume: the corpus .* another tokenizer than the run's"):
        train_target(data_dir, run, opts=TrainOptions(max_steps=50), resume=True)

    # the same shape and tokenizer, other weights: another target
    changed = shutil.copytree(base / "model", tmp_path / "changed")
    (weights,) = changed.glob("*.safetensors")
    from safetensors.torch import load_file, save_file
    save_file({k: v * 1.5 for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    same = shutil.copytree(base / "model", tmp_path / "same")
    assert target_fingerprint(same) == target_fingerprint(base / "model") != target_fingerprint(changed)
    gen = tmp_path / "gen.npz"
    generate_continuations(changed, data_dir, gen, num_prompts=2, prompt_len=8, new_tokens=4, heldout_prompts=0,
                           device="cpu")
    opts = TrainOptions(max_steps=1, **OPTS)
    with pytest.raises(UsageError, match="generated by another target"):
        train_drafter(base / "model", data_dir, tmp_path / "run-gen", shape=DrafterShape(block_size=4), opts=opts,
                      generated=gen, tau_prompts=0)
    with np.load(gen) as f:   # a file written before fingerprints covered the weights is still taken
        old = {**f, "target": np.str_(target_fingerprint(base / "model", weights=False))}
    np.savez(tmp_path / "old.npz", **old)
    train_drafter(base / "model", data_dir, tmp_path / "run-old", shape=DrafterShape(block_size=4), opts=opts,
                  generated=tmp_path / "old.npz", tau_prompts=0)
    train_drafter(base / "model", data_dir, tmp_path / "run-d", tmp_path / "drafter", DrafterShape(block_size=4),
                  opts, tau_prompts=0)
    with pytest.raises(UsageError, match="--resume: .* is not the target this run trained against"):
        train_drafter(changed, data_dir, tmp_path / "run-d", opts=TrainOptions(max_steps=2), resume=True)
    # a target of another depth is another target too (its depth is no flag to leave out)
    deeper = shutil.copytree(tmp_path / "run-d", tmp_path / "run-deeper")
    spec = json.loads((deeper / "run.json").read_text())
    (deeper / "run.json").write_text(json.dumps({**spec, "target_layers": spec["target_layers"] + 2}))
    with pytest.raises(UsageError, match=rf"--resume: .* is not the target this run trained against \(target "
                                         rf"layers {spec['target_layers']}, the run's {spec['target_layers'] + 2}\)$"):
        train_drafter(base / "model", data_dir, deeper, opts=TrainOptions(max_steps=2), resume=True)
    run = resumed_with(tmp_path / "run-d", "corpus_tokenizer")
    with pytest.raises(UsageError, match="--resume: the corpus .* another tokenizer than the run's"):
        train_drafter(base / "model", data_dir, run, opts=TrainOptions(max_steps=2), resume=True)


def test_more_bad_training_input_is_one_line(data_dir, target, tmp_path, capsys):
    base, _ = target
    # a drafter shape its target cannot feed is a usage error, refused before the run folder is written
    for flags, what in ((["--target-layer-ids", "2,2"], "target_layer_ids"),
                        (["--target-layer-ids", "1,9"], "taps target layers [9]"),
                        (["--mask-token-id", "99999"], "mask_token_id")):
        run = tmp_path / f"bad-{len(list(tmp_path.iterdir()))}"
        assert cli_main(["drafter", "--target", str(base / "model"), "--data", str(data_dir), "--run", str(run),
                         "--block-size", "4", "--max-steps", "1", "--tau-prompts", "0", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("treeflash: error: ") and what in err and "\n" not in err, err
        assert not (run / "run.json").exists()
    eos = json.loads((base / "model" / "config.json").read_text())["eos_token_id"]  # the target generates it
    assert cli_main(["drafter", "--target", str(base / "model"), "--data", str(data_dir), "--run",
                     str(tmp_path / "eos-mask"), "--block-size", "4", "--max-steps", "1", "--tau-prompts", "0",
                     "--batch-size", "2", "--seq-len", "32", "--eval-tokens", "256", "--device", "cpu",
                     "--mask-token-id", str(eos)]) == 0
    assert f"note: mask token id {eos} is the target's end of text" in capsys.readouterr().err
    common = np.bincount(load_corpus(data_dir).train).argmax()  # an ordinary token: "    " or so
    assert cli_main(["drafter", "--target", str(base / "model"), "--data", str(data_dir), "--run",
                     str(tmp_path / "text-mask"), "--block-size", "4", "--max-steps", "1", "--tau-prompts", "0",
                     "--batch-size", "2", "--seq-len", "32", "--eval-tokens", "256", "--device", "cpu",
                     "--mask-token-id", str(common)]) == 0
    assert f"note: mask token id {common} is in the corpus's text" in capsys.readouterr().err
    # windows one token past a block: enough to train on, too short for the held-out blocks (at position 1)
    assert cli_main(["drafter", "--target", str(base / "model"), "--data", str(data_dir), "--run",
                     str(tmp_path / "short"), "--block-size", "4", "--max-steps", "1", "--tau-prompts", "0",
                     "--seq-len", "5", "--device", "cpu"]) == 2
    assert "--seq-len 5 is too short for the held-out windows' blocks of 4 (needs >= 6)" in capsys.readouterr().err
    src = data_dir.parent / "src"
    # an output inside a corpus root whose suffixes match what is written would be read back
    assert cli_main(["tokenizer", "--out", str(src / "tok"), "--roots", str(src), "--vocab-size", "300",
                     "--suffixes", ".py", ".json"]) == 2
    assert "is inside the corpus root" in capsys.readouterr().err
    with pytest.raises(UsageError, match="is inside the corpus root"):
        write_corpus(data_dir, src / "data", [src], suffixes=(".json",))
    inside = tmp_path / "proj"   # with .py only, nothing written there is read back: allowed
    shutil.copytree(src, inside)
    write_corpus(data_dir, inside / "data", [inside])
    assert collect([inside]).stats["files_seen"] == collect([src]).stats["files_seen"]
    # a FIFO named like a source file is skipped, not read (the read blocked forever)
    fifo_root = tmp_path / "fifo"
    shutil.copytree(src, fifo_root)
    os.mkfifo(fifo_root / "pipe.py")
    assert collect([fifo_root]).stats["files_seen"] == collect([src]).stats["files_seen"]
    # numbers that pass a "not below zero" check: NaN and infinities
    for bad, what in ((dict(lr=float("inf")), "--lr must be a finite number"),
                      (dict(weight_decay=float("nan")), "--weight-decay"),
                      (dict(grad_clip=float("inf")), "--grad-clip"), (dict(max_minutes=float("inf")), "--max-minutes"),
                      (dict(seed=2 ** 70), "seed"), (dict(seed=-1), "seed")):
        with pytest.raises(UsageError, match=what):
            TrainOptions.of({**DEFAULT_OPTIONS, **OPTS, "max_steps": 1, **bad}).validate()
    assert cli_main(["tokenizer", "--out", str(tmp_path / "t"), "--roots", str(src), "--max-bytes", "inf"]) == 2
    assert "not a size" in capsys.readouterr().err
    for mb in (0, -1, float("nan")):   # was found out only at the export, after training
        with pytest.raises(UsageError, match="--max-shard-mb"):
            train_target(data_dir, tmp_path / f"run{mb}", shape=TINY, opts=TrainOptions(max_steps=1, **OPTS),
                         max_shard_mb=mb)
    # generate's output: checked before generating, never inside the corpus it reads
    for out, what in ((data_dir / "train.npz", "inside the corpus folder"),
                      (tmp_path / "a-file" / "x.npz", "is not a folder")):
        (tmp_path / "a-file").write_text("x")
        with pytest.raises(UsageError, match=what):
            generate_continuations(base / "model", data_dir, out, num_prompts=1, prompt_len=8, new_tokens=4)
    with pytest.raises(UsageError, match="seed"):
        generate_continuations(base / "model", data_dir, tmp_path / "g.npz", num_prompts=1, prompt_len=8,
                               new_tokens=4, seed=-1)
    from dataclasses import replace
    with pytest.raises(TreeflashError, match="--head-dim 15 is odd"):
        train_target(data_dir, tmp_path / "run-odd", shape=replace(TINY, head_dim=15),
                     opts=TrainOptions(max_steps=1, **OPTS))
    with pytest.raises(TreeflashError, match="went to the held-out split"):
        collect([src], heldout_fraction=0.999)
    with pytest.raises(TreeflashError, match="max_bytes 10 was reached after 0 held-out document"):
        collect([src], max_bytes=10)
    with pytest.raises(UsageError, match="exists and is not a folder"):
        train_target(data_dir, tmp_path / "a-file", shape=TINY, opts=TrainOptions(max_steps=1, **OPTS))
    legacy = shutil.copytree(base / "run", tmp_path / "legacy")
    spec = json.loads((legacy / "run.json").read_text())
    del spec["options"]   # a run.json from before runs recorded their options still resumes
    (legacy / "run.json").write_text(json.dumps(spec))
    assert train_target(data_dir, legacy, tmp_path / "legacy-model", opts=TrainOptions(
        **{**OPTS, "max_steps": 41}), resume=True)["steps"] == 41
    run = shutil.copytree(base / "run", tmp_path / "listed")
    (run / "run.json").write_text("[1]")
    with pytest.raises(TreeflashError, match="is damaged"):
        train_target(data_dir, run, opts=TrainOptions(max_steps=50), resume=True)
    capsys.readouterr()
    assert cli_main(["corpus", "--tokenizer", str(data_dir), "--out", str(tmp_path / "c0"), "--roots", str(src),
                     "--heldout-fraction", "0"]) == 0
    assert "note: the held-out split is empty" in capsys.readouterr().err
    broken = tmp_path / "novocab"
    shutil.copytree(data_dir, broken)
    (broken / "corpus.json").write_text("{}")
    with pytest.raises(TreeflashError, match="'vocab_size' must be"):
        load_corpus(broken)


def test_sizes_off_by_zeros_and_diverged_runs_are_refused(target, data_dir, tmp_path, capsys):
    """Found by a bad-input sweep: a vocabulary size that aborted the BPE trainer (after
    reading the whole corpus), shapes that allocated until the OS stepped in, a learning
    rate that diverged into NaN weights exported with exit code 0, and a few misleading
    messages."""
    from dataclasses import replace

    from treeflash.tokenizer import Tokenizer
    base, _ = target
    src = data_dir.parent / "src"
    # checked before the roots are read (they do not even exist here)
    assert cli_main(["tokenizer", "--out", str(tmp_path / "t"), "--roots", str(tmp_path / "nowhere"),
                     "--vocab-size", str(10 ** 11)]) == 2
    err = capsys.readouterr().err
    assert "vocab size must be an integer from 259" in err and "\n" not in err.strip()
    opts = TrainOptions(max_steps=1, **OPTS)
    for shape in (replace(TINY, hidden_size=10 ** 9), replace(TINY, num_layers=10 ** 6)):
        with pytest.raises(UsageError, match="training them takes about .* GiB .* free on cpu"):
            train_target(data_dir, tmp_path / "run-huge", shape=shape, opts=opts)
    with pytest.raises(UsageError, match="training them takes about"):
        train_drafter(base / "model", data_dir, tmp_path / "run-dhuge", shape=DrafterShape(num_layers=10 ** 6),
                      opts=opts, tau_prompts=0)
    # diverged: refused, nothing exported
    with pytest.raises(TreeflashError, match="became nan"):
        train_target(data_dir, tmp_path / "run-nan", tmp_path / "model-nan", TINY,
                     TrainOptions(**{**OPTS, "max_steps": 2, "lr": 1e30, "warmup_steps": 1}))
    assert not list(tmp_path.glob("model-nan/*.safetensors"))
    # generate's --out naming an existing folder was written beside it as <folder>.npz
    with pytest.raises(UsageError, match="is a folder: give a file name"):
        generate_continuations(base / "model", data_dir, tmp_path, num_prompts=1, prompt_len=8, new_tokens=4)
    with pytest.raises(TreeflashError, match="is a file: give the folder that holds tokenizer.json"):
        Tokenizer(data_dir / "tokenizer.json")
    # resuming on a corpus of another tokenizer (another vocabulary) names the tokenizer,
    # not vocab_size, which the user never passed
    assert cli_main(["tokenizer", "--out", str(tmp_path / "tok300"), "--roots", str(src), "--vocab-size",
                     "300"]) == 0
    assert cli_main(["corpus", "--tokenizer", str(tmp_path / "tok300"), "--out", str(tmp_path / "data300"),
                     "--roots", str(src)]) == 0
    run = shutil.copytree(base / "run", tmp_path / "run-other-corpus")
    with pytest.raises(UsageError, match="--resume: the corpus .* another tokenizer than the run's"):
        train_target(tmp_path / "data300", run, opts=TrainOptions(max_steps=50), resume=True)


def test_tf32_is_for_training_only():
    """Training on a GPU multiplies float32 in TF32; inference after it in the same
    process (the drafter's τ, a notebook) gets float32 back, even if training failed."""
    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    before = flags()
    with pytest.raises(RuntimeError):
        with tf32_products(torch.device("cuda")):
            assert flags() == (True, True)
            raise RuntimeError("a step failed")
    assert flags() == before
    with tf32_products(torch.device("cpu")):
        assert flags() == before


# ----------------------------------------------------------------------------- corpus split (cases a mutation review found untested)

def test_the_split_is_the_same_wherever_the_corpus_lies(tmp_path):
    """The held-out split hashes each file's path relative to its root: a corpus copied
    to another folder (machine) splits alike."""
    from treeflash.train.corpus import collect
    a = tmp_path / "a" / "src"
    a.mkdir(parents=True)
    for i in range(60):
        (a / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    b = tmp_path / "elsewhere" / "deeper" / "src"
    shutil.copytree(a, b)
    ca, cb = collect([a], heldout_fraction=0.3), collect([b], heldout_fraction=0.3)
    assert ca.heldout and ca.heldout == cb.heldout and ca.train == cb.train


def test_held_out_windows_spread_over_the_whole_split():
    from treeflash.train.corpus import fixed_windows
    w = fixed_windows(np.arange(1000), 10, 50)
    assert w.shape == (5, 10) and int(w[0, 0]) == 0 and int(w[-1, -1]) == 999


# ----------------------------------------------------------------------------- drafter loss and metrics (cases a mutation review found untested)

def test_blocks_hold_the_anchor_then_masks_and_label_the_next_tokens():
    """Slot k of a block anchored at a is labelled x_{a+k} (same position, no shift), the
    block sees the context before its anchor and its own block, never another block."""
    from treeflash.train.drafter import make_blocks
    ids = torch.arange(100, 120).reshape(2, 10)
    anchors = torch.tensor([[1, 5], [3, 6]])
    block, pos, labels, mask = make_blocks(ids, anchors, 3, mask_id=2)
    assert block.tolist() == [[101, 2, 2, 105, 2, 2], [113, 2, 2, 116, 2, 2]]
    assert pos.tolist() == [[1, 2, 3, 5, 6, 7], [3, 4, 5, 6, 7, 8]]
    assert labels.tolist() == [[[102, 103], [106, 107]], [[114, 115], [117, 118]]]
    assert mask.shape == (2, 6, 10 + 6)
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            for row in range(3 * j, 3 * j + 3):
                assert mask[b, row, :10].tolist() == [p < a for p in range(10)]
                assert mask[b, row, 10:].tolist() == [3 * j <= c < 3 * j + 3 for c in range(6)]


def test_anchors_are_distinct_positions_from_lo_to_hi():
    from treeflash.train.drafter import sample_anchors
    gen = torch.Generator().manual_seed(0)
    every = sample_anchors(16, 3, 9, 7, gen)  # as many anchors as positions: each once
    assert all(sorted(row) == list(range(3, 10)) for row in every.tolist())
    some = sample_anchors(200, 3, 9, 2, gen)
    assert int(some.min()) == 3 and int(some.max()) == 9 and all(a != b for a, b in some.tolist())


def test_slots_are_weighted_by_depth_and_the_loss_is_their_weighted_mean():
    """exp(-(k-1)/gamma) for slot k: the first slot counts most; the loss is a weighted
    mean per block (log V for a drafter that knows nothing, whatever the weights)."""
    from treeflash.train.drafter import slot_weights, weighted_ce
    w = slot_weights(4, 2.0, "cpu")
    torch.testing.assert_close(w, torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 2.0))
    labels = torch.randint(0, 10, (2, 3, 3), generator=torch.Generator().manual_seed(0))
    assert weighted_ce(torch.zeros(2, 3, 3, 10), labels, w).item() == pytest.approx(math.log(10), rel=1e-6)


def test_held_out_metrics_count_per_slot_accuracy_and_leading_runs(monkeypatch):
    """acc1 is the first slot's accuracy; tau_est is 1 + the run of leading correct slots
    (a hit after a miss is never committed), not 1 + every hit."""
    import treeflash.train.drafter as drafter_module
    from types import SimpleNamespace

    def scripted(target, drafter, ids, anchors):  # 4 slots: hit, miss, hit, miss
        B, n = anchors.shape
        labels = torch.zeros(B, n, 4, dtype=torch.long)
        logits = torch.zeros(B, n, 4, 5)
        logits[:, :, [0, 2], 0] = 5.0
        logits[:, :, [1, 3], 1] = 5.0
        return logits, labels
    monkeypatch.setattr(drafter_module, "draft_logits", scripted)
    weights = drafter_module.slot_weights(5, 7.0, "cpu")
    got = drafter_module.evaluate_drafter(None, SimpleNamespace(block_size=5), torch.zeros(4, 12, dtype=torch.long),
                                          3, 2, weights, torch.device("cpu"))
    assert (got["acc1"], got["acc_mean"], got["tau_est"]) == (1.0, 0.5, 2.0)


def test_each_slots_loss_is_weighted_by_its_own_depth():
    """Slot k's cross-entropy gets slot k's weight (not another slot's): the weighted mean
    of the per-slot mean cross-entropies."""
    from treeflash.train.drafter import slot_weights, weighted_ce
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 3, 4, 10, generator=gen) * 3, torch.randint(0, 10, (2, 3, 4), generator=gen)
    w = slot_weights(5, 2.0, "cpu")
    per_slot = [F.cross_entropy(logits[:, :, k].reshape(-1, 10), labels[:, :, k].reshape(-1)) for k in range(4)]
    want = sum(wk * ce for wk, ce in zip(w, per_slot)) / w.sum()
    torch.testing.assert_close(weighted_ce(logits, labels, w), want)


def test_held_out_blocks_are_every_anchor_from_lo_the_same_each_time(monkeypatch):
    """With more blocks asked than a window has anchors, every anchor lo..S-b is evaluated;
    the anchors are the same at every evaluation (comparable losses), and eval_loss is the
    weighted loss of all blocks, not of a batch."""
    import treeflash.train.drafter as drafter_module
    from types import SimpleNamespace
    calls = []
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 6 * 4, 5, generator=gen)  # per window row: its blocks' fixed logits

    def scripted(target, drafter, ids, anchors):
        calls.append(anchors.clone())
        B, n = anchors.shape
        return logits[ids[:, 0]].view(B, n, 4, 5), torch.zeros(B, n, 4, dtype=torch.long)
    monkeypatch.setattr(drafter_module, "draft_logits", scripted)
    weights = drafter_module.slot_weights(5, 7.0, "cpu")
    windows = torch.arange(5)[:, None].expand(5, 12)  # window i's logits are logits[i]
    first = drafter_module.evaluate_drafter(None, SimpleNamespace(block_size=5), windows, 100, 2, weights,
                                            torch.device("cpu"), lo=2)
    anchors = torch.cat(calls)
    assert all(sorted(row) == list(range(2, 12 - 5 + 1)) for row in anchors.tolist())
    calls.clear()
    assert drafter_module.evaluate_drafter(None, SimpleNamespace(block_size=5), windows, 100, 2, weights,
                                           torch.device("cpu"), lo=2) == first
    assert torch.equal(torch.cat(calls), anchors)
    want = drafter_module.weighted_ce(logits[:5].view(5, 6, 4, 5), torch.zeros(5, 6, 4, dtype=torch.long), weights)
    assert first["eval_loss"] == pytest.approx(want.item(), abs=1e-5)


def test_tau_is_tokens_per_round_and_lossless_is_the_share_equal_to_ar(monkeypatch):
    """measure_tau: τ = committed tokens / verification rounds over all prompts; same_as_ar
    = the share of outputs identical to plain AR decoding."""
    import treeflash
    from types import SimpleNamespace
    from treeflash.train.drafter import measure_tau
    ar = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
    scripted = {"ar": [(ar[0], 4), (ar[1], 6)], "dflash": [(ar[0], 2), (ar[1], 1)],
                "ddtree": [([1, 2, 3, 0], 1), (ar[1], 2)]}

    class FakeLLM:
        def __init__(self, target_dir, draft_model=None, method="ar", device="auto"):
            self.method = method

        def generate(self, prompts, params):
            assert len(prompts) == 2 and params.max_new_tokens == 6 and params.ignore_eos
            return [SimpleNamespace(token_ids=t, stats={"rounds": r}) for t, r in scripted[self.method]]
    monkeypatch.setattr(treeflash, "LLM", FakeLLM)
    got = measure_tau("target", "drafter", [[1], [2]], 6, "cpu")
    assert got == {"tau_dflash": round(10 / 3, 3), "same_as_ar_dflash": 1.0,
                   "tau_ddtree": round(10 / 3, 3), "same_as_ar_ddtree": 0.5}


def test_training_blocks_use_every_anchor_gamma_and_the_given_taps(target, data_dir, tmp_path, monkeypatch):
    """A training batch with more --blocks-per-seq than a window has anchors holds a block at
    every anchor 1..S-b (position 0 has no context); its slots are weighted by --gamma; the
    target layers given are tapped, in their order, and the export names them so."""
    import treeflash.train.drafter as drafter_module
    base, _ = target
    seen, draft, wce = [], drafter_module.draft_logits, drafter_module.weighted_ce

    def spy_draft(tgt, drafter, ids, anchors):
        seen.append(("anchors", drafter.target_layer_ids, anchors.clone()))
        return draft(tgt, drafter, ids, anchors)

    def spy_ce(logits, labels, weights):
        seen.append(("weights", weights.clone()))
        return wce(logits, labels, weights)
    monkeypatch.setattr(drafter_module, "draft_logits", spy_draft)
    monkeypatch.setattr(drafter_module, "weighted_ce", spy_ce)
    opts = TrainOptions(max_steps=1, **{**OPTS, "batch_size": 2, "eval_tokens": 32})
    train_drafter(base / "model", data_dir, tmp_path / "run", tmp_path / "drafter",
                  DrafterShape(num_layers=1, block_size=4, target_layer_ids=[2, 0]), opts, gamma=3.0,
                  blocks_per_seq=100, tau_prompts=0)
    train = seen[0]  # the first batch is training's, then the evaluation's
    assert train[1] == [2, 0] and all(sorted(row) == list(range(1, OPTS["seq_len"] - 4 + 1))
                                      for row in train[2].tolist())
    weights = [w for kind, *rest in seen if kind == "weights" for w in rest]
    assert weights and all(torch.allclose(w, torch.exp(-torch.arange(3.0) / 3.0)) for w in weights)
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [2, 0]


def test_the_logits_check_counts_the_blocks_drawn(target, data_dir, tmp_path, capsys):
    """More --blocks-per-seq than a sequence has anchors are cut to them (a note says so):
    the memory check counts those drawn, not the number given, which refused a run that
    fits as needing thousands of GiB."""
    base, _ = target
    train_drafter(base / "model", data_dir, tmp_path / "run", None, DrafterShape(num_layers=1, block_size=4),
                  TrainOptions(max_steps=1, **OPTS), blocks_per_seq=10 ** 9, tau_prompts=0)
    assert f"--blocks-per-seq {10 ** 9} is more anchors than a sequence of 32 tokens has for blocks of 4: 28 are " \
           f"drawn" in capsys.readouterr().err
    with pytest.raises(UsageError, match=r"--batch-size 1000000000 x --blocks-per-seq 1000000000 \(28 drawn\) x "
                                         r"block size 4 computes 112,000,000,000 rows"):
        train_drafter(base / "model", data_dir, tmp_path / "run-big", None, DrafterShape(num_layers=1, block_size=4),
                      TrainOptions(max_steps=1, **{**OPTS, "batch_size": 10 ** 9}), blocks_per_seq=10 ** 9,
                      tau_prompts=0)


def test_a_drafter_gamma_of_zero_is_refused(target, data_dir, tmp_path):
    base, _ = target
    with pytest.raises(UsageError, match="--gamma must be > 0"):
        train_drafter(base / "model", data_dir, tmp_path / "run", None, DrafterShape(block_size=4),
                      TrainOptions(max_steps=1, **OPTS), gamma=0.0, tau_prompts=0)
    assert not (tmp_path / "run" / "run.json").exists()
    # values of the wrong type (a hand-edited run.json's among them): named, not an internal TypeError
    for key, value, what in (("gamma", "x", "--gamma must be a number"),
                             ("blocks_per_seq", 2.5, "--blocks-per-seq must be an integer"),
                             ("tau_prompts", "3", "--tau-prompts must be an integer"),
                             ("tau_new_tokens", True, "--tau-new-tokens must be an integer")):
        with pytest.raises(UsageError, match=what):
            train_drafter(base / "model", data_dir, tmp_path / "run", None, DrafterShape(block_size=4),
                          TrainOptions(max_steps=1, **OPTS), **{"tau_prompts": 0, key: value})


# ----------------------------------------------------------------------------- the training loop (cases a mutation review found untested)

def _toy_trainer(tmp_path, **options):
    """A Trainer of one 2x2 weight (no bias) in a fresh run folder."""
    from treeflash.train.common import RunDir
    opts = TrainOptions.of({**DEFAULT_OPTIONS, "device": "cpu", "max_steps": 100, **options}).validate()
    run = RunDir(tmp_path / "run", False, "target")
    run.begin({}, {})
    torch.manual_seed(0)
    return Trainer("toy", run, torch.nn.Linear(2, 2, bias=False), opts, torch.device("cpu"))


def test_the_learning_rate_warms_up_from_the_first_step_then_decays_to_its_floor(tmp_path):
    t = _toy_trainer(tmp_path, lr=1.0, warmup_steps=10, min_lr_ratio=0.1, max_steps=100)
    want = {0: 0.1, 4: 0.5 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.04))), 50: 0.55, 100: 0.1}
    for step, lr in want.items():
        t.step = step
        assert t.lr() == pytest.approx(lr), step


def test_a_time_budget_is_in_minutes(tmp_path):
    t = _toy_trainer(tmp_path, max_steps=None, max_minutes=2.0)
    t.elapsed = 30.0
    assert t.progress() == pytest.approx(0.25)


def test_weight_decay_is_for_matrices_only(tmp_path):
    from treeflash.train.common import make_optimizer
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opts = TrainOptions.of({**DEFAULT_OPTIONS, "max_steps": 1, "weight_decay": 0.3}).validate()
    groups = make_optimizer(model, opts, torch.device("cpu")).param_groups
    assert [(g["weight_decay"], sorted(p.dim() for p in g["params"])) for g in groups] == [(0.3, [2]), (0.0, [1, 1, 1])]


def test_a_min_lr_ratio_past_one_is_refused():
    with pytest.raises(UsageError, match=r"--min-lr-ratio must be in \[0, 1\], got 1.5"):
        TrainOptions.of({**DEFAULT_OPTIONS, **OPTS, "max_steps": 1, "min_lr_ratio": 1.5}).validate()


def _steps_losses(t):
    """batch_loss of step k (from 1): loss k, gradient ones (the weights move every step)."""
    return lambda gen: (t.model.weight.sum() + (t.step + 1 - t.model.weight.sum().detach()), 10)


def test_the_last_log_line_is_the_mean_of_its_own_steps(tmp_path):
    """max_steps 7, log_every 5: the line at step 7 is the mean loss of steps 6-7 (not
    their sum over 5)."""
    t = _toy_trainer(tmp_path, max_steps=7, log_every=5, eval_every=100, save_every=100, warmup_steps=0)
    t.fit(_steps_losses(t), lambda: {"eval_loss": 1.0})
    assert [(r["step"], r["loss"]) for r in t.history if "loss" in r] == [(5, 3.0), (7, 6.5)]


def test_the_model_ends_with_the_weights_of_its_best_evaluation(tmp_path):
    """Held-out losses 3, 1, 2 at steps 2, 4, 6 and 5 at the last step, 7: the model
    (and so the export) holds step 4's weights, and the result says so."""
    t = _toy_trainer(tmp_path, max_steps=7, eval_every=2, save_every=100, warmup_steps=0, lr=0.1)
    evals, snapshots = iter([3.0, 1.0, 2.0, 5.0]), {}

    def evaluate():
        snapshots[t.step] = t.model.weight.detach().clone()
        return {"eval_loss": next(evals)}
    result = t.fit(_steps_losses(t), evaluate)
    assert (result["best_step"], result["eval_loss"], result["final_eval_loss"]) == (4, 1.0, 5.0)
    assert torch.equal(t.model.weight, snapshots[4]) and not torch.equal(snapshots[4], snapshots[7])


def test_the_drafters_final_norm_starts_as_the_targets(target):
    """Both feed the target's LM head: the drafter's norm weight is the target's trained
    one, not ones."""
    from treeflash.config import ModelConfig
    from treeflash.train.drafter import build_drafter, drafter_config, load_frozen_target
    base, _ = target
    tgt = load_frozen_target(base / "model", torch.device("cpu"))
    shape = DrafterShape(num_layers=1, block_size=4, target_layer_ids=[1], mask_token_id=2)
    drafter = build_drafter(drafter_config(shape, ModelConfig.from_pretrained(base / "model"), "float32"), tgt,
                            torch.device("cpu"))
    assert not torch.all(tgt.model.norm.weight == 1)
    assert torch.equal(drafter.norm.weight, tgt.model.norm.weight.float())


def test_gradients_are_clipped_to_grad_clip(tmp_path):
    """A clip far below Adam's eps leaves the first step almost nothing to move: the
    weights stay put; without a clip they move by about lr."""
    moved = {}
    for clip in (0.0, 1e-12):
        t = _toy_trainer(tmp_path / str(clip), max_steps=1, grad_clip=clip, warmup_steps=0, lr=0.1, weight_decay=0.0)
        before = t.model.weight.detach().clone()
        t.fit(lambda gen: (t.model.weight.sum() * 100, 1), lambda: {"eval_loss": 1.0})
        moved[clip] = (t.model.weight.detach() - before).abs().max().item()
    assert moved[0.0] == pytest.approx(0.1, rel=1e-3) and moved[1e-12] < 1e-3


def test_every_step_clips_to_grad_clip_and_gives_every_group_the_scheduled_lr(tmp_path):
    """The gradient the optimizer steps with has norm grad_clip exactly (it was larger),
    and the norms' and biases' group (no weight decay) follows the same LR schedule as the
    matrices'."""
    t = _toy_trainer(tmp_path, max_steps=3, grad_clip=0.5, warmup_steps=2, lr=0.1)
    t = Trainer("toy", t.run, torch.nn.Linear(2, 2), t.opts, t.device)  # a bias: both groups hold parameters
    steps, step = [], t.optimizer.step

    def spy_step(*args, **kwargs):
        grads = [p.grad for p in t.model.parameters()]
        steps.append((torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item(),
                      [g["lr"] for g in t.optimizer.param_groups], t.lr()))
        return step(*args, **kwargs)
    t.optimizer.step = spy_step
    t.fit(lambda gen: ((t.model.weight.sum() + t.model.bias.sum()) * 100, 1), lambda: {"eval_loss": 1.0})
    assert len(steps) == 3
    for norm, lrs, lr in steps:
        assert norm == pytest.approx(0.5) and lrs == [lr, lr]
    assert steps[0][2] != steps[-1][2]  # (the schedule moved: warmup)


def test_a_resumed_run_keeps_its_elapsed_time(tmp_path):
    """The time trained so far is saved and a resumed session adds to it (a time budget
    and the LR schedule go on from there, not from zero)."""
    from treeflash.train.common import RunDir
    t = _toy_trainer(tmp_path, max_steps=2, max_minutes=1e6, eval_every=100, save_every=100)
    t.fit(_steps_losses(t), lambda: {"eval_loss": 1.0})
    assert t.elapsed > 0
    resumed = Trainer("toy", RunDir(tmp_path / "run", True, "target"), torch.nn.Linear(2, 2, bias=False),
                      TrainOptions.of({**vars(t.opts), "max_steps": 3}), t.device)
    assert (resumed.step, resumed.elapsed) == (2, t.elapsed)
    resumed.elapsed = before = 1000.0  # as if the run had trained for 1000 s
    resumed.fit(_steps_losses(resumed), lambda: {"eval_loss": 1.0})
    assert resumed.step == 3 and resumed.elapsed > before


def test_a_drafter_on_generated_rows_is_evaluated_on_their_continuations(target, data_dir, tmp_path, monkeypatch):
    """Held-out rows of a generated file are evaluated from their last prompt token on, as
    training anchors are: every label is a target-generated token, never prompt text."""
    import treeflash.train.drafter as drafter_module
    from treeflash.train.drafter import target_fingerprint
    base, _ = target
    gen = np.random.default_rng(0)
    np.savez(tmp_path / "gen.npz", ids=gen.integers(3, 320, (4, 24)), heldout_ids=gen.integers(3, 320, (2, 24)),
             prompt_len=np.int64(8), target=np.str_(target_fingerprint(base / "model")))
    calls = []

    def evaluate(target, drafter, windows, blocks, batch_size, weights, device, lo=1):
        calls.append((windows.shape, lo))
        return {"eval_loss": 1.0}
    monkeypatch.setattr(drafter_module, "evaluate_drafter", evaluate)
    summary = train_drafter(base / "model", data_dir, tmp_path / "run", None, DrafterShape(block_size=4),
                            TrainOptions(max_steps=1, **OPTS), generated=tmp_path / "gen.npz", tau_prompts=0)
    assert summary["heldout_text"] == "generated" and calls == [((2, 24), 7)]


def test_generated_names_the_file_given_or_numpys_npz():
    from pathlib import Path

    from treeflash.train.drafter import generated_file
    assert generated_file("/nowhere/gen.npz") == Path("/nowhere/gen.npz")  # not gen.npz.npz
    assert generated_file("/nowhere/gen") == Path("/nowhere/gen.npz")


def test_generated_ids_past_uint16_are_kept(data_dir, tmp_path):
    """A target's vocabulary may be larger than its tokenizer's (a padded LM head): the
    continuations of a uint16 corpus are stored for the target's ids, not cut at 65535
    (an OverflowError once generated, after minutes)."""
    target = write_random_target(tmp_path / "wide", hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1,
                                 head_dim=16, intermediate_size=16, vocab_size=70_000, max_position_embeddings=32)
    shutil.copy(data_dir / "tokenizer.json", target)  # the corpus' tokenizer, 320 ids of the 70,000
    meta = generate_continuations(target, data_dir, tmp_path / "gen", num_prompts=8, prompt_len=4, new_tokens=8,
                                  device="cpu", heldout_prompts=0)
    with np.load(meta["path"]) as f:
        ids = f["ids"]
    assert ids[:, 4:].max() >= 1 << 16 and ids[:, 4:].max() < 70_000
    ref = LLM(target, device="cpu").generate(ids[:1, :4].tolist(), SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert ids[0, 4:].tolist() == ref[0].token_ids


def test_no_export_shard_is_empty(tmp_path):
    """A first tensor larger than a shard gets a shard of its own, not an empty shard
    before it."""
    from safetensors import safe_open

    from treeflash.train.common import save_safetensors
    tensors = {"big": torch.ones(1000), "small": torch.ones(10), "last": torch.ones(400)}
    paths = save_safetensors(tensors, tmp_path, torch.float32, max_shard_bytes=2048)
    held = []
    for p in paths:
        with safe_open(str(p), framework="pt") as f:
            held.append(sorted(f.keys()))
    assert held == [["big"], ["last", "small"]]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) and index["metadata"]["total_size"] == 4 * 1410


# ----------------------------------------------------------------------------- corpus building (cases a mutation review found untested)

def test_code_files_that_are_data_are_skipped(tmp_path):
    """A .py file over MAX_FILE_BYTES, or with a line over MAX_LINE_CHARS, is a data blob,
    and a file holding a NUL byte is binary: all skipped. A line of exactly the limit is
    kept, and a CRLF copy of a file is the same document (a duplicate)."""
    from treeflash.train.corpus import MAX_FILE_BYTES, MAX_LINE_CHARS
    src = _corpus_files(tmp_path / "src", 4)
    row = "x = 1  # " + "-" * 60 + "\n"
    (src / "table.py").write_text(row * (MAX_FILE_BYTES // len(row) + 1))
    (src / "blob.py").write_text("DATA = '" + "a" * MAX_LINE_CHARS + "'\n")
    (src / "edge.py").write_text("D = '" + "b" * (MAX_LINE_CHARS - 6) + "'\n")  # a line of MAX_LINE_CHARS
    (src / "binary.py").write_text("x = 1\x00\n")
    (src / "crlf.py").write_bytes(_source(0).replace("\n", "\r\n").encode())
    c = collect([src], heldout_fraction=0)
    assert c.stats["skipped"] == 3 and c.stats["duplicates"] == 1 and len(c.train) == 5
    assert any(t.startswith("D = 'bbb") for t in c.train) and not any("\r" in t for t in c.train)


def test_roots_are_read_in_priority_order_and_sampled_within(tmp_path):
    """A cap keeps the first root whole before the next is read; within a root, files are
    taken in a hash order (a sample, not the alphabetical head); a root inside another
    is read once, as itself."""
    first, second = tmp_path / "first", tmp_path / "second"
    for root, tag in ((first, "a"), (second, "b")):
        root.mkdir()
        for i in range(20):
            (root / f"m{i:02d}.py").write_text(f"def {tag}{i:02d}():\n    return {i:03d}\n")
    size = len((first / "m00.py").read_bytes())
    c = collect([first, second], heldout_fraction=0, max_bytes=22 * size)
    assert len(c.train) == 22 and c.stats["capped"] and {p.read_text() for p in first.iterdir()} <= set(c.train)
    head = collect([first], heldout_fraction=0, max_bytes=5 * size).train
    assert len(head) == 5 and set(head) != {(first / f"m{i:02d}.py").read_text() for i in range(5)}
    inner = _corpus_files(first / "inner", 3)
    both = collect([first, inner], heldout_fraction=0)
    assert both.stats["files_seen"] == 23 and both.stats["duplicates"] == 0


def test_a_cap_stops_at_the_first_document_past_it(tmp_path):
    """max_bytes is a cap on the text read, in order: a corpus exactly as large is taken
    whole, and reading stops at the first document that would pass the cap (a smaller
    one after it is not taken)."""
    src = tmp_path / "src"
    src.mkdir()
    docs = ["a" * 100, "b" * 100, "c" * 300, "d" * 10]
    (src / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    exact = collect([src], heldout_fraction=0, max_bytes=200, suffixes=(".jsonl",))
    assert exact.train == docs[:2]
    capped = collect([src], heldout_fraction=0, max_bytes=250, suffixes=(".jsonl",))
    assert capped.train == docs[:2] and capped.stats["capped"]


def test_jsonl_lines_are_split_and_checked_one_by_one(tmp_path):
    """A .jsonl file is split line by line (one file gives both splits); a blank "text" is
    skipped; a file that is not UTF-8 is a one-line usage error naming it."""
    src = tmp_path / "src"
    src.mkdir()
    lines = [{"text": f"document number {i}"} for i in range(200)] + [{"text": "   "}]
    (src / "all.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    c = collect([src], heldout_fraction=0.3, suffixes=(".jsonl",))
    assert c.train and c.heldout and len(c.train) + len(c.heldout) == 200 and c.stats["skipped"] == 1
    (src / "all.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(UsageError, match=r"all\.jsonl is not UTF-8 text"):
        collect([src], suffixes=(".jsonl",))


def test_corpus_settings_are_checked(tmp_path):
    src = _corpus_files(tmp_path / "src", 2)
    for kwargs, what in ((dict(suffixes=(".",)), "--suffixes must look like"),
                         (dict(heldout_fraction=1.0), r"--heldout-fraction must be in \[0, 1\)"),
                         (dict(max_bytes=0), "--max-bytes must be >= 1")):
        with pytest.raises(UsageError, match=what):
            collect([src], **kwargs)


def test_a_corpus_written_again_replaces_its_arrays(data_dir, tmp_path):
    """A corpus re-made in its folder without --compress does not leave the earlier
    train.npz behind, which would be loaded in its place."""
    write_corpus(data_dir, tmp_path / "c", [data_dir.parent / "src"], heldout_fraction=0.25, compress=True)
    other = _corpus_files(tmp_path / "other", 6)
    meta = write_corpus(data_dir, tmp_path / "c", [other], heldout_fraction=0.25)
    assert sorted(p.name for p in (tmp_path / "c").glob("*.np?")) == ["heldout.npy", "train.npy"]
    assert load_corpus(tmp_path / "c").train.size == meta["train_tokens"]
    assert meta["bytes_per_token"] == round(meta["train_bytes"] / meta["train_tokens"], 3)
    assert (tmp_path / "c" / "tokenizer_config.json").read_text() == (data_dir / "tokenizer_config.json").read_text()


def test_damaged_corpus_arrays_and_metadata_are_refused(data_dir, tmp_path):
    """Arrays that are not flat token ids, negative ids, an empty train split and a
    corpus.json without its EOS id are one-line errors; a corpus.json from before the
    tokenizer hash still loads."""
    broken = shutil.copytree(data_dir, tmp_path / "broken")
    (broken / "train.npz").unlink()
    for ids, what in ((np.zeros((4, 8), np.uint16), "is not a flat array of token ids"),
                      (np.full(10, -1, np.int32), "outside its vocabulary"),
                      (np.zeros(0, np.uint16), "the train split in .* holds no tokens")):
        np.save(broken / "train.npy", ids)
        with pytest.raises(TreeflashError, match=what):
            load_corpus(broken)
    legacy = shutil.copytree(data_dir, tmp_path / "legacy")
    meta = json.loads((legacy / "corpus.json").read_text())
    (legacy / "corpus.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "tokenizer_sha256"}))
    assert load_corpus(legacy).train.size == meta["train_tokens"]
    (legacy / "corpus.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "eos_token_id"}))
    with pytest.raises(TreeflashError, match="'eos_token_id' must be a token count or id, got None"):
        load_corpus(legacy)


def test_held_out_windows_of_a_short_split():
    """A held-out split shorter than a window is one shorter window; one of fewer than two
    tokens is refused (nothing to predict)."""
    from treeflash.train.corpus import fixed_windows
    assert fixed_windows(np.arange(7), 10, 50).tolist() == [list(range(7))]
    with pytest.raises(UsageError, match="the held-out split is empty"):
        fixed_windows(np.arange(1), 10, 50)


def test_ctrl_c_stops_the_tokenizer_trainer_at_once(tmp_path):
    """The BPE trainer runs in Rust, which takes no Ctrl-C: `train tokenizer` on 200 MB
    went on for 27 s after it. The trainer runs on a thread of its own now, and the
    interrupt reaches the caller within a fraction of a second (the training alone takes
    seconds here). In a process of its own: the trainer goes on until the process ends."""
    import signal
    import subprocess
    import sys
    import time
    script = (
        "import random, signal, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # (a pytest-xdist worker's children ignore it)\n"
        "from treeflash.train.tokenizer import train_tokenizer\n"
        "rng = random.Random(0)\n"
        "words = [''.join(rng.choice('abcdefghijklmnopqrstuvwxyz_') for _ in range(rng.randint(2, 12)))"
        " for _ in range(200_000)]\n"
        "texts = [' '.join(rng.choices(words, k=2000)) for _ in range(300)]\n"
        "print('training', flush=True)\n"
        "try:\n"
        f"    train_tokenizer(texts, {str(tmp_path / 'tok')!r}, vocab_size=20_000)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', time.monotonic(), flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "training"
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # (the process's own exit after it, with torch loaded, may take seconds on a busy machine)
    assert out.startswith("interrupted") and float(out.split()[1]) - sent < 1.0, (out, err)
    assert not (tmp_path / "tok").exists()


def test_a_tokenizer_without_an_eos_token_is_refused(data_dir, tmp_path):
    """Every document ends with EOS: a tokenizer folder that names none is refused."""
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(data_dir / "tokenizer.json", tok)  # no tokenizer_config.json: no eos_token
    with pytest.raises(TreeflashError, match="defines no EOS token"):
        write_corpus(tok, tmp_path / "c", [data_dir.parent / "src"])


# ----------------------------------------------------------------------------- exports and CLI options (cases a mutation review found untested)

def test_the_target_export_holds_what_loaders_read(target, data_dir, tmp_path):
    """The default export is bfloat16, with the tokenizer's PAD and the corpus's EOS in
    config.json and generation_config.json (greedy), the tokenizer files beside it; the
    summary counts its bytes and the held-out tokens evaluated (at most --eval-tokens)."""
    from treeflash.tokenizer import Tokenizer
    base, summary = target
    folder = base / "model"
    config = json.loads((folder / "config.json").read_text())
    pad, eos = Tokenizer(data_dir).tok.token_to_id("<|pad|>"), load_corpus(data_dir).meta["eos_token_id"]
    assert (config["pad_token_id"], config["eos_token_id"], config["torch_dtype"]) == (pad, eos, "bfloat16")
    assert {t.dtype for t in _tensors(folder).values()} == {torch.bfloat16}
    assert json.loads((folder / "generation_config.json").read_text()) == {
        "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    assert (folder / "tokenizer_config.json").read_text() == (data_dir / "tokenizer_config.json").read_text()
    assert summary["export_bytes"] == sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert 0 < summary["heldout_tokens_evaluated"] <= OPTS["eval_tokens"] < load_corpus(data_dir).heldout.size
    with pytest.raises(UsageError, match="export dtype must be bfloat16, float16 or float32, got 'int8'"):
        train_target(data_dir, tmp_path / "run", None, TINY, TrainOptions(max_steps=1, **OPTS), dtype="int8")


def test_target_shape_and_budget_flags(data_dir, tmp_path):
    """--untied exports an LM head of its own, --rope-theta reaches config.json, and
    --max-minutes takes a fraction of a minute."""
    flags = ["--hidden-size", "32", "--num-layers", "2", "--num-heads", "2", "--num-kv-heads", "1", "--head-dim",
             "16", "--intermediate-size", "64"] + [f"--{k.replace('_', '-')}={v}" for k, v in OPTS.items()]
    assert cli_main(["target", "--data", str(data_dir), "--run", str(tmp_path / "run"), "--untied", "--rope-theta",
                     "500", "--max-steps", "2", "--max-minutes", "0.5", *flags]) == 0
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["rope_theta"] == 500.0
    assert "lm_head.weight" in _tensors(tmp_path / "run" / "model")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["options"]["max_minutes"] == 0.5


def test_corpus_and_tokenizer_cli_options(data_dir, tmp_path, capsys):
    """--max-bytes takes K/M/G (powers of 1024, with or without B / iB); --compress writes
    .npz, without it .npy; the defaults are the library's (a 2% held-out split of .py
    files) and, for `train tokenizer`, a vocabulary of 4096."""
    from treeflash.train.corpus import HELDOUT_FRACTION
    src = data_dir.parent / "src"
    assert cli_main(["corpus", "--tokenizer", str(data_dir), "--out", str(tmp_path / "a"), "--roots", str(src),
                     "--max-bytes", "2K"]) == 0
    meta = json.loads((tmp_path / "a" / "corpus.json").read_text())
    assert (meta["max_bytes"], meta["heldout_fraction"], meta["suffixes"]) == (2048, HELDOUT_FRACTION, [".py"])
    assert (tmp_path / "a" / "train.npy").exists() and not (tmp_path / "a" / "train.npz").exists()
    assert cli_main(["corpus", "--tokenizer", str(data_dir), "--out", str(tmp_path / "b"), "--roots", str(src),
                     "--max-bytes", "1.5MiB", "--compress"]) == 0
    assert json.loads((tmp_path / "b" / "corpus.json").read_text())["max_bytes"] == 3 << 19
    assert (tmp_path / "b" / "train.npz").exists() and not (tmp_path / "b" / "train.npy").exists()
    capsys.readouterr()
    assert cli_main(["tokenizer", "--out", str(tmp_path / "tok"), "--roots", str(src)]) == 0
    size = len(json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["model"]["vocab"])
    assert f"vocabulary of {size} written to {tmp_path / 'tok'} (asked for 4096: the corpus has fewer merges)" \
        in capsys.readouterr().out
    assert cli_main(["drafter", "--target", "t", "--data", "d", "--run", "r", "--target-layer-ids", "1,x"]) == 2
    assert "not a comma-separated list of integers: '1,x'" in capsys.readouterr().err


def test_an_export_clears_what_a_killed_export_left(tmp_path):
    """A process killed while exporting (SIGKILL, the OS) leaves its hidden partial copy
    beside the export: the next export removes it, and leaves alone those of processes
    that still run (an export under way)."""
    import subprocess
    import sys

    from treeflash.train.common import exporting
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = tmp_path / f".model.export-{done.stdout.strip()}", tmp_path / f".model.export-{os.getppid()}"
    for left in (dead, alive):
        left.mkdir()
        (left / "model.safetensors").write_bytes(b"partial")
    with exporting(tmp_path / "model") as folder:
        (folder / "config.json").write_text("{}")
    assert (tmp_path / "model" / "config.json").exists() and not dead.exists() and alive.exists()


def test_generate_defaults_and_its_bad_inputs(target, data_dir, tmp_path, monkeypatch):
    """At least 16 held-out continuations by default, written whole; an existing output
    file, prompts longer than the corpus, a held-out split too short for its prompts,
    and rows past the target's context are refused before generating."""
    base, _ = target
    meta = generate_continuations(base / "model", data_dir, tmp_path / "gen", num_prompts=1, prompt_len=4,
                                  new_tokens=2, device="cpu")
    with np.load(meta["path"]) as f:
        assert f["ids"].shape == (1, 6) and f["heldout_ids"].shape == (16, 6)
    assert sorted(p.name for p in tmp_path.iterdir() if "gen" in p.name) == ["gen.npz"]  # no temporary file left
    (tmp_path / "plain").write_bytes(b"")  # and as readable as any file written here
    assert (tmp_path / "gen.npz").stat().st_mode == (tmp_path / "plain").stat().st_mode
    # an existing file (a drafter run may be bound to its bytes) is never written over
    before = (tmp_path / "gen.npz").read_bytes()
    for out in ("gen", "gen.npz"):
        with pytest.raises(UsageError, match="gen.npz exists .*remove it or choose another path"):
            generate_continuations(base / "model", data_dir, tmp_path / out, num_prompts=1, prompt_len=4,
                                   new_tokens=2, device="cpu", seed=1)
    assert (tmp_path / "gen.npz").read_bytes() == before
    # nor one that appears while it generates (the temporary file goes too)
    import treeflash
    generate = treeflash.LLM.generate

    def racing(self, *args, **kw):
        (tmp_path / "late.npz").write_bytes(b"theirs")
        return generate(self, *args, **kw)
    with monkeypatch.context() as m, pytest.raises(UsageError, match="late.npz appeared while generating"):
        m.setattr(treeflash.LLM, "generate", racing)
        generate_continuations(base / "model", data_dir, tmp_path / "late", num_prompts=1, prompt_len=4,
                               new_tokens=2, heldout_prompts=0, device="cpu")
    assert (tmp_path / "late.npz").read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir() if "late" in p.name) == ["late.npz"]
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.py").write_text("x = 1\n")
    write_corpus(data_dir, tmp_path / "small", [tmp_path / "one"], heldout_fraction=0)
    size = load_corpus(tmp_path / "small").train.size
    with pytest.raises(UsageError, match=f"the corpus has {size} tokens, too few for prompts of 8"):
        generate_continuations(base / "model", tmp_path / "small", tmp_path / "g", num_prompts=1, prompt_len=8,
                               new_tokens=2, device="cpu", heldout_prompts=0)
    # rows past the context come first: the corpus' advice would not help them
    with pytest.raises(UsageError, match="prompt_len \\+ new_tokens = 33 exceeds the target's context of 32"):
        generate_continuations(base / "model", tmp_path / "small", tmp_path / "g", num_prompts=1,
                               prompt_len=31, new_tokens=2, device="cpu")
    write_corpus(data_dir, tmp_path / "no-heldout", [data_dir.parent / "src"], heldout_fraction=0)
    with pytest.raises(UsageError, match="the held-out split has 0 tokens, too few for prompts of 4"):
        generate_continuations(base / "model", tmp_path / "no-heldout", tmp_path / "g", num_prompts=1, prompt_len=4,
                               new_tokens=2, device="cpu")
    with pytest.raises(UsageError, match="prompt_len \\+ new_tokens = 40 exceeds the target's context of 32"):
        generate_continuations(base / "model", data_dir, tmp_path / "g", num_prompts=1, prompt_len=8, new_tokens=32,
                               device="cpu", heldout_prompts=0)
    assert not (tmp_path / "g.npz").exists()


def test_drafter_options_are_checked_before_training(target, data_dir, tmp_path):
    base, _ = target
    opts = TrainOptions(max_steps=1, **OPTS)
    shape = DrafterShape(block_size=4)
    big = shutil.copytree(data_dir, tmp_path / "big-vocab")
    meta = json.loads((big / "corpus.json").read_text())
    (big / "corpus.json").write_text(json.dumps({**meta, "vocab_size": 10 ** 6}))
    for kwargs, what in ((dict(tau_new_tokens=0), "--tau-new-tokens must be >= 1, got 0"),
                         # 10^9 prompts: 7 GiB of prompt offsets at once, then the OS killed the run
                         (dict(tau_prompts=10 ** 9), r"--tau-prompts must be from 0 to 65536 \(0: skip the "
                                                     r"measure\), got 1000000000"),
                         (dict(blocks_per_seq=0), "--blocks-per-seq must be >= 1, got 0"),
                         (dict(opts=TrainOptions(**{**OPTS, "max_steps": 1, "seq_len": 4})),
                          "--seq-len 4 is too short for blocks of 4"),
                         (dict(tau_prompts=1, tau_new_tokens=32),
                          "--tau-new-tokens 32 leaves no room for a prompt in the target's context of 32"),
                         (dict(dtype="int8"), "export dtype must be bfloat16, float16 or float32, got 'int8'"),
                         (dict(data=big), "tokenized with a vocabulary of 1000000, larger than the target's 320")):
        args = {"opts": opts, "tau_prompts": 0, **kwargs}
        with pytest.raises(UsageError, match=what):
            train_drafter(base / "model", args.pop("data", data_dir), tmp_path / "run", None, shape, **args)
        assert not (tmp_path / "run" / "run.json").exists()
    # the default τ continuations fit the target's context (32 tokens), as the default --seq-len does
    summary = train_drafter(base / "model", data_dir, tmp_path / "run", None, shape, opts, tau_prompts=1)
    assert summary["tau_dflash"] >= 1 and json.loads((tmp_path / "run" / "run.json").read_text())


def test_a_target_tokenizer_without_a_mask_token_needs_an_id(target, data_dir, tmp_path, capsys):
    """A tokenizer without <|mask|> (another target's) needs --mask-token-id; given one,
    the drafter trains with it."""
    base, _ = target
    tok = shutil.copytree(data_dir, tmp_path / "tok", ignore=shutil.ignore_patterns("*.np?", "corpus.json"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok / name).write_text((tok / name).read_text().replace("<|mask|>", "<|reserved_0|>"))
    write_corpus(tok, tmp_path / "data", [data_dir.parent / "src"], heldout_fraction=0.25)
    model = shutil.copytree(base / "model", tmp_path / "model")
    shutil.copy(tok / "tokenizer.json", model / "tokenizer.json")
    shutil.copy(tok / "tokenizer_config.json", model / "tokenizer_config.json")
    with pytest.raises(UsageError, match=r"has no <\|mask\|> token: give the drafter's mask token id"):
        train_drafter(model, tmp_path / "data", tmp_path / "run", None, DrafterShape(block_size=4),
                      TrainOptions(max_steps=1, **OPTS), tau_prompts=0)
    train_drafter(model, tmp_path / "data", tmp_path / "run", tmp_path / "drafter",
                  DrafterShape(block_size=4, mask_token_id=2), TrainOptions(max_steps=1, **OPTS), tau_prompts=0)
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 2


def test_bad_generated_rows_are_refused(target, data_dir, tmp_path):
    base, _ = target
    mark = np.str_(target_fingerprint(base / "model"))
    rows = np.random.default_rng(0).integers(3, 320, (4, 24))
    for ids, what in ((np.where(rows == rows[0, 0], -1, rows), "'ids' holds token ids outside"),
                      (rows[:0], "holds no generated sequences"),
                      (rows[0], "'ids' must be a 2-D array of token ids"),
                      (rows[:, :10], "training sequences of 10 tokens are too short for blocks of 4")):
        np.savez(tmp_path / "gen.npz", ids=ids, prompt_len=np.int64(8), target=mark)
        with pytest.raises(UsageError, match=what):
            train_drafter(base / "model", data_dir, tmp_path / "run", None, DrafterShape(block_size=4),
                          TrainOptions(max_steps=1, **OPTS), generated=tmp_path / "gen.npz", tau_prompts=0)


def test_generated_held_out_rows_are_capped_by_eval_tokens(target, data_dir, tmp_path, monkeypatch):
    import treeflash.train.drafter as drafter_module
    base, _ = target
    gen = np.random.default_rng(0)
    np.savez(tmp_path / "gen.npz", ids=gen.integers(3, 320, (4, 24)), heldout_ids=gen.integers(3, 320, (6, 24)),
             prompt_len=np.int64(8), target=np.str_(target_fingerprint(base / "model")))
    shapes = []
    monkeypatch.setattr(drafter_module, "evaluate_drafter", lambda t, d, windows, *a, **k: (
        shapes.append(tuple(windows.shape)) or {"eval_loss": 1.0}))
    train_drafter(base / "model", data_dir, tmp_path / "run", None, DrafterShape(block_size=4),
                  TrainOptions(max_steps=1, **{**OPTS, "eval_tokens": 2 * 24}), generated=tmp_path / "gen.npz",
                  tau_prompts=0)
    assert shapes == [(2, 24)]


def test_a_failed_tau_measurement_keeps_the_trained_drafter(target, data_dir, tmp_path, monkeypatch):
    import treeflash.train.drafter as drafter_module
    base, _ = target

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(drafter_module, "measure_tau", fails)
    summary = train_drafter(base / "model", data_dir, tmp_path / "run", tmp_path / "drafter",
                            DrafterShape(block_size=4), TrainOptions(max_steps=1, **OPTS), tau_prompts=1,
                            tau_new_tokens=8)
    assert summary["tau_error"] == "RuntimeError: out of memory"
    assert (tmp_path / "drafter" / "config.json").exists()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["tau_error"] == summary["tau_error"]


def test_ctrl_c_in_the_tau_measurement_leaves_this_sessions_summary(target, data_dir, tmp_path, monkeypatch):
    """The τ measurement comes after the export, and takes minutes on a CPU: Ctrl-C there
    leaves summary.json of the drafter just exported (without τ), not none, nor the one
    of the session before a resume."""
    import treeflash.train.drafter as drafter_module
    base, _ = target
    args = (base / "model", data_dir, tmp_path / "run", tmp_path / "drafter", DrafterShape(block_size=4))
    train_drafter(*args, TrainOptions(max_steps=1, **OPTS), tau_prompts=0)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(drafter_module, "measure_tau", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(*args, TrainOptions(max_steps=2), resume=True, tau_prompts=1, tau_new_tokens=8)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and "tau_dflash" not in summary


def test_a_drafter_keeps_its_targets_rope_scaling(hf_checkpoint):
    from treeflash.config import ModelConfig
    from treeflash.train.drafter import drafter_config
    cfg = ModelConfig.from_pretrained(hf_checkpoint("llama3-rope").path)
    config = drafter_config(DrafterShape(num_layers=1, block_size=4, target_layer_ids=[0], mask_token_id=2), cfg,
                            "float32")
    assert cfg.rope_scaling and config["rope_scaling"] == cfg.rope_scaling


# ----------------------------------------------------------------------------- options and run folders (cases a mutation review found untested)

def test_every_count_option_must_be_at_least_one():
    """Each named alone by its flag, as the command takes it."""
    for key in ("batch_size", "seq_len", "eval_every", "save_every", "log_every", "eval_tokens"):
        with pytest.raises(UsageError, match=f"^--{key.replace('_', '-')} must be an integer >= 1, got 0$"):
            TrainOptions.of({**DEFAULT_OPTIONS, **OPTS, "max_steps": 1, key: 0}).validate()
    with pytest.raises(UsageError, match="^--warmup-steps must be >= 0, got -1$"):
        TrainOptions.of({**DEFAULT_OPTIONS, **OPTS, "max_steps": 1, "warmup_steps": -1}).validate()


def test_out_may_not_hold_the_run_nor_weights_be_overwritten(data_dir, tmp_path, capsys):
    with pytest.raises(UsageError, match="holds the run folder"):
        train_target(data_dir, tmp_path / "out" / "run", tmp_path / "out", TINY, TrainOptions(max_steps=1, **OPTS))
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"x")
    assert cli_main(["tokenizer", "--roots", str(data_dir.parent / "src"), "--out", str(weights)]) == 2
    assert "holds a model (config.json or weights)" in capsys.readouterr().err


def test_a_fresh_run_starts_its_own_log(tmp_path):
    """A log.jsonl left by a fresh run that died before its first save is not continued."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "log.jsonl").write_text(json.dumps({"step": 99, "loss": 1.0}) + "\n")
    t = _toy_trainer(tmp_path, max_steps=2, log_every=1, eval_every=100, save_every=100, warmup_steps=0)
    t.fit(_steps_losses(t), lambda: {"eval_loss": 1.0})
    assert [r["step"] for r in map(json.loads, (tmp_path / "run" / "log.jsonl").read_text().splitlines())] == [1, 2, 2]


def test_exported_weights_are_readable_by_all(tmp_path):
    """safetensors writes files for their owner only: an export served by another user
    (a server account) must read them."""
    from treeflash.train.common import save_safetensors
    (path,) = save_safetensors({"w": torch.ones(3)}, tmp_path, torch.float32)
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_resumed_run_replaces_only_its_own_export(target, data_dir, tmp_path):
    """--out given on resume may move the export, but not over another folder's files;
    it may come back to the run's own RUN/model (as TRAINING.md says)."""
    base, _ = target
    run = shutil.copytree(base / "run", tmp_path / "run")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="is not empty"):
        train_target(data_dir, run, other, opts=TrainOptions(max_steps=41), resume=True)
    assert [p.name for p in other.iterdir()] == ["config.json"]
    for steps, out in ((41, run / "model"), (42, tmp_path / "moved"), (43, run / "model")):
        assert train_target(data_dir, run, out, opts=TrainOptions(max_steps=steps), resume=True)["steps"] == steps
        assert (out / "config.json").exists()


# ----------------------------------------------------------------------------- corpus, target, tokenizer and CLI (cases a second mutation review found untested)

def test_package_folders_inside_a_root_are_left_to_their_own_root(tmp_path):
    """A root that holds site-packages or dist-packages (the standard library's folder does)
    reads its own files only: the installed packages are a root of their own, read after it."""
    root = _corpus_files(tmp_path / "lib", 2)
    for name in ("site-packages", "dist-packages"):
        (root / name).mkdir()
        (root / name / "pkg.py").write_text(f"# from {name}\nx = 1\n")
    assert collect([root], heldout_fraction=0).stats["files_seen"] == 2
    assert collect([root / "site-packages"], heldout_fraction=0).train == ["# from site-packages\nx = 1\n"]


def test_a_code_file_of_exactly_the_size_limit_is_kept(tmp_path):
    """MAX_FILE_BYTES is the largest .py file read: one of exactly that size is a document."""
    from treeflash.train.corpus import MAX_FILE_BYTES
    src = tmp_path / "src"
    src.mkdir()
    text = ("#" * 63 + "\n") * (MAX_FILE_BYTES // 64)
    (src / "big.py").write_text(text)
    assert len(text.encode()) == MAX_FILE_BYTES and collect([src], heldout_fraction=0).train == [text]


def test_jsonl_lines_split_the_same_wherever_the_corpus_lies(tmp_path):
    """The split of a .jsonl line hashes the file's path relative to its root and the line
    number: a copy in another folder (machine) splits alike."""
    a = tmp_path / "a" / "chats"
    a.mkdir(parents=True)
    (a / "c.jsonl").write_text("".join(json.dumps({"text": f"chat number {i}"}) + "\n" for i in range(80)))
    b = shutil.copytree(a, tmp_path / "elsewhere" / "deeper" / "chats")
    ca = collect([a], heldout_fraction=0.3, suffixes=(".jsonl",))
    cb = collect([b], heldout_fraction=0.3, suffixes=(".jsonl",))
    assert ca.heldout and (ca.train, ca.heldout) == (cb.train, cb.heldout)


def test_a_jsonl_text_holding_a_nul_is_skipped(tmp_path):
    """As a code file with a NUL byte, a .jsonl text holding one is binary data: skipped."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "d.jsonl").write_text(json.dumps({"text": "plain text"}) + "\n" + json.dumps({"text": "bin\x00ary"}) + "\n")
    c = collect([src], heldout_fraction=0, suffixes=(".jsonl",))
    assert c.train == ["plain text"] and c.stats["skipped"] == 1


def test_text_that_utf8_cannot_write_is_skipped(tmp_path):
    """A .jsonl text holding a lone surrogate (JSON's "\\ud800", common in scraped data) is
    not text: skipped, as a file that is not UTF-8 is; a file name of undecodable bytes
    is read like any other. Both stopped the whole corpus, telling to set PYTHONIOENCODING."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "d.jsonl").write_text(json.dumps({"text": "plain text"}) + "\n" + '{"text": "cut \\ud800 in two"}\n')
    (src / os.fsdecode(b"m\xfe.jsonl")).write_text(json.dumps({"text": "odd name"}) + "\n")
    c = collect([src], heldout_fraction=0, suffixes=(".jsonl",))
    assert sorted(c.train) == ["odd name", "plain text"] and c.stats["skipped"] == 1


def test_a_cap_stops_at_the_first_file_past_it(tmp_path):
    """Reading stops at the first file that would pass max_bytes: a smaller file after it,
    which would still fit, is not taken (the corpus is a prefix of the read order)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"m{i}.py").write_text(f"x{i} = {i}\n")
    order = collect([src], heldout_fraction=0).train
    big = next(p for p in src.iterdir() if p.read_text() == order[2])
    big.write_text("y = 1\n" * 100)
    capped = collect([src], heldout_fraction=0, max_bytes=len("".join(order[:2]).encode()) + 50)
    assert capped.train == order[:2] and capped.stats["capped"]


def _word_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A word-level tokenizer of `vocab_size` ids: EOS, then w1, w2, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def test_ids_past_uint16_are_stored_as_int32(tmp_path):
    """A vocabulary of 2^16 ids fits uint16; one more id needs int32, and the corpus keeps
    the ids past 65535 as they are (not wrapped around)."""
    src = tmp_path / "src"
    src.mkdir()
    for vocab, dtype in ((1 << 16, "uint16"), ((1 << 16) + 1, "int32")):
        (src / "a.py").write_text(f"w{vocab - 1} w1\n")
        tok = _word_tokenizer(tmp_path / f"tok{vocab}", vocab)
        meta = write_corpus(tok, tmp_path / f"ids{vocab}", [src], heldout_fraction=0)
        assert meta["dtype"] == dtype and load_corpus(tmp_path / f"ids{vocab}").train.tolist() == [vocab - 1, 1, 0]


def test_a_corpus_may_be_written_into_its_tokenizers_folder(tmp_path):
    """TRAINING.md's flow: `train tokenizer --out data/`, then `train corpus --tokenizer data/
    --out data/` (the tokenizer files are already there)."""
    src = _corpus_files(tmp_path / "src", 6)
    data = tmp_path / "data"
    assert cli_main(["tokenizer", "--out", str(data), "--roots", str(src), "--vocab-size", "300"]) == 0
    tokenizer = (data / "tokenizer.json").read_bytes()
    assert cli_main(["corpus", "--tokenizer", str(data), "--out", str(data), "--roots", str(src)]) == 0
    assert load_corpus(data).train.size and (data / "tokenizer.json").read_bytes() == tokenizer


def test_training_windows_reach_the_last_one():
    """Training draws windows from every start, the last included (the corpus's end is
    trained on like its middle)."""
    from treeflash.train.corpus import TokenWindows
    w = TokenWindows(np.arange(40), 33, torch.device("cpu"))
    batch = w.sample(400, torch.Generator().manual_seed(0))
    assert set(batch[:, 0].tolist()) == set(range(8))
    assert torch.equal(batch - batch[:, :1], torch.arange(33).expand(400, 33))


def test_a_corpus_of_exactly_one_window_is_enough():
    """A corpus of exactly one window has one window to train on; the refusal is for fewer tokens."""
    from treeflash.train.corpus import TokenWindows
    with pytest.raises(UsageError, match="has 32 tokens, fewer than one window of 33"):
        TokenWindows(np.arange(32), 33, torch.device("cpu"))
    w = TokenWindows(np.arange(33), 33, torch.device("cpu"))
    assert w.sample(2, torch.Generator().manual_seed(0)).tolist() == [list(range(33))] * 2


def test_the_held_out_loss_is_the_exported_models_next_token_loss(data_dir, tmp_path, monkeypatch):
    """The summary's held-out loss is the exported model's mean next-token cross-entropy
    (transformers as the oracle) over the held-out windows of seq_len + 1 tokens, each token
    weighing alike across uneven batches; training windows are seq_len + 1 tokens too, and
    tokens_seen counts the tokens predicted."""
    import transformers  # the test extra: the oracle

    import treeflash.train.target as target_mod
    from treeflash.train.corpus import fixed_windows
    shapes = []
    lm_loss = target_mod.lm_loss
    monkeypatch.setattr(target_mod, "lm_loss", lambda model, w: shapes.append(tuple(w.shape)) or lm_loss(model, w))
    opts = TrainOptions(**{**OPTS, "max_steps": 12, "batch_size": 3, "eval_every": 12})
    summary = train_target(data_dir, tmp_path / "run", tmp_path / "model", TINY, opts, dtype="float32")
    S = OPTS["seq_len"]
    assert shapes[0] == (3, S + 1) and {s[1] for s in shapes} == {S + 1}
    assert summary["tokens_seen"] == 12 * 3 * S
    held = fixed_windows(load_corpus(data_dir).heldout, S + 1, OPTS["eval_tokens"])
    assert held.shape[0] % 3 and summary["heldout_tokens_evaluated"] == held.shape[0] * S
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    with torch.no_grad():
        logits = model(held[:, :-1]).logits
    oracle = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), held[:, 1:].reshape(-1)).item()
    assert summary["eval_loss"] == pytest.approx(oracle, abs=2e-4)


def test_held_out_loss_weighs_every_token_and_perplexity_is_its_exponential(monkeypatch):
    """Batches of held-out windows are averaged by their tokens (a short last batch counts
    less), and the perplexity is exp(loss) above e^5 too."""
    import treeflash.train.target as target_mod
    windows = torch.tensor([[6] * 5] * 3 + [[12] * 5])
    monkeypatch.setattr(target_mod, "lm_loss", lambda model, w: w[:, 0].float().mean())
    out = target_mod.evaluate_lm(None, windows, 3, torch.device("cpu"))
    assert out == {"eval_loss": 7.5, "eval_ppl": round(math.exp(7.5), 3)}


def test_a_target_shape_of_zero_theta_or_bool_sizes_is_refused():
    """--rope-theta must be above 0, and a size given as True is not the integer 1."""
    from dataclasses import replace

    from treeflash.train.target import TARGET_SHAPE
    base = TargetShape(**TARGET_SHAPE)
    assert base.check() is base
    for change, words in ((dict(rope_theta=0.0), "--rope-theta must be a finite number > 0, got 0.0"),
                          (dict(num_layers=True), "--num-layers must be a positive integer, got True"),
                          (dict(rope_theta=True), "--rope-theta must be a finite number > 0, got True")):
        with pytest.raises(UsageError, match=words):
            replace(base, **change).check()


def test_rope_theta_and_dtype_flags_reach_the_model_loaders_read(data_dir, tmp_path):
    """`train target --rope-theta 500 --dtype float32`: loaders (treeflash, transformers 5)
    read the RoPE base from rope_parameters, so it is 500 there too; the weights are float32,
    and config.json claims no attention biases the weights do not hold."""
    from treeflash.config import ModelConfig
    flags = ["--hidden-size", "32", "--num-layers", "2", "--num-heads", "2", "--num-kv-heads", "1", "--head-dim",
             "16", "--intermediate-size", "64"] + [f"--{k.replace('_', '-')}={v}" for k, v in OPTS.items()]
    assert cli_main(["target", "--data", str(data_dir), "--run", str(tmp_path / "run"), "--rope-theta", "500",
                     "--dtype", "float32", "--max-steps", "1", *flags]) == 0
    folder = tmp_path / "run" / "model"
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0}
    assert ModelConfig.from_pretrained(folder).rope_theta == 500.0 and config["torch_dtype"] == "float32"
    tensors = _tensors(folder)
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    # the config describes the weights: no attention biases (a strict loader would want them)
    assert config["attention_bias"] is False and not any(n.endswith(".bias") for n in tensors)


def test_the_exported_tokenizer_names_its_special_tokens(target, tmp_path):
    """transformers reads EOS, PAD and MASK (no BOS) from the exported tokenizer, as a user
    batching prompts needs them; model_max_length is the one asked for."""
    import transformers  # the test extra: the oracle
    base, _ = target
    tok = transformers.AutoTokenizer.from_pretrained(base / "model")
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id, tok.bos_token) == (0, 1, 2, None)
    train_tokenizer(["def f(x):\n    return x\n"] * 4, tmp_path / "tok", vocab_size=300, model_max_length=77)
    assert json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["model_max_length"] == 77


def test_a_word_after_indentation_is_the_same_piece_as_after_one_space(data_dir):
    """Pre-tokenization, as Qwen / Llama 3 split: a run of spaces before a word leaves its
    last space to the word, so an indented `return` is the ` return` of mid-line text."""
    from tokenizers import Tokenizer
    pre = Tokenizer.from_file(str(data_dir / "tokenizer.json")).pre_tokenizer
    assert [p for p, _ in pre.pre_tokenize_str("x = 1\n    return x\n")] == \
        ["x", "Ġ=", "Ġ1", "Ċ", "ĠĠĠ", "Ġreturn", "Ġx", "Ċ"]


def test_size_and_list_arguments():
    """--max-bytes G is 2^30 bytes (any case); --target-layer-ids takes spaces and a
    trailing comma."""
    from treeflash.train.cli import _int_list, _size
    assert [_size(t) for t in ("1G", "2g", "1GiB", "3k", "7")] == [1 << 30, 2 << 30, 1 << 30, 3 << 10, 7]
    assert _int_list("1, 3,5,") == [1, 3, 5]


def test_generate_cli_passes_its_options_and_defaults(target, data_dir, tmp_path, capsys):
    """`train generate` defaults to 64 prompt + 448 new tokens (refused by a target of
    context 32) and seed 0 (the library's), and passes --heldout-prompts."""
    base, _ = target
    common = ["generate", "--target", str(base / "model"), "--data", str(data_dir), "--device", "cpu"]
    capsys.readouterr()
    assert cli_main([*common, "--out", str(tmp_path / "d.npz")]) == 2
    assert "prompt_len + new_tokens = 512 exceeds the target's context of 32" in capsys.readouterr().err
    assert cli_main([*common, "--out", str(tmp_path / "c.npz"), "--num-prompts", "3", "--prompt-len", "4",
                     "--new-tokens", "2", "--heldout-prompts", "2"]) == 0
    generate_continuations(base / "model", data_dir, tmp_path / "f.npz", num_prompts=3, prompt_len=4, new_tokens=2,
                           device="cpu", heldout_prompts=2)
    with np.load(tmp_path / "c.npz") as c, np.load(tmp_path / "f.npz") as f:
        assert c["heldout_ids"].shape == (2, 6) and all(np.array_equal(c[k], f[k]) for k in ("ids", "heldout_ids"))


def test_drafter_cli_passes_max_shard_mb(target, data_dir, tmp_path):
    """`train drafter --max-shard-mb` shards the drafter's export."""
    base, _ = target
    assert cli_main(["drafter", "--target", str(base / "model"), "--data", str(data_dir), "--run",
                     str(tmp_path / "run"), "--block-size", "4", "--max-steps", "1", "--tau-prompts", "0",
                     "--batch-size", "2", "--seq-len", "32", "--eval-tokens", "256", "--device", "cpu",
                     "--max-shard-mb", "0.01"]) == 0
    assert len(list((tmp_path / "run" / "model").glob("*.safetensors"))) > 1


def test_the_tokenizer_learns_from_the_training_split_only(tmp_path, capsys):
    """`train tokenizer` trains on the files it counts, the training split: the held-out
    text stays unseen (no merge learned from it alone)."""
    src = _corpus_files(tmp_path / "src", 20)
    held = collect([src], heldout_fraction=0.3).heldout
    assert held
    for f in src.iterdir():
        if f.read_text() in held:
            f.write_text(f"# {f.name}\n" + ("zzzz " * 20 + "\n") * 25)
    assert cli_main(["tokenizer", "--out", str(tmp_path / "tok"), "--roots", str(src), "--heldout-fraction", "0.3",
                     "--vocab-size", "300"]) == 0
    assert f"training on {20 - len(held)} files" in capsys.readouterr().out
    assert len(collect([src], heldout_fraction=0.3).heldout) == len(held)
    vocab = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["model"]["vocab"]
    assert not any("zz" in t for t in vocab)


def test_a_target_run_resumes_only_on_its_own_corpus(target, data_dir, tmp_path):
    """A corpus re-made in the same tokenizer from other text (its token counts differ) is
    not the one a target run trained on: --resume refuses it."""
    base, _ = target
    run = shutil.copytree(base / "run", tmp_path / "run")
    other = write_corpus(data_dir, tmp_path / "other", [_corpus_files(tmp_path / "src", 30)], heldout_fraction=0.25)
    assert other["train_tokens"] != load_corpus(data_dir).train.size
    with pytest.raises(UsageError, match="is not the one this run trained on"):
        train_target(tmp_path / "other", run, tmp_path / "model", opts=TrainOptions(max_steps=41), resume=True)
