"""bad_words (vLLM's): a word's last token is banned where the output so far ends with
its other tokens, so no output holds a bad word's tokens (as the tokenizer writes the
word, alone or after a space).

What a user relies on: the output never holds them (the prompt may); the ban changes
the output only where a word would complete; every method gives AR's tokens with them
(each tree node matched against its own path), greedy and sampled, beside requests
without; the API, the server and the command line take them, and refuse what they
cannot hold with a one-line error.
"""
from __future__ import annotations

import json

import pytest
import torch

from treeflash import LLM, SamplingParams, UsageError
from treeflash.engine.options import builtin_paths
from treeflash.engine.sampling import _recent_tokens
from cpu_graphs import cpu_graphs
from tree_oracle import tree_of_logprobs

PROMPTS = ["def add(a, b):\n    ", "def f(x):\n    if x:\n        return x\n    "]
WORDS = [["return"], ["a + b", "return x"], ["self", " x"]]


@pytest.fixture(scope="module")
def engines():
    target, drafter = builtin_paths()
    return {m: LLM(target, draft_model=None if m == "ar" else drafter, method=m, device="cpu", dtype="float32",
                   **({"budget": b} if m == "ddtree" else {}))
            for m, b in (("ar", None), ("dflash", None), ("ddtree", 24))}


