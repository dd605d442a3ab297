"""Speculative decoding end to end (issues 3 and 4): DFlash chains and DDTree trees
give exactly the AR tokens (greedy, float64 on CPU), each committed position is
projected into the drafter's context once, one target forward per round, a perfect
drafter commits whole blocks, and bad drafters / budgets fail with one clear line."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import CONSTANT_TOKEN, SPEC_PROMPTS
from treeflash import LLM, SamplingParams, TreeflashError, UsageError
from treeflash.checkpoints import write_random_drafter, write_random_target
from treeflash.cli import main as cli_main
from treeflash.engine.round import PREFILL_ALIGN
from treeflash.engine.sampling import SamplingBatch
from treeflash.layers.attention import AttentionInputs

GREEDY64 = SamplingParams(max_new_tokens=64)
SINGLES, BATCHES = SPEC_PROMPTS[:5], [SPEC_PROMPTS[5:10], SPEC_PROMPTS[10:15], SPEC_PROMPTS[15:20]]


class RoundLog:
    """Wraps `llm.decoder.round` to see every round's batch state, new tokens and
    counts, and hooks the target and drafter modules to count their forward passes."""

    def __init__(self, llm: LLM):
        self.llm, self.state = llm, None
        self.rounds: list[dict] = []
        self.forwards = self.draft_forwards = 0
        inner = llm.decoder.round

        def round_(st, max_n):
            self.state = st
            new, counts, logprobs = inner(st, max_n)
            self.rounds.append(dict(new=new.clone(), counts=counts.clone()))
            return new, counts, logprobs

        llm.decoder.round = round_
        llm.target.register_forward_hook(lambda *_: self._count())
        self.projections: list[int] = []  # rows (positions) each drafter context projection handled
        if llm.drafter is not None:
            llm.drafter.register_forward_hook(lambda *_: self._count_draft())
            project = llm.drafter.context_kv

            def context_kv(features, positions):
                self.projections.append(features.shape[1])
                return project(features, positions)

            llm.drafter.context_kv = context_kv

    def _count(self):
        self.forwards += 1

    def _count_draft(self):
        self.draft_forwards += 1

    def generate(self, prompts, params):
        self.rounds, self.state, self.projections = [], None, []
        forwards, drafts = self.forwards, self.draft_forwards
        outs = self.llm.generate(prompts, params)
        # one target forward for the prefill, then exactly one per round, whatever the tree;
        # and one drafter forward per round (none for AR)
        assert self.forwards - forwards == 1 + len(self.rounds)
        assert self.draft_forwards - drafts == (0 if self.llm.drafter is None else len(self.rounds))
        return outs

    def committed_and_rounds(self) -> tuple[int, int]:
        """(tokens committed, request-rounds) over active requests: their ratio is τ."""
        committed = sum(int(r["counts"].sum()) for r in self.rounds)
        active = sum(int((r["counts"] > 0).sum()) for r in self.rounds)
        return committed, active


def spec_llm(target, drafter, method, budget=None, **kw):
    return LLM(target, draft_model=drafter, method=method, budget=budget, device="cpu", dtype="float64", **kw)


def assert_drafts_lossless(target, drafter, method, budget, ar_reference, max_new_tokens: int = 32) -> None:
    """`run_lossless` of a float64 spec engine on (target, drafter), whose drafts must be
    accepted at times (else the commit paths went untested)."""
    tau = run_lossless(spec_llm(target, drafter, method, budget), target, ar_reference,
                       SamplingParams(max_new_tokens=max_new_tokens))
    assert tau > 1.05, "no draft accepted: the commit paths went untested"


def run_lossless(llm: LLM, target, ar_reference, params=GREEDY64) -> float:
    """20 prompts x 64 tokens: 5 alone, 15 in three mixed-length batches of 5 (with
    prompts of length 1); every request must give the AR tokens. Returns the τ seen."""
    log = RoundLog(llm)
    committed = rounds = 0
    for group in [[p] for p in SINGLES] + BATCHES:
        outs = log.generate(group, params)
        for prompt, out in zip(group, outs):
            ref = ar_reference(target, prompt, params)
            assert out.token_ids == ref.token_ids, f"prompt of length {len(prompt)} diverges from AR"
            assert out.finish_reason == ref.finish_reason
        c, r = log.committed_and_rounds()
        committed, rounds = committed + c, rounds + r
    return committed / rounds


# ----------------------------------------------------------------------------- lossless (issue 3)

@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("kind", ["peaked", "plain"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_dflash_greedy_is_lossless(arch, kind, block_size, spec_target, spec_drafter, ar_reference):
    target = spec_target(arch, kind)
    llm = spec_llm(target, spec_drafter(arch, kind, block_size), "dflash")
    tau = run_lossless(llm, target, ar_reference)
    print(f"dflash {arch} {kind} b={block_size}: tau {tau:.3f}")
    if kind == "peaked":
        assert tau > 1.02, "no draft token accepted: the accept/commit path went untested"


# ----------------------------------------------------------------------------- lossless (issue 4)

@pytest.mark.parametrize("budget", [1, 4, 15, 64, 256])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_ddtree_greedy_is_lossless(arch, budget, spec_target, spec_drafter, ar_reference):
    target = spec_target(arch, "peaked")
    block_size = {4: 8, 256: 8}.get(budget, 16)  # the widest tree on the shorter block keeps the test fast
    llm = spec_llm(target, spec_drafter(arch, "peaked", block_size), "ddtree", budget)
    tau = run_lossless(llm, target, ar_reference)
    print(f"ddtree {arch} N={budget}: tau {tau:.3f}")
    assert tau > 1.02, "no draft token accepted: the accept/commit path went untested"


def test_drafter_scales_shape_the_draft_and_stay_lossless(spec_target, spec_drafter, clone_checkpoint,
                                                         ar_reference, monkeypatch):
    """A drafter with the reference's input_embedding_scale / output_multiplier /
    final_logit_softcapping drafts from scaled embeddings and capped logits (what it was
    trained with), and its rounds still give AR's tokens."""
    target, drafter = spec_target("qwen3", "peaked"), spec_drafter("qwen3", "peaked", 8)
    scaled = clone_checkpoint(drafter, input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=3.0)
    llm, plain = spec_llm(target, scaled, "ddtree", 8), spec_llm(target, drafter, "ddtree", 8)
    run_lossless(llm, target, ar_reference)
    logits = {}
    for name, engine in (("scaled", llm), ("plain", plain)):
        build = engine.decoder.tree_from_logits
        monkeypatch.setattr(engine.decoder, "tree_from_logits",
                            lambda lg, st, name=name, build=build: build(logits.setdefault(name, lg), st))
        if name == "plain":  # the plain drafter, fed the doubled embeddings by hand
            forward = engine.drafter.forward
            monkeypatch.setattr(engine.drafter, "forward", lambda embeds, *a, f=forward: f(embeds * 2.0, *a))
        engine.generate(SPEC_PROMPTS[3], SamplingParams(max_new_tokens=4))
    # the first round's draft: both engines hold the same prefilled context
    assert torch.allclose(logits["scaled"], torch.tanh(logits["plain"] * 0.5 / 3.0) * 3.0, atol=1e-6)
    assert not torch.allclose(logits["scaled"], logits["plain"])