def _holds(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i:i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


@pytest.mark.parametrize("words", WORDS)
def test_every_method_gives_ar_tokens_without_the_words(engines, words):
    """Greedy and sampled, beside a request without bad words: DFlash and DDTree give
    AR's tokens, no output holds a banned sequence, and the ban changed something."""
    ar = engines["ar"]
    params = [SamplingParams(max_new_tokens=32, bad_words=words),
              SamplingParams(max_new_tokens=32, bad_words=words, temperature=1.0, seed=3),
              SamplingParams(max_new_tokens=32, temperature=1.0, seed=3)]
    sequences = ar.rules.bad_sequences(params[0])
    changed = False
    for prompt in PROMPTS:
        outs = {m: [o.token_ids for o in e.generate([prompt] * 3, params)] for m, e in engines.items()}
        assert outs["dflash"] == outs["ar"] and outs["ddtree"] == outs["ar"], prompt
        for out in outs["ar"][:2]:
            assert not any(_holds(out, s) for s in sequences), (prompt, out)
        free = ar.generate(prompt, SamplingParams(max_new_tokens=32))[0].token_ids
        changed |= free != outs["ar"][0]
    assert changed, "no bad word would have come: the test checks nothing"


def test_the_prompt_may_hold_them(engines):
    """Matching looks at the output only (vLLM's): a word the prompt ends with half
    written is not completed against it."""
    ar = engines["ar"]
    seq = ar.rules.bad_sequences(SamplingParams(bad_words=["return x"]))[0]
    prompt = ar.tokenizer.encode("def f(x):\n    if x:\n        ", special=False) + seq[:-1]
    free = ar.generate(prompt, SamplingParams(max_new_tokens=4))[0].token_ids
    banned = ar.generate(prompt, SamplingParams(max_new_tokens=4, bad_words=["return x"]))[0].token_ids
    assert free[0] == seq[-1] and banned == free


def test_recent_tokens_follow_each_nodes_path():
    """A row's last K output tokens: the committed ones, then its path below the root,
    against a walk up the parents, on random trees."""
    gen = torch.Generator().manual_seed(0)
    B, D, V, K = 3, 6, 40, 5
    tree = tree_of_logprobs(torch.randn(B, D, V, generator=gen).log_softmax(-1), torch.randint(0, V, (B,), generator=gen), 30)
    recent = torch.randint(0, V, (B, K), generator=gen)
    recent[0, :2] = -1  # a short output
    got = _recent_tokens(recent, (tree.tokens, tree.ancestors), tree.tokens.shape[1])
    for b in range(B):
        for t in range(tree.tokens.shape[1]):
            path, node = [], t
            while node != 0:
                path.append(int(tree.tokens[b, node]))
                node = int(tree.parents[b, node])
            want = (recent[b].tolist() + path[::-1])[-K:]
            assert got[b, t].tolist() == want, (b, t)


def test_the_history_keeps_only_committed_tokens():
    """After a round that committed 2 of its 4 tokens, a request's recent tokens are those
    2 after what came before (none here): not the round's unaccepted rest, which would
    make a later bad word of 3 tokens match where it should not, or not where it should."""
    from treeflash.engine.sampling import SamplingBatch
    sb = SamplingBatch.from_params([SamplingParams(bad_words=["x"])], "cpu", 16, [[1]], [set()],
                                   bad_sequences=[[[3, 4, 5]]])
    sb.extend_history(torch.tensor([[5, 6, 9, 9]]), torch.tensor([2]))
    recent = sb.recent[0].tolist()
    assert recent[-2:] == [5, 6] and set(recent[:-2]) == {-1}
    sb.extend_history(torch.tensor([[7, 8, 8, 8]]), torch.tensor([1]))
    assert sb.recent[0].tolist()[-3:] == [5, 6, 7]


def test_a_word_the_tokenizer_writes_two_ways(engines):
    """As vLLM: the word as written, and after a space where that is another first token
    of as many tokens; a word longer than the limit is refused."""
    ar = engines["ar"]
    seqs = ar.rules.bad_sequences(SamplingParams(bad_words=["return", "  return"]))
    assert seqs[0] == ar.tokenizer.encode("return", special=False)
    assert ar.tokenizer.encode(" return", special=False) in seqs and len(seqs) == 4  # leading blanks: the same
    with pytest.raises(UsageError, match="is 10 tokens") as err:
        ar.generate("x", SamplingParams(bad_words=["a b c d e f g h i j"]))
    assert err.value.param == "bad_words"


def test_a_word_the_tokenizer_drops_is_refused(tmp_path):
    """A word whose text the tokenizer's normalizer removes (a zero-width space under a
    BERT normalizer) has no tokens to ban: refused in one line, not an IndexError."""
    from tokenizers import Tokenizer, normalizers

    from treeflash.checkpoints import write_random_target
    folder = write_random_target(tmp_path / "m", num_layers=1)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.normalizer = normalizers.Sequence([normalizers.Replace("\u200b", ""), normalizers.NFC()])
    tok.save(str(folder / "tokenizer.json"))
    llm = LLM(folder, device="cpu", dtype="float32")
    assert llm.tokenizer.encode("\u200b", special=False) == []
    with pytest.raises(UsageError, match="bad word '\\\\u200b' has no tokens") as err:
        llm.generate("x", SamplingParams(max_new_tokens=2, bad_words=["\u200b"]))
    assert err.value.param == "bad_words"


@pytest.mark.parametrize("value", [["ok", ""], ["   "], "word", [3], [None]])
def test_bad_words_must_be_words(value):
    with pytest.raises(UsageError, match="bad_words must be a list of words"):
        SamplingParams(bad_words=value)


def test_a_graphed_state_starts_each_request_with_no_output(monkeypatch):
    """A kept (graphed) state's recent tokens are the last request's: a new request's
    first tokens must not be matched against them."""
    target, drafter = builtin_paths()
    llm = cpu_graphs(monkeypatch, LLM(target, draft_model=drafter, method="ddtree", budget=16, device="cpu",
                                       dtype="float32"))
    fresh = LLM(target, method="ar", device="cpu", dtype="float32")
    params = SamplingParams(max_new_tokens=16, bad_words=["a + b", "return x"])
    for prompt in PROMPTS + ["def add(a, b):\n    return a + ", PROMPTS[0]]:
        assert llm.generate(prompt, params)[0].token_ids == fresh.generate(prompt, params)[0].token_ids, prompt
    assert llm.graph_captures > 0


def test_server_and_command_line(engines, capsys):
    TestClient = pytest.importorskip("starlette.testclient").TestClient

    from treeflash.cli import main
    from treeflash.server.app import build_app
    client = TestClient(build_app(engines["ddtree"], "m"))
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
    free = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    banned = client.post("/v1/completions", json={**body, "bad_words": ["return x"]}).json()["choices"][0]["text"]
    assert "return x" in free and "return x" not in banned
    for bad, message in ((["a b c d e f g h i j"], "tokens (at most 8)"), ("return", "list of strings"),
                         (["\ud800"], "not valid Unicode")):  # a lone surrogate: a client cut a character
        r = client.post("/v1/completions", content=json.dumps({**body, "bad_words": bad}),
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
        assert message in r.json()["error"]["message"]
    assert main(["generate", PROMPTS[1], "--device", "cpu", "--max-new-tokens", "12", "--bad-word", "return x"]) == 0
    assert "return x" not in capsys.readouterr().out


def test_logprobs_stay_those_of_the_raw_logits(engines):
    """The ban writes into a copy: a banned token's reported log-probability is the
    model's (vLLM's raw logprobs), not -inf."""
    ar = engines["ar"]
    prompt = ar.tokenizer.encode(PROMPTS[1], special=False)
    free = ar.generate(prompt, SamplingParams(max_new_tokens=3, logprobs=2))[0]
    banned = ar.generate(prompt, SamplingParams(max_new_tokens=3, logprobs=2, bad_words=["return x"]))[0]
    (seq,) = [s for s in ar.rules.bad_sequences(SamplingParams(bad_words=["return x"])) if s == free.token_ids[:2]]
    assert banned.token_ids[0] == seq[0] and banned.token_ids[1] != seq[1]
    top = dict(banned.logprobs[1].top)
    assert seq[1] in top and top[seq[1]] > -1e30