@pytest.mark.parametrize("budget", [7, 64])
def test_ddtree_greedy_is_lossless_plain_target(budget, spec_target, spec_drafter, ar_reference):
    target = spec_target("llama", "plain")
    run_lossless(spec_llm(target, spec_drafter("llama", "plain", 8), "ddtree", budget), target, ar_reference)


def test_ddtree_beats_chain_on_peaked_target(spec_target, spec_drafter):
    """The point of the tree: with the same drafter, 64 nodes accept more per round than the chain."""
    target, drafter = spec_target("qwen3", "peaked"), spec_drafter("qwen3", "peaked", 8)
    taus = {}
    for method, budget in (("dflash", None), ("ddtree", 64)):
        log = RoundLog(spec_llm(target, drafter, method, budget))
        log.generate(BATCHES[0], GREEDY64)
        c, r = log.committed_and_rounds()
        taus[method] = c / r
    assert taus["ddtree"] > taus["dflash"]


# ----------------------------------------------------------------------------- EOS / max tokens mid-block

def committed_streams(log: RoundLog, outs) -> list[list[list[int]]]:
    """Per request, the tokens of each commit: [first token], then each round's."""
    return [[[o.token_ids[0]]] + [r["new"][b, : r["counts"][b]].tolist() for r in log.rounds if r["counts"][b] > 0]
            for b, o in enumerate(outs)]


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 32)])
def test_stops_at_eos_mid_block_like_ar(method, budget, spec_target, spec_drafter, clone_checkpoint,
                                        ar_reference):
    """With EOS = a token the target really emits, speculative requests stop exactly
    where AR stops, even when the EOS sits inside an accepted block (the tokens
    committed after it are dropped), and the rest of the batch carries on."""
    base, drafter = spec_target("qwen3", "peaked"), spec_drafter("qwen3", "peaked", 8)
    prompts = SPEC_PROMPTS[:8]
    # probe without EOS: pick a token whose first occurrence in some request was
    # committed with more tokens after it in the same round (EOS does not change the rounds)
    probe = RoundLog(spec_llm(base, drafter, method, budget))
    streams = committed_streams(probe, probe.generate(prompts, GREEDY64))
    inside = {}
    for chunks in streams:
        seen = set()
        for chunk in chunks:
            for i, t in enumerate(chunk):
                if t not in seen and i < len(chunk) - 1:
                    inside[t] = inside.get(t, 0) + 1
                seen.add(t)
    eos = max(sorted(inside), key=lambda t: (inside[t], -t))
    target = clone_checkpoint(base, eos_token_id=eos)
    refs = [ar_reference(target, p, GREEDY64) for p in prompts]
    assert any(r.finish_reason == "stop" for r in refs) and any(r.finish_reason == "length" for r in refs)
    log = RoundLog(spec_llm(target, drafter, method, budget))
    mid_block = 0
    for group in ([prompts[0]], prompts[:4], prompts[4:]):
        outs = log.generate(group, GREEDY64)
        for prompt, out, chunks in zip(group, outs, committed_streams(log, outs)):
            ref = ar_reference(target, prompt, GREEDY64)
            assert (out.token_ids, out.finish_reason) == (ref.token_ids, ref.finish_reason)
            if out.finish_reason == "stop":
                assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
                mid_block += any(eos in chunk[:-1] for chunk in chunks)
    print(f"EOS {eos} ({method}): {mid_block} requests stopped inside a block")
    assert mid_block > 0, "EOS never landed inside a block: the mid-block stop went untested"


def test_stops_at_max_tokens_mid_block(constant_pair, spec_target, spec_drafter, ar_reference):
    """A token limit that falls inside an accepted block cuts the block: exactly
    max_new_tokens tokens, finish_reason 'length', the AR tokens."""
    target, perfect, _ = constant_pair(8)
    llm = spec_llm(target, perfect, "dflash")
    log = RoundLog(llm)
    params = SamplingParams(max_new_tokens=21)  # 1 (prefill) + 8 + 8 + 4 of the third block
    outs = log.generate([[5], [9, 10, 11]], params)
    # the third block commits 8, 4 are kept; the 4th round was in flight (pipelined) when
    # the host read the third: it ran, and its tokens were discarded
    assert [r["counts"].tolist() for r in log.rounds] == [[8, 8]] * 4
    assert all(o.token_ids == [CONSTANT_TOKEN] * 21 and o.finish_reason == "length" for o in outs)
    target = spec_target("llama", "peaked")
    llm = spec_llm(target, spec_drafter("llama", "peaked", 16), "ddtree", 64)
    for limit in (1, 2, 13, 37):
        params = SamplingParams(max_new_tokens=limit)
        outs = llm.generate(SPEC_PROMPTS[:4], params)
        for prompt, out in zip(SPEC_PROMPTS[:4], outs):
            ref = ar_reference(target, prompt, GREEDY64)
            assert out.token_ids == ref.token_ids[:limit] and out.finish_reason == "length"


# ----------------------------------------------------------------------------- load contexts once

def fresh_caches(llm: LLM, seq: list[int]):
    """Target K/V and drafter context K/V of `seq` computed from scratch (one prefill)."""
    ids = torch.tensor([seq])
    positions = torch.arange(len(seq))[None]
    cache = llm.target.new_cache(1, len(seq) + 1, torch.device("cpu"))
    with torch.inference_mode():
        _, feats = llm.target(ids, AttentionInputs.causal(positions, kv_len=len(seq)), cache,
                              llm.drafter.target_layer_ids)
        ctx = llm.drafter.context_kv(feats, positions)
    return cache, ctx


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 48)])
def test_contexts_are_loaded_once(method, budget, spec_target, spec_drafter, clone_checkpoint, ar_reference):
    """The drafter's context is projected once per position: the prefill projects the
    prompt, each round only its own block, and a finished request commits nothing more.
    What sits in both caches is exactly what a fresh prefill of the committed sequence
    gives: the tree's accepted path (not the rejected branches) was moved into place
    and projected."""
    base = spec_target("qwen3", "peaked")
    drafter = spec_drafter("qwen3", "peaked", 8)
    prompts = [SPEC_PROMPTS[0], SPEC_PROMPTS[4], SPEC_PROMPTS[6], SPEC_PROMPTS[3]]  # lengths 1, 1, 21, 3
    # EOS: a token the first request emits after a few tokens and another request never does
    probes = [ar_reference(base, p, GREEDY64).token_ids[:40] for p in prompts]
    eos = next(t for t in probes[0][4:] if any(t not in other for other in probes[1:]))
    target = clone_checkpoint(base, eos_token_id=eos)
    llm = spec_llm(target, drafter, method, budget)
    log = RoundLog(llm)
    outs = log.generate(prompts, SamplingParams(max_new_tokens=40))
    assert outs[0].finish_reason == "stop" and any(o.finish_reason == "length" for o in outs)
    st = log.state
    committed = sum(r["counts"] for r in log.rounds)
    lens = torch.tensor([len(p) for p in prompts])
    assert torch.equal(st.n, lens + committed)
    # the prompt is projected once by the prefill (the batch padded to a multiple of
    # PREFILL_ALIGN), then each round projects only its own block of at most b
    # positions, however long the prefix has grown
    padded = -(-max(lens.tolist()) // PREFILL_ALIGN) * PREFILL_ALIGN
    assert log.projections == [padded] + [llm.drafter.block_size] * len(log.rounds)
    # once a request has all its tokens it commits nothing more, after the one round
    # that was in flight (pipelined) when the host saw it finish
    for b, out in enumerate(outs):
        have, after = 1, 0
        for r in log.rounds:
            if have >= len(out.token_ids):
                after += 1
                assert after == 1 or int(r["counts"][b]) == 0
            have += int(r["counts"][b])
    assert int(log.rounds[-1]["counts"][0]) == 0
    c, rr = log.committed_and_rounds()
    print(f"contexts {method}: EOS {eos}, finish {[o.finish_reason for o in outs]}, tau {c / rr:.3f}")
    assert c / rr > 1.02, "no draft token accepted"
    for b, prompt in enumerate(prompts):
        seq = list(prompt) + [outs[b].token_ids[0]]
        for r in log.rounds:
            seq += r["new"][b, : r["counts"][b]].tolist()
        n = int(st.n[b])
        assert len(seq) == n + 1  # committed positions + the next anchor
        assert seq[len(prompt): len(prompt) + len(outs[b].token_ids)] == outs[b].token_ids
        cache, ctx = fresh_caches(llm, seq[:n])
        torch.testing.assert_close(st.cache.k[:, b, :, :n], cache.k[:, 0, :, :n], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(st.cache.v[:, b, :, :n], cache.v[:, 0, :, :n], rtol=1e-9, atol=1e-9)
        for i, (k, v) in enumerate(ctx):
            torch.testing.assert_close(st.draft_cache.k[i][b, :, :n], k[0].transpose(0, 1), rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(st.draft_cache.v[i][b, :, :n], v[0].transpose(0, 1), rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- perfect / useless drafters

@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_perfect_drafter_commits_whole_blocks(block_size, constant_pair, ar_reference):
    """A drafter that always agrees with the target: every DFlash round commits the
    whole block (τ = block size); DDTree with N >= b-1 nodes does too, and with
    N < b-1 nodes it commits N+1 (all nodes are spent on the one right path)."""
    target, perfect, _ = constant_pair(block_size)
    rounds = 3
    params = SamplingParams(max_new_tokens=1 + rounds * block_size)
    prompts = [[5], [9, 10, 11, 12], [3] * 9]
    for method, budget, per_round in (("dflash", None, block_size), ("ddtree", block_size - 1, block_size),
                                      ("ddtree", 64, block_size), ("ddtree", 2, 3)):
        log = RoundLog(spec_llm(target, perfect, method, budget))
        outs = log.generate(prompts, params)
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == ar_reference(target, prompt, params).token_ids == [CONSTANT_TOKEN] * len(out.token_ids)
        assert all(r["counts"].tolist() == [per_round] * 3 for r in log.rounds[:-1])
        if per_round == block_size:
            assert len(log.rounds) == rounds + 1  # and one in flight (pipelined), discarded
            assert outs[0].stats["tau"] == pytest.approx((1 + rounds * block_size) / (1 + rounds), abs=1e-3)


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 64)])
def test_useless_drafter_still_lossless(method, budget, constant_pair):
    """A drafter that is always wrong costs speed, never correctness: τ is exactly 1
    against the constant target (on a real target: the next test)."""
    target, _, useless = constant_pair(8)
    log = RoundLog(spec_llm(target, useless, method, budget))
    outs = log.generate([[5], [6, 7, 8]], GREEDY64)
    assert all(o.token_ids == [CONSTANT_TOKEN] * 64 for o in outs)
    assert all(int(c) == 1 for r in log.rounds for c in r["counts"])


def test_no_signal_drafter_on_real_target(spec_target, ar_reference, tmp_path):
    from safetensors.torch import load_file, save_file
    target = spec_target("qwen3", "peaked")
    drafter = write_random_drafter(target, tmp_path / "zero", block_size=8)
    w = load_file(str(drafter / "model.safetensors"))
    w["norm.weight"].zero_()
    save_file(w, str(drafter / "model.safetensors"))
    for method, budget in (("dflash", None), ("ddtree", 16)):
        log = RoundLog(spec_llm(target, drafter, method, budget))
        outs = log.generate(SPEC_PROMPTS[:4], GREEDY64)
        for prompt, out in zip(SPEC_PROMPTS[:4], outs):
            assert out.token_ids == ar_reference(target, prompt, GREEDY64).token_ids
        c, r = log.committed_and_rounds()
        print(f"no-signal drafter {method}: tau {c / r:.3f}")
        assert c / r < 1.15


# ----------------------------------------------------------------------------- drafters that do not fit

@pytest.fixture(scope="module")
def misfit_drafters(tmp_path_factory, spec_target, spec_drafter, clone_checkpoint):
    """Drafters that do not fit spec_target('qwen3', 'peaked') (hidden 64, 4 layers, vocab 259)."""
    root = tmp_path_factory.mktemp("misfits")
    good = spec_drafter("qwen3", "peaked", 8)
    return {
        "hidden_size": write_random_drafter(write_random_target(root / "t32", hidden_size=32, vocab_size=259),
                                            root / "hidden"),
        "vocab_size": write_random_drafter(write_random_target(root / "t300", vocab_size=300), root / "vocab"),
        "6 layers": write_random_drafter(write_random_target(root / "t6", num_layers=6, vocab_size=259),
                                         root / "layers"),
        "[9]": clone_checkpoint(good, dflash_config={"mask_token_id": 258, "target_layer_ids": [1, 9]}),
        "[-1]": clone_checkpoint(good, num_target_layers=None,
                                 dflash_config={"mask_token_id": 258, "target_layer_ids": [-1, 2]}),
        "mask_token_id": clone_checkpoint(good, dflash_config={"mask_token_id": 259, "target_layer_ids": [1, 2]}),
    }


@pytest.mark.parametrize("what", ["hidden_size", "vocab_size", "6 layers", "[9]", "[-1]", "mask_token_id"])
def test_misfit_drafter_api_error(what, misfit_drafters, spec_target):
    with pytest.raises(TreeflashError) as e:
        spec_llm(spec_target("qwen3", "peaked"), misfit_drafters[what], "dflash")
    assert type(e.value) is TreeflashError  # a model-files problem, not a usage error
    msg = str(e.value)
    assert what in msg and "\n" not in msg and "drafter" in msg


def test_drafter_checkpoint_tensors(spec_target, spec_drafter, tmp_path):
    """A drafter checkpoint may carry a copy of its target's embeddings and LM head
    (training code saves them): skipped, the drafter uses the target's. A layer that
    the drafter's config.json does not have is refused."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    target = spec_target("qwen3", "peaked")
    folder = shutil.copytree(spec_drafter("qwen3", "peaked", 8), tmp_path / "drafter")
    path = next(folder.glob("*.safetensors"))
    w = load_file(str(path))
    w["model.embed_tokens.weight"] = torch.zeros(259, 64)
    w["lm_head.weight"] = torch.zeros(259, 64)
    save_file(w, str(path), metadata={"format": "pt"})
    want = spec_llm(target, spec_drafter("qwen3", "peaked", 8), "dflash").generate(SPEC_PROMPTS[:1], GREEDY64)
    assert spec_llm(target, folder, "dflash").generate(SPEC_PROMPTS[:1], GREEDY64)[0].token_ids == want[0].token_ids
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] -= 1
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TreeflashError, match="no place for: layers"):
        spec_llm(target, folder, "dflash")


@pytest.mark.parametrize("what", ["hidden_size", "vocab_size", "6 layers", "[9]"])
def test_misfit_drafter_cli_error(what, misfit_drafters, spec_target, capsys):
    code = cli_main(["generate", "--model", str(spec_target("qwen3", "peaked")),
                     "--draft-model", str(misfit_drafters[what]), "--device", "cpu", "hello"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("treeflash: error:") and what in err
    assert "Traceback" not in err


def test_misfit_drafter_cli_subprocess(misfit_drafters, spec_target):
    """The installed entry point: exit code 1, one line on stderr, nothing on stdout."""
    proc = subprocess.run([sys.executable, "-m", "treeflash", "generate", "--model",
                           str(spec_target("qwen3", "peaked")), "--draft-model", str(misfit_drafters["vocab_size"]),
                           "--device", "cpu", "hello"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "vocab_size" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


# ----------------------------------------------------------------------------- budgets

@pytest.mark.parametrize("budget,max_budget", [(0, 512), (-1, 512), (-64, 512), (513, 512), (33, 32)])
def test_invalid_budget_api(budget, max_budget, spec_target, spec_drafter):
    with pytest.raises(UsageError, match="budget") as e:
        spec_llm(spec_target("qwen3", "peaked"), spec_drafter("qwen3", "peaked", 8), "ddtree", budget,
                 max_budget=max_budget)
    assert "\n" not in str(e.value)


def test_budget_at_max_budget_works(spec_target, spec_drafter, ar_reference):
    target = spec_target("qwen3", "peaked")
    llm = spec_llm(target, spec_drafter("qwen3", "peaked", 8), "ddtree", 32, max_budget=32)
    out = llm.generate(SPEC_PROMPTS[1], SamplingParams(max_new_tokens=16))[0]
    assert out.token_ids == ar_reference(target, SPEC_PROMPTS[1], GREEDY64).token_ids[:16]


@pytest.mark.parametrize("budget", ["0", "-3", "100000"])
def test_invalid_budget_cli(budget, spec_target, spec_drafter, capsys):
    code = cli_main(["generate", "--model", str(spec_target("qwen3", "peaked")), "--draft-model",
                     str(spec_drafter("qwen3", "peaked", 8)), "--method", "ddtree", "--budget", budget,
                     "--device", "cpu", "hello"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "budget" in err and "Traceback" not in err


# -------------------------------------------------------------------------- the drafter's context K/V

def test_drafter_context_kv_is_its_layers_own_k_and_v():
    """The drafter projects committed target features into its context cache with only
    the k/v rows of each layer's QKV projection: the k (normed, rotated) and v that the
    whole projection gives for those positions, its biases included (a drafter config may
    set attention_bias), as the block's own keys are made."""
    from treeflash.config import DraftConfig
    from treeflash.models.dflash import DFlashDraftModel
    cfg = DraftConfig.from_dict({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 300, "max_position_embeddings": 256, "attention_bias": True, "block_size": 8,
        "num_target_layers": 4, "dflash_config": {"mask_token_id": 2, "target_layer_ids": [1, 2]}})
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg).double()
    for p in drafter.parameters():   # norm weights and biases away from their 1 and 0
        p.data.normal_(0, 0.3)
    assert drafter.layers[0].self_attn.qkv_proj.bias is not None and drafter.layers[0].self_attn.k_norm is not None
    features = torch.randn(2, 5, 2 * 64, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    ctx = drafter.hidden_norm(drafter.fc(features))
    cos, sin = drafter.rotary.cos_sin(positions, ctx.dtype)
    for layer, (k, v) in zip(drafter.layers, drafter.context_kv(features, positions)):
        _, k_all, v_all = layer.self_attn.project_qkv(ctx, cos, sin)
        torch.testing.assert_close(k, k_all, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v, v_all, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- eager read bounds

@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 24), ("ar", None)])
def test_bounded_reads_equal_whole_cache_reads(method, budget, spec_target, spec_drafter):
    """`max_n` only spares eager attention the cache slots past the round's: the draft
    scores, the verify logits, and so the tokens and counts of a round, are those of a
    round that reads the whole cache (as a CUDA graph does), for requests at and below
    max_n."""
    target, drafter = spec_target("qwen3", "peaked"), spec_drafter("qwen3", "peaked", 8)
    llm = spec_llm(target, None if method == "ar" else drafter, method, budget)
    dec, prompts = llm.decoder, [SPEC_PROMPTS[9], SPEC_PROMPTS[2]]
    sampling = SamplingBatch.from_params([GREEDY64] * 2, "cpu")
    results = []
    for bounded in (False, True):
        st = dec.new_state(2, 128, sampling)
        dec.prefill(st, prompts)
        got = []
        with torch.inference_mode():
            for _ in range(3):
                max_n = int(st.n.max()) if bounded else None
                if method != "ar":
                    got.append(dec.draft_logits(st, max_n))
                got.append(dec.verify(st, dec.build(st, max_n), max_n)[0])
                got += [t.clone() for t in dec.round(st, max_n)[:2]]
        results.append(got)
    for whole, bounded in zip(*results):
        assert whole.shape == bounded.shape
        assert torch.allclose(whole.double(), bounded.double(), atol=1e-9, rtol=0)


def test_the_draft_is_the_drafters_training_forward(spec_target, spec_drafter):
    """A round's draft scores (greedy) are those of the drafter's cache-free training
    forward (`forward_dense`): the block [anchor, mask, ...] at positions n.. attending
    to the target's features of the committed tokens and to itself. The drafter the
    engine runs is the one that was trained."""
    llm = spec_llm(spec_target("qwen3", "peaked"), spec_drafter("qwen3", "peaked", 8), "dflash")
    dec, d, prompt = llm.decoder, llm.drafter, SPEC_PROMPTS[9]
    st = dec.new_state(1, 128, SamplingBatch.from_params([GREEDY64], "cpu"))
    dec.prefill(st, [prompt])
    n, b = len(prompt), d.block_size
    with torch.inference_mode():
        got = dec.draft_logits(st)
        cache = llm.target.new_cache(1, n + 1, torch.device("cpu"))
        positions = torch.arange(n)[None]
        _, feats = llm.target(torch.tensor([prompt]), AttentionInputs.causal(positions, kv_len=n), cache,
                              d.target_layer_ids)
        block = torch.tensor([[int(st.anchor[0])] + [d.mask_token_id] * (b - 1)])
        h = d.forward_dense(llm.target.embed(block), n + torch.arange(b)[None], feats, positions,
                            torch.ones(1, b, n + b, dtype=torch.bool))
        want = d.scaled_logits(llm.target.logits(h[:, 1:], gather=False).float())
    assert torch.allclose(got.double(), want.double(), atol=1e-9, rtol=0)


@pytest.mark.parametrize("budget", [24, 64])
def test_the_ddtree_is_the_budget_most_probable_prefixes(budget, spec_target, spec_drafter):
    """A DDTree round verifies the `budget` most probable prefixes of the draft's
    per-depth distributions (best-first search: tree_oracle), not a narrower tree."""
    from tree_oracle import best_prefixes_heap
    llm = spec_llm(spec_target("qwen3", "plain"), spec_drafter("qwen3", "plain", 8), "ddtree", budget)
    dec = llm.decoder
    st = dec.new_state(2, 128, SamplingBatch.from_params([GREEDY64] * 2, "cpu"))
    dec.prefill(st, [SPEC_PROMPTS[9], SPEC_PROMPTS[2]])
    with torch.inference_mode():
        logprobs = torch.log_softmax(dec.draft_logits(st).double(), -1)
        tree = dec.build(st)
    for b in range(2):
        prefixes = set()
        for i in range(1, budget + 1):
            if tree.valid[b, i]:
                path, j = [], i
                while j != 0:
                    path.append(int(tree.tokens[b, j]))
                    j = int(tree.parents[b, j])
                prefixes.add(tuple(reversed(path)))
        assert prefixes == set(best_prefixes_heap(logprobs[b], budget))


# ------------------------------------------------------------------ the drafter against its published forward

def _published_dflash_hidden(folder, features, feature_positions, block_embeds, block_positions):
    """The DFlash drafter's forward as its checkpoint describes it, written out by hand in
    float64 from config.json and the safetensors: the target features through `fc` and
    `hidden_norm` are each layer's context (no input norm); a layer's queries are its block
    tokens' and its keys and values the context's followed by the block's (q/k RMS norms
    with the checkpoint's eps, then RoPE at the config's rope_theta, at each token's own
    position); every block query sees every context key (within `sliding_window` positions
    in a sliding_attention layer) and the whole block; the final `norm` ends it."""
    import json

    import torch.nn.functional as F
    from safetensors.torch import load_file
    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(folder / "model.safetensors")).items()}
    eps, theta, D = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["head_dim"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    assert not any(k.endswith("bias") for k in w)

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x, pos):  # x [B, T, H, D], pos [B, T]
        inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        angle = torch.cat([pos.double()[..., None] * inv] * 2, -1)[:, :, None]
        return x * angle.cos() + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * angle.sin()

    B, M, _ = block_embeds.shape
    ctx = norm(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
    key_positions = torch.cat([feature_positions, block_positions], 1)
    h = block_embeds.double()
    for i, kind in enumerate(types):
        p = f"layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        kv_in = torch.cat([ctx, x], 1)
        q = norm((x @ w[p + "self_attn.q_proj.weight"].T).view(B, M, Hq, D), w[p + "self_attn.q_norm.weight"])
        k = norm((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(B, -1, Hkv, D), w[p + "self_attn.k_norm.weight"])
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(B, -1, Hkv, D)
        q, k = rope(q, block_positions), rope(k, key_positions)
        k, v = k.repeat_interleave(Hq // Hkv, 2), v.repeat_interleave(Hq // Hkv, 2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / D ** 0.5
        if kind == "sliding_attention":
            seen = key_positions[:, None, :] > block_positions[:, :, None] - cfg["sliding_window"]
            scores = scores.masked_fill(~seen[:, None], float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, M, Hq * D)
        h = h + out @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return norm(h, w["norm.weight"])


@pytest.mark.parametrize("changes", [
    # a drafter's own rope_theta and rms_norm_eps (published ones are not their target's)
    dict(rope_theta=1e6, rms_norm_eps=0.05),
    # a sliding first layer whose window (10) is shorter than the committed context (30)
    dict(use_sliding_window=True, sliding_window=10, is_causal=False,
         layer_types=["sliding_attention", "full_attention"]),
], ids=["own-theta-and-eps", "sliding-layer"])
def test_the_draft_is_the_published_dflash_forward(spec_target, spec_drafter, clone_checkpoint, changes):
    """A round's draft scores are the target's LM head over the hidden states the published
    DFlash forward gives (written out by hand above) for the block [anchor, mask, ...] at
    positions n.. over the target's tapped features of the committed tokens: what the
    checkpoint was trained to draft, with its own config, not its target's."""
    target = spec_target("qwen3", "peaked")
    drafter = clone_checkpoint(spec_drafter("qwen3", "peaked", 8), **changes)
    llm = spec_llm(target, drafter, "dflash")
    dec, d, prompt = llm.decoder, llm.drafter, SPEC_PROMPTS[9]
    assert len(prompt) == 30
    st = dec.new_state(1, 128, SamplingBatch.from_params([GREEDY64], "cpu"))
    dec.prefill(st, [prompt])
    n, b = len(prompt), d.block_size
    with torch.inference_mode():
        got = dec.draft_logits(st)
        positions = torch.arange(n)[None]
        _, feats = llm.target(torch.tensor([prompt]), AttentionInputs.causal(positions), None, d.target_layer_ids)
        block = torch.tensor([[int(st.anchor[0])] + [d.mask_token_id] * (b - 1)])
        h = _published_dflash_hidden(drafter, feats, positions, llm.target.embed(block), n + torch.arange(b)[None])
        want = llm.target.logits(h[:, 1:], gather=False)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-6  # float32 scores
