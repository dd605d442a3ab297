"""`treeflash bench` on the CPU: model-pair mode on tiny random checkpoints, shape mode
on the tiny shape (also tensor-parallel: --tp 2 over gloo under torchrun), and one-line
usage errors (exit code 2)."""
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from treeflash.bench import settle_mode_options
from treeflash.bench.pairs import batch_indices
from treeflash.bench.shape import bench_argv
from treeflash.checkpoints import write_random_drafter, write_random_target
from treeflash.cli import build_parser, main
from treeflash.engine.options import builtin_paths

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None

PAIR_FIELDS = {"mode", "method", "budget", "label", "batch_size", "graphs", "temperature", "requests",
               "new_tokens", "batch_rounds", "request_rounds", "seconds", "tokens_per_s", "tau", "ms_per_round", "speedup",
               "vs_dflash", "same_as_ar", "recaptures", "device", "dtype"}
SHAPE_FIELDS = {"mode", "shape", "context", "batch_size", "temperature", "graphs", "op", "N", "time_us",
                "floor_us", "ratio", "vs_ar", "host_us", "bytes", "bandwidth_gbs", "tp", "allreduce_us",
                "allreduces", "allreduce_share", "fp8"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = write_random_target(root / "t", peaked_tokens=8, std=0.2)
    return target, write_random_drafter(target, root / "d", num_layers=1, block_size=8)


def test_pair_mode(pair, tmp_path, capsys):
    target, drafter = pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fib(n):\n" + json.dumps({"prompt": "import os\nimport sys"}) + "\n")
    out, png = tmp_path / "rows.jsonl", tmp_path / "bench.png"
    rc = main(["bench", "--model", str(target), "--draft-model", str(drafter), "--prompt-file", str(prompts),
               "--methods", "ddtree,ar,dflash", "--budgets", "4,8", "--batch-sizes", "1,2", "--graphs", "off",
               "--temperatures", "0,1", "--top-k", "5", "--top-p", "0.9", "--max-new-tokens", "8", "--device", "cpu",
               "--out", str(out), *(["--plot", str(png)] if HAVE_MPL else [])])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 * 2 * 2  # (ar, dflash, ddtree-4, ddtree-8) x batch sizes x temperatures
    assert [r["label"] for r in rows[::4]] == ["ar", "dflash", "ddtree-4", "ddtree-8"]  # AR runs first
    for r in rows:
        assert PAIR_FIELDS <= r.keys()
        assert (r["top_k"], r["top_p"], r["min_p"]) == (5, 0.9, 0.0)  # what sampled requests ran with
        assert r["requests"] == 2 and r["new_tokens"] == 16 and r["graphs"] is False
        assert r["tokens_per_s"] > 0 and r["ms_per_round"] > 0 and r["tau"] >= 1
        assert r["speedup"] > 0
        # tau over the requests' own rounds; ms/round over the rounds the batches ran (a batch's longest request's)
        assert r["tau"] == pytest.approx(r["new_tokens"] / r["request_rounds"], abs=1e-4)
        # (seconds is rounded to 0.1 ms, ms_per_round to 0.1 µs)
        assert abs(r["ms_per_round"] * r["batch_rounds"] - 1e3 * r["seconds"]) <= 0.051 + 1e-4 * r["batch_rounds"]
        assert r["batch_rounds"] * r["batch_size"] >= r["request_rounds"] >= r["batch_rounds"]
        if r["method"] == "ar":
            assert r["tau"] == 1.0 and r["speedup"] == 1.0 and r["same_as_ar"] is None and r["vs_dflash"] is None
        else:
            assert 0 <= r["same_as_ar"] <= 1
            chain = next(c for c in rows if c["method"] == "dflash" and
                         (c["batch_size"], c["temperature"]) == (r["batch_size"], r["temperature"]))
            assert r["vs_dflash"] == round(r["tokens_per_s"] / chain["tokens_per_s"], 3)
    assert {r["budget"] for r in rows if r["method"] == "ddtree"} == {4, 8}
    assert {r["budget"] for r in rows if r["method"] == "dflash"} == {7}  # block 8: chain of 7

    lines = captured.out.splitlines()
    assert "sampled requests with top-k 5, top-p 0.9" in lines[0]
    header = next(i for i, line in enumerate(lines) if line.startswith("method"))
    assert all(h in lines[header] for h in ("tok/s", "tau", "ms/round", "speedup", "vs dflash"))
    table = lines[header + 2:header + 2 + len(rows)]
    assert [line.split()[0] for line in table] == [r["label"] for r in rows]
    assert len({len(line) for line in lines[header:header + 2]}) == 1  # header and rule aligned
    if HAVE_MPL:
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_pair_mode_notes_requests_cut_by_the_context(tmp_path, capsys):
    """tok/s of requests the context stopped early are over fewer tokens than asked for: said."""
    target = write_random_target(tmp_path / "t", max_position_embeddings=48)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fib(n):\n")
    out = tmp_path / "rows.jsonl"
    argv = ["bench", "--model", str(target), "--prompt-file", str(prompts), "--methods", "ar", "--batch-sizes",
            "1", "--graphs", "off", "--temperatures", "0", "--device", "cpu", "--out", str(out)]
    assert main(argv + ["--max-new-tokens", "40"]) == 0
    err = capsys.readouterr().err
    assert "note: 1 of 1 prompts leave less than --max-new-tokens 40 of the context of 48 tokens" in err
    assert json.loads(out.read_text())["new_tokens"] < 40
    out.unlink()
    assert main(argv + ["--max-new-tokens", "8"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert json.loads(out.read_text())["new_tokens"] == 8


def test_pair_mode_with_logprobs(pair, tmp_path, capsys):
    """--logprobs K times requests that also return logprobs (labelled, and the same
    tokens: same_as_ar stays what it is without them); shape mode refuses it."""
    target, drafter = pair
    rows = {}
    for extra in ([], ["--logprobs", "2"]):
        out = tmp_path / f"rows{len(extra)}.jsonl"
        rc = main(["bench", "--model", str(target), "--draft-model", str(drafter), "--methods", "ar,ddtree",
                   "--budgets", "4", "--batch-sizes", "2", "--graphs", "off", "--temperatures", "0",
                   "--max-new-tokens", "6", "--device", "cpu", "--out", str(out), *extra])
        assert rc == 0, capsys.readouterr().err
        rows[len(extra)] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in rows[2]] == ["ar lp2", "ddtree-4 lp2"] and {r["logprobs"] for r in rows[2]} == {2}
    assert [r["same_as_ar"] for r in rows[2]] == [r["same_as_ar"] for r in rows[0]]
    assert main(TINY + ["--logprobs", "2"]) == 2
    assert "--logprobs applies to model-pair mode" in capsys.readouterr().err


def test_pair_mode_with_structured_outputs(tmp_path, capsys):
    """--choice (and --regex, --json-schema) constrain every request: the built-in pair's
    texts are the choices, and every method gives AR's tokens (float32 on CPU)."""
    out = tmp_path / "rows.jsonl"
    rc = main(["bench", "--num-prompts", "2", "--batch-sizes", "1", "--budgets", "8", "--temperatures", "0",
               "--max-new-tokens", "12", "--device", "cpu", "--graphs", "off", "--eos", "--out", str(out),
               "--choice", "return None", "--choice", "pass"])
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["same_as_ar"] == 1.0 for r in rows[1:])
    assert all(r["new_tokens"] < 2 * 12 for r in rows)  # a choice, then EOS: before the token limit


def test_pair_mode_builtin_prompts_fill_batches(pair, tmp_path, capsys):
    """3 prompts in batches of 2: the last batch wraps around (no new graph shape mid-timing)."""
    target, _ = pair
    out = tmp_path / "rows.jsonl"
    rc = main(["bench", "--model", str(target), "--methods", "ar", "--num-prompts", "3", "--batch-sizes", "2",
               "--temperatures", "0", "--max-new-tokens", "4", "--device", "cpu", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["requests"] == 4 and row["new_tokens"] == 16 and row["tau"] == 1.0
    assert batch_indices(3, 2) == [[0, 1], [2, 0]]


def test_pair_mode_builtin_model_brings_its_drafter(tmp_path, capsys):
    """No --model: the built-in pair, drafter included, for the default methods."""
    out = tmp_path / "rows.jsonl"
    rc = main(["bench", "--num-prompts", "1", "--batch-sizes", "1", "--budgets", "4", "--temperatures", "0",
               "--max-new-tokens", "4", "--device", "cpu", "--graphs", "off", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in rows] == ["ar", "dflash", "ddtree-4"]
    assert all(r["same_as_ar"] == 1.0 for r in rows[1:])  # float32 on CPU: lossless


def tiny_corpus(corpus, target):
    """A tokenized training corpus (train and held-out token ids) in the folder `corpus`."""
    import numpy as np
    corpus.mkdir()
    np.save(corpus / "train.npy", (np.arange(4000) % 200 + 3).astype(np.uint16))
    np.save(corpus / "heldout.npy", (np.arange(1000) % 200 + 3).astype(np.uint16))
    (corpus / "corpus.json").write_text(json.dumps({"vocab_size": 4096, "eos_token_id": 0}))
    shutil.copy(target / "tokenizer.json", corpus)   # a corpus keeps the tokenizer that made it
    return corpus


def test_pair_mode_corpus_prompts(pair, tmp_path, capsys):
    """--corpus: token-id prompts from the held-out split of a tokenized training corpus."""
    import numpy as np
    target, _ = pair
    corpus = tiny_corpus(tmp_path / "corpus", target)
    out = tmp_path / "rows.jsonl"
    rc = main(["bench", "--model", str(target), "--methods", "ar", "--corpus", str(corpus), "--num-prompts", "2",
               "--batch-sizes", "1", "--temperatures", "0", "--max-new-tokens", "4", "--device", "cpu",
               "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["requests"] == 2 and row["new_tokens"] == 8
    shutil.copy(Path(builtin_paths()[0]) / "tokenizer.json", corpus)   # another tokenizer: other text
    assert main(["bench", "--model", str(target), "--methods", "ar", "--corpus", str(corpus), "--num-prompts", "2",
                 "--device", "cpu"]) == 2
    assert "tokenized with another tokenizer than the model's" in capsys.readouterr().err
    np.save(corpus / "heldout.npy", np.zeros(0, dtype=np.uint16))  # made with --heldout-fraction 0
    assert main(["bench", "--model", str(target), "--methods", "ar", "--corpus", str(corpus), "--device", "cpu"]) == 2
    assert "has no held-out split" in capsys.readouterr().err


def test_corpus_prompts_fit_a_short_context(tmp_path, capsys):
    """A target trained with --seq-len 64 has a context of 64: --corpus's held-out prompts
    (64 tokens where the context allows) leave room for --max-new-tokens, or take half
    the context, rather than fill it ("prompt of 64 tokens does not fit")."""
    target = write_random_target(tmp_path / "t", max_position_embeddings=64)
    corpus = tiny_corpus(tmp_path / "corpus", target)
    out = tmp_path / "rows.jsonl"
    argv = ["bench", "--model", str(target), "--methods", "ar", "--corpus", str(corpus), "--num-prompts", "2",
            "--batch-sizes", "1", "--graphs", "off", "--temperatures", "0", "--device", "cpu", "--out", str(out)]
    assert main(argv + ["--max-new-tokens", "16"]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["new_tokens"] == 2 * 16 and "note:" not in capsys.readouterr().err
    assert main(argv + ["--max-new-tokens", "128"]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["new_tokens"] == 2 * 32  # prompts of 32: the context's other half
    assert "2 of 2 prompts leave less than --max-new-tokens 128" in capsys.readouterr().err


def test_shape_mode_tiny(tmp_path, capsys):
    out = tmp_path / "shape.jsonl"
    rc = main(["bench", "--shape", "tiny", "--contexts", "32,64", "--budgets", "0,3,7", "--iters", "2",
               "--device", "cpu", "--copy-mib", "8", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ops = [(r["op"], r["N"]) for r in rows if r["context"] == 32]
    assert ops == [("ar", 0), ("verify", 0), ("verify", 3), ("verify", 7), ("draft", 15), ("tree", 3),
                   ("tree", 7), ("round-dflash", 15), ("round", 3), ("round", 7)]
    assert len(rows) == 2 * len(ops)
    for r in rows:
        assert SHAPE_FIELDS <= r.keys() and r["fp8"] is None
        assert r["time_us"] > 0 and r["graphs"] is False and r["host_us"] is None  # CPU: eager, no host split
        if r["op"] == "tree":
            assert r["floor_us"] is None and r["ratio"] is None
        else:
            assert r["floor_us"] > 0 and r["ratio"] == pytest.approx(r["time_us"] / r["floor_us"], rel=1e-2)
        if r["op"] == "ar":
            assert r["vs_ar"] == 1.0
        assert r["bytes"] is None or type(r["bytes"]) is int
    floor = {(r["context"], r["op"], r["N"]): r["bytes"] for r in rows}
    assert floor[(64, "ar", 0)] > floor[(32, "ar", 0)]           # more context, more KV to read
    # a round is a draft and a verify, then the accepted tokens' projection into the drafter's context:
    # its fc (one tap of 64 features) and the k/v rows of its 5 layers' QKV weights (2 KV heads of 16), float32
    fc, kv_rows = 64 * 64 * 4, 5 * 2 * 2 * 16 * 64 * 4
    assert floor[(32, "round", 3)] - floor[(32, "verify", 3)] - floor[(32, "draft", 15)] == fc + kv_rows
    assert "verify(N)/AR  C=32" in captured.out and "floor us" in captured.out


@pytest.mark.parametrize("bandwidth,noted", [(1e3, True), (1e15, False)])
def test_ops_faster_than_their_floor_say_the_bandwidth_was_measured_low(monkeypatch, capsys, bandwidth, noted):
    """A floor is a lower bound: an op under it means the copy that measured the
    bandwidth was slow (a small --copy-mib in a cache, a cold first copy), said in a note."""
    from treeflash.bench import shape
    monkeypatch.setattr(shape, "copy_bandwidth", lambda device, mib: bandwidth)
    assert main(["bench", "--shape", "tiny", "--contexts", "32", "--budgets", "0", "--iters", "1",
                 "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert ("ran faster than their memory floor" in err) == noted, err


def test_shape_mode_refuses_weights_past_the_hosts_free_memory(monkeypatch, capsys):
    """`--shape qwen3-8b` on a CPU is 34 GiB of float32 weights: on a smaller host it was
    killed by the OS while the random weights were made; now one line first."""
    import treeflash.memory as memory
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2 ** 20)
    assert main(["bench", "--shape", "tiny", "--iters", "1", "--device", "cpu"]) != 0
    err = capsys.readouterr().err
    assert "not enough cpu memory for the weights" in err and "--dtype bfloat16" in err
    assert len(err.strip().splitlines()) == 1, err


QUICK_SHAPE = ["--contexts", "16", "--budgets", "0", "--iters", "1", "--device", "cpu", "--copy-mib", "1"]
QUICK_PAIR = ["--methods", "ar", "--num-prompts", "1", "--max-new-tokens", "1", "--batch-sizes", "1",
              "--temperatures", "0", "--graphs", "off", "--device", "cpu"]


def test_out_may_not_be_where_standard_output_goes(tmp_path, monkeypatch):
    """`bench --out /dev/stdout > rows.txt`: /dev/stdout is then that regular file, and
    the first row would empty it, table and all: refused as a pipe is."""
    from treeflash.bench.report import open_out
    from treeflash.errors import UsageError
    target = tmp_path / "rows.txt"
    with open(target, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        with pytest.raises(UsageError, match="is not a file of its own"):
            open_out(str(target))
        open_out(str(tmp_path / "other.jsonl")).close()  # any other file is taken


@pytest.mark.parametrize("argv,message", [
    (["--shape", "gpt5"], "unknown shape"),
    (["--shape", "", "--iters", "1"], "unknown shape ''"),
    (["--methods", ""], "empty method list"),
    (["--methods", "ar,beam"], "unknown method"),
    (["--methods", "ddtree", "--budgets", "0,16"], "budget must be >= 1"),
    # a budget of 100000 was killed for memory (a 10 GB mask per request); refused before loading
    (["--methods", "ddtree", "--budgets", "16,100000", "--device", "cpu"], "budget 100000 exceeds --max-budget 512"),
    (["--shape", "tiny", "--budgets", "0,100000"], "budget 100000 exceeds --max-budget 512"),
    (["--shape", "tiny", "--budgets", "600", "--max-budget", "0"], "--max-budget must be >= 1"),
    (["--batch-sizes", "0"], "batch size must be >= 1"),
    (["--temperatures", "hot"], "bad temperature"),
    (["--temperatures", "0,nan"], "bad temperature"),
    (["--top-p", "2"], "top_p must be in"),
    (["--shape", "tiny", "--top-k", "-5"], "top_k"),
    (["--graphs", "maybe"], "--graphs takes"),
    (["--graphs", "on", "--device", "cpu"], "needs a CUDA device"),
    (["--shape", "tiny", "--model", "x"], "takes no --model"),
    (["--prompt-file", "a", "--corpus", "b"], "not both"),
    (["--shape", "tiny", "--methods", "ar,beam"], "--methods applies to model-pair mode"),
    (["--shape", "tiny", "--num-prompts", "0"], "--num-prompts applies to model-pair mode"),
    (["--shape", "tiny", "--prompt-format", "json"], "--prompt-format applies to model-pair mode"),
    (["--prompt-format", "json"], "--prompt-format says how --prompt-file is read: give --prompt-file"),
    (["--shape", "tiny", "--max-new-tokens", "0"], "--max-new-tokens applies to model-pair mode"),
    (["--shape", "tiny", "--copy-mib", "-1"], "--copy-mib must be >= 1"),
    (["--shape", "tiny", "--copy-mib", "0"], "--copy-mib must be >= 1"),
    # 100000 layers spent minutes in the memory check's build
    # options that no request of the run would use were accepted without a word
    (["--methods", "ar", "--draft-mode", "scaled", "--device", "cpu"], "--draft-mode sets how dflash and ddtree draft"),
    (["--methods", "ddtree", "--temperatures", "0", "--draft-mode", "scaled", "--device", "cpu"],
     "--draft-mode acts on sampled requests only"),
    (["--temperatures", "0", "--top-p", "0.9", "--min-p", "0.1", "--device", "cpu"],
     "--top-p and --min-p act on sampled requests only: give a --temperatures above 0 or leave them out"),
    (["--shape", "tiny", "--top-k", "5"], "--top-k acts on sampled requests only"),
    (["--shape", "tiny", "--draft-layers", "6"], "--draft-layers must be <= 5"),
    # a context past the shape's positions, with room for the round's tokens (tiny: 32768; budget 255)
    (["--shape", "tiny", "--contexts", "32,40000"], "--contexts at most 32512"),
    (["--shape", "qwen3-8b", "--contexts", "40960"], "--contexts at most 40704"),
    (["--shape", "qwen3-8b", "--draft-layers", "100000"], "--draft-layers must be <= 36"),
    (["--shape", "tiny", "--draft-layers", "0"], "--draft-layers must be >= 1"),
    (["--shape", "tiny", "--plot", "/nonexistent/p.png"], "cannot write the plot"),
    (["--shape", "tiny", "--plot", "/proc/p.png"], "cannot write the plot"),  # root may "access" it
    (["--methods", "ar", "--plot", "/nonexistent/p.png", "--device", "cpu"], "cannot write the plot"),
    (["--shape", "tiny", "--plot", "p.txt"], "the name must end in .png, .svg or .pdf"),
    (["--methods", "ar", "--plot", "plot", "--device", "cpu"], "the name must end in .png"),
    (["--shape", "tiny", "--plot", "/tmp"], "is a folder"),
    # rows written to a pipe failed at the first measured row (after the load), or cut the table in two
    (["--shape", "tiny", "--out", "-"], "--out - is not a file of its own"),
    (["--shape", "tiny", "--out", "/dev/null"], "--out /dev/null is not a file of its own"),  # (as /dev/stdout on a pipe)
    (["--methods", "ar", "--out", "/tmp", "--device", "cpu", "--graphs", "off"], "--out /tmp is not a file of its own"),
    (["--shape", "tiny", "--plot", "r.png", "--out", "./r.png"], "--plot and --out are the same file"),
    (["--methods", "ar", "--plot", "r.png", "--out", "r.png", "--device", "cpu"], "--plot and --out are the same file"),
    # budgets that no method would build a tree of were checked, or ignored without a word
    (["--methods", "ar", "--budgets", "4", "--device", "cpu"], "--budgets sets ddtree's tree sizes"),
    (["--methods", "dflash,ar", "--budgets", "600", "--device", "cpu"], "--budgets sets ddtree's tree sizes"),
    (["--methods", "ddtree", "--budgets", "0", "--device", "cpu"], "budget must be >= 1"),
    (["--methods", "ddtree", "--budgets", "600", "--device", "cpu"], "exceeds --max-budget 512"),
    # a copy larger than the memory ran out of it after the models were built
    (["--shape", "tiny", "--copy-mib", str(2 ** 40)], "--copy-mib 1099511627776 needs"),
    # shape-mode flags in model-pair mode were ignored, bad values included
    (["--iters", "-5"], "--iters applies to --shape only"),
    (["--contexts", "0,-3"], "--contexts applies to --shape only"),
    (["--draft-layers", "2"], "--draft-layers applies to --shape only"),
    (["--attention", "triton"], "--attention applies to --shape only"),
    (["--copy-mib", "8"], "--copy-mib applies to --shape only"),
    (["--shape", "tiny", "--regex", "a+"], "--json-schema, --regex, --choice, --grammar or --json-object applies to model-pair mode"),
    (["--choice", "a", "--device", "cpu"], "need --eos"),
    # request i samples with seed S + i < 2^63: refused before the model loads
    (["--seed", str(2 ** 63 - 1), "--num-prompts", "2", "--device", "cpu"], "--seed must be in [0, 2^63 - 2]"),
    (["--seed", "-1", "--device", "cpu"], "--seed must be in"),
    (["--shape", "tiny", "--seed", str(2 ** 63 - 1), "--batch-sizes", "1,4"], "--seed must be in [0, 2^63 - 4]"),
    # sizes that built lists of 10^9 indices or prompts until memory ran out
    (["--batch-sizes", "1,1000000000", "--device", "cpu"], "batch size must be <= 4096"),
    (["--shape", "tiny", "--batch-sizes", "100000000000"], "batch size must be <= 4096"),
    (["--num-prompts", "100000000000", "--device", "cpu"], "--num-prompts must be from 1 to 65536"),
    # the lower limits, and a round's drafted block of 16 past the context when every budget is smaller (tiny:
    # 32768 positions): accepted until a second mutation review
    (["--num-prompts", "0", "--device", "cpu"], "--num-prompts must be from 1 to 65536, got 0"),
    (["--methods", "ar", "--max-new-tokens", "0", "--device", "cpu"], "--max-new-tokens must be >= 1, got 0"),
    (["--shape", "tiny", "--iters", "0"], "--iters must be >= 1, got 0"),
    (["--shape", "tiny", "--fp8", "0x128"], "--fp8 block sizes must be positive"),
    (["--shape", "tiny", "--fp8", "128"], "--fp8 takes ROWSxCOLS"),
    (["--shape", "tiny", "--fp8", "7x7"], "--fp8 7x7: model.layers.0.self_attn.qkv_proj: FP8 block size 7 does not "
                                         "divide"),  # a block that misfits the shape: exited 1, as for a bad file
    (["--shape", "tiny", "--budgets", "0,3", "--contexts", "32753"], "--contexts at most 32752"),
    # the other mode's options, each refused (a third mutation review: any one left out of MODE_ONLY was ignored;
    # the runs kept short, as they would be under such a mistake)
    (["--shape", "tiny", *QUICK_SHAPE, "--eos"], "--eos applies to model-pair mode"),
    (["--shape", "tiny", *QUICK_SHAPE, "--quantization", "fp8"], "--quantization applies to model-pair mode"),
    (["--shape", "tiny", *QUICK_SHAPE, "--grammar", 'root ::= "a"'],
     "--grammar or --json-object applies to model-pair mode"),
    (["--shape", "tiny", *QUICK_SHAPE, "--json-object"], "--grammar or --json-object applies to model-pair mode"),
    (["--shape", "tiny", *QUICK_SHAPE, "--draft-model", "d"],
     "takes no --model, --draft-model, --prompt-file or --corpus"),
    (["--shape", "tiny", *QUICK_SHAPE, "--prompt-file", "p"],
     "takes no --model, --draft-model, --prompt-file or --corpus"),
    (["--shape", "tiny", *QUICK_SHAPE, "--corpus", "c"], "takes no --model, --draft-model, --prompt-file or --corpus"),
    ([*QUICK_PAIR, "--fp8"], "--fp8 applies to --shape only"),
    # given with its default value, still the other mode's: it was let through, and ignored
    (["--shape", "tiny", *QUICK_SHAPE, "--max-new-tokens", "128"], "--max-new-tokens applies to model-pair mode"),
    ([*QUICK_PAIR, "--iters", "50"], "--iters applies to --shape only"),
    ([*QUICK_PAIR, "--tp", "1"], "--tp applies to --shape only"),
    (["--methods", "ar,ar", "--draft-model", "d", "--device", "cpu"], "--draft-model drafts for dflash and ddtree"),
    # --min-p 1 keeps only the likeliest tokens: a filter, refused where no request samples
    ([*QUICK_PAIR, "--min-p", "1"], "--min-p acts on sampled requests only"),
    ([*QUICK_PAIR, "--top-k", "1"], "--top-k acts on sampled requests only"),  # keeps one token: a filter
])
def test_bad_inputs_exit_2_with_one_line(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_a_run_that_fails_before_its_first_row_keeps_the_earlier_results(tmp_path, capsys):
    """--out is checked before the run but emptied (or made) only by the run's first row:
    results of an earlier run survive a run that fails at the start (a prompt past the
    context), and a new path is left without a file (an empty one was left behind)."""
    out, prompts = tmp_path / "results.jsonl", tmp_path / "long.txt"
    out.write_text('{"earlier": 1}\n')
    prompts.write_text("x " * 5000 + "\n")
    for path in (out, tmp_path / "new.jsonl"):
        assert main(["bench", "--methods", "ar", "--prompt-file", str(prompts), "--num-prompts", "1",
                     "--device", "cpu", "--out", str(path)]) == 2
        assert "does not fit" in capsys.readouterr().err
    assert out.read_text() == '{"earlier": 1}\n' and not (tmp_path / "new.jsonl").exists()
    assert main(["bench", "--shape", "tiny", "--contexts", "16", "--budgets", "0", "--iters", "1", "--device", "cpu",
                 "--copy-mib", "8", "--temperatures", "-0", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all("earlier" not in r and str(r["temperature"]) == "0.0" for r in rows)


@pytest.mark.parametrize("mode", [["--shape", "tiny"], ["--methods", "ar", "--device", "cpu"]], ids=["shape", "pair"])
def test_a_plot_without_matplotlib_is_refused_before_the_run(mode, tmp_path, monkeypatch, capsys):
    """--plot asks for a file that only matplotlib writes: without it the run was made,
    then a note said no plot was written, and the command exited 0."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["bench", *mode, "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "treeflash: error: --plot needs matplotlib (pip install matplotlib), or leave --plot out"


# ----------------------------------------------------------------------------- shape mode, --tp

TINY = ["bench", "--shape", "tiny", "--contexts", "32", "--budgets", "0,3", "--iters", "2", "--device", "cpu",
        "--copy-mib", "8"]


def test_shape_mode_tp2_over_gloo(tmp_path, capfd):
    """--tp 2 re-runs the command under torchrun as two gloo ranks, each holding its shard;
    rank 0 alone prints and writes the rows: per-rank floors, and the all-reduce fields."""
    one, two = tmp_path / "tp1.jsonl", tmp_path / "tp2.jsonl"
    assert main(TINY + ["--out", str(one)]) == 0
    tp1_out = capfd.readouterr().out
    assert main(TINY + ["--tp", "2", "--out", str(two)]) == 0
    captured = capfd.readouterr()
    rows1 = [json.loads(line) for line in one.read_text().splitlines()]
    rows2 = [json.loads(line) for line in two.read_text().splitlines()]
    assert [(r["op"], r["N"]) for r in rows2] == [(r["op"], r["N"]) for r in rows1]  # once, not once per rank
    assert captured.out.count("bench: shape tiny") == 1 and "per rank of tp 2" in captured.out
    assert captured.out.count("verify(N)/AR") == 1
    assert "allred" in captured.out and "allred" not in tp1_out
    assert captured.err.count("wrote ") == 1 and "Traceback" not in captured.err, captured.err
    # 4 target layers: 2 per layer + the embedding; 5 drafter layers likewise; a round adds the fc
    counts = {"ar": 9, "verify": 9, "draft": 11, "tree": None, "round-dflash": 21, "round": 21}
    for r1, r2 in zip(rows1, rows2):
        assert r1["tp"] == 1 and r1["allreduce_us"] is r1["allreduces"] is r1["allreduce_share"] is None
        assert r2["tp"] == 2 and r2["time_us"] > 0 and r2["allreduces"] == counts[r2["op"]]
        if r2["op"] == "tree":
            assert r2["allreduce_us"] is None and r2["allreduce_share"] is None and r2["bytes"] is None
        else:
            assert r2["allreduce_us"] > 0 and r2["allreduce_share"] > 0
            # a rank reads half the weights and KV (the replicated norm weights aside)
            assert 0.45 < r2["bytes"] / r1["bytes"] < 0.6, (r1, r2)
            assert r2["ratio"] == pytest.approx(r2["time_us"] / r2["floor_us"], rel=1e-2)


def test_shape_mode_times_the_draft_mode_asked_for(monkeypatch, capsys):
    """--draft-mode reaches the shape mode's rounds: sampled drafts were always timed
    'coupled', whatever was asked for."""
    from treeflash.engine.round import SpeculativeDecoder
    draft_logits, seen = SpeculativeDecoder.draft_logits, set()

    def spy(self, st, max_n):
        seen.add(self.draft_mode)
        return draft_logits(self, st, max_n)

    monkeypatch.setattr(SpeculativeDecoder, "draft_logits", spy)
    assert main(TINY + ["--draft-mode", "scaled", "--temperatures", "0.7"]) == 0, capsys.readouterr().err
    assert seen == {"scaled"}


def bench_args(*argv):
    """`treeflash bench ARGV`'s arguments as the command settles them (the other mode's
    options refused, the rest given their defaults)."""
    args = build_parser().parse_args(["bench", *argv])
    settle_mode_options(args)
    return args


def test_bench_argv_round_trip():
    """The ranks are started with the parent's options rebuilt from its parsed arguments."""
    args = bench_args("--shape", "tiny", "--contexts", "32,64", "--tp", "2", "--fp8", "--graphs", "off",
                      "--out", "x.jsonl", "--seed", "0", "--copy-mib", "8")
    assert vars(bench_args(*bench_argv(args)[1:])) == vars(args)


@pytest.mark.parametrize("argv,code,message", [
    (["--tp", "0"], 2, "--tp must be >= 1, got 0"),
    (["--tp", "3"], 2, "vocab_size (512) is not divisible by the tensor-parallel size 3"),
    (["--tp", "4"], 2, "num_key_value_heads (2) is not divisible by the tensor-parallel size 4"),
    (["--tp", "2", "--out", "/nonexistent/rows.jsonl"], 1, "cannot write /nonexistent/rows.jsonl"),
])
def test_shape_tp_errors_are_one_line(argv, code, message, capfd):
    assert main(TINY + argv) == code
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"treeflash: error: {message}"), lines


def test_shape_tp_failing_rank_is_one_line(tmp_path, monkeypatch, capfd):
    """A rank that fails while timing: the user sees its error in one line, naming it,
    not torchrun's report or the peer's broken collective."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import treeflash.bench.shape as shape\n"
        "    from treeflash.errors import TreeflashError\n"
        "    def fail(*args, **kwargs):\n"
        "        raise TreeflashError('no room for the shard')\n"
        "    shape.random_models = fail\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert main(TINY + ["--tp", "2"]) == 1
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines == ["treeflash: error: bench --tp 2: rank 1: no room for the shard"], lines


def test_tp_needs_shape_mode(capsys):
    assert main(["bench", "--tp", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("treeflash: error: --tp applies to --shape only (model-pair mode "
                                               "times whole requests on a real model pair, in one process)")


def test_a_prompt_file_shorter_than_num_prompts_is_refused(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("def f(x):\n")
    assert main(["bench", "--prompt-file", str(f), "--num-prompts", "8", "--device", "cpu"]) == 2
    assert "--num-prompts 8, but" in capsys.readouterr().err


def test_a_prompt_that_does_not_fit_is_named_by_its_line_before_the_run(tmp_path, capsys):
    """As `generate` does: FILE:LINE, and nothing printed on stdout (no run started)."""
    f = tmp_path / "p.txt"
    f.write_text("def f(x):\n" + "x = 1 " * 3000 + "\n")
    assert main(["bench", "--methods", "ar", "--prompt-file", str(f), "--max-new-tokens", "2", "--batch-sizes", "1",
                 "--temperatures", "0", "--graphs", "off", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert f"{f}:2: This model's maximum context length is" in err and "a prompt of" in err and out == ""


def test_shape_tp_beyond_visible_gpus(monkeypatch, capsys):
    """More ranks than GPUs: one line before anything is started."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    argv = ["bench", "--shape", "tiny", "--device", "cuda", "--attention", "sdpa", "--tp", "2"]
    assert main(argv) == 1
    assert capsys.readouterr().err.strip() == "treeflash: error: tp=2 needs 2 GPUs but 1 are visible"
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["NVSHMEM_DISABLE_NVLS"] == "1"


def test_shape_under_torchrun_checks_world_size(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(TINY) == 2
    assert capsys.readouterr().err.strip() == "treeflash: error: launched with WORLD_SIZE=2 processes but tp=1"


def test_time_wall_runs_rounds_back_to_back_one_behind(monkeypatch):
    """The shape bench's wall time per round: `iters` rounds pipelined as the engine
    runs them (each round's tokens read while the next one runs), `reset` queued before
    each round and no synchronization in between (traced on CPU tensors)."""
    from treeflash.bench import shape
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append("sync"))
    new, counts = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long)

    class Traced(shape.RoundPipeline):
        def push(self, n, c):
            got = super().push(n, c)
            log.append(("read", None if got is None else got[1][0]))
            return got

        def finish(self):
            got = super().finish()
            log.append(("finish", got[1][0]))
            return got

    def run():
        counts.add_(1)
        log.append(("round", int(counts[0])))
        return new, counts

    monkeypatch.setattr(shape, "RoundPipeline", Traced)
    wall, busy = shape.time_wall(run, lambda: log.append("reset"), 3)
    assert wall > 0 and (busy is None) == (not torch.cuda.is_available())
    assert log == ["reset", ("round", 1), ("read", None), ("finish", 1),  # warm-up: buffers made
                   "sync", "reset", ("round", 2), ("read", None), "reset", ("round", 3), ("read", 2),
                   "reset", ("round", 4), ("read", 3), ("finish", 4)]


def test_out_may_not_overwrite_an_input(tmp_path, capsys):
    """--out is opened (emptied) before the run: a path that is the prompt file or lies
    in the model's folder is refused, and the file is left as it was (a model's
    config.json was emptied so); --plot alike (a prompt file named .png was replaced by
    the plot)."""
    import shutil
    from treeflash.engine.options import builtin_paths
    model = tmp_path / "target"
    shutil.copytree(builtin_paths()[0], model)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    config = (model / "config.json").read_text()
    common = ["bench", "--methods", "ar", "--batch-sizes", "1", "--graphs", "off", "--max-new-tokens", "2",
              "--temperatures", "0", "--device", "cpu"]
    for argv, where in ((["--model", str(model), "--num-prompts", "1", "--out", str(model / "config.json")],
                         "inside"), (["--prompt-file", str(prompts), "--out", str(prompts)], "an input"),
                        (["--model", str(model), "--num-prompts", "1", "--plot", str(model / "p.png")], "inside"),
                        (["--prompt-file", str(prompts.with_suffix(".png")), "--plot", str(prompts.with_suffix(".png"))],
                         "an input")):
        prompts.with_suffix(".png").write_text("def f(x):\n")
        assert main([*common, *argv]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and where in err and "choose another path" in err, err
    assert (model / "config.json").read_text() == config and prompts.read_text() == "def f(x):\n"
    assert prompts.with_suffix(".png").read_text() == "def f(x):\n" and not (model / "p.png").exists()


@pytest.mark.parametrize("option", ["--prompt-file", "--corpus", "--budgets", "--batch-sizes", "--graphs",
                                    "--temperatures", "--out", "--plot"])
def test_an_empty_option_is_refused(option, capsys):
    """An empty value was taken as the option left out: its default, or no file read or written."""
    assert main(["bench", "--methods", "ar", "--device", "cpu", option, ""]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"treeflash: error: {option} is empty: give a value, or leave the option out", err


# ----------------------------------------------------------------------------- rows and tables (cases a mutation review found untested)

def test_a_pair_rows_speedup_and_same_as_ar_are_against_ar_at_its_setting():
    """speedup = tokens/s over AR's at the same (batch size, temperature, graphs), not its
    inverse; same_as_ar = the fraction of requests with AR's tokens (none for AR itself)."""
    from types import SimpleNamespace

    from treeflash.bench.pairs import pair_row
    args = bench_args()

    def engine(method, budget):
        return SimpleNamespace(method=method, decoder=SimpleNamespace(budget=budget, draft_mode="coupled"),
                               device=torch.device("cpu"), dtype=torch.float32, drafter=object())
    measured = {"tokens_per_s": 300.0, "tau": 2.5, "token_ids": [[1, 2], [3, 4], [5, 6], [7, 8]]}
    ar = (100.0, [[1, 2], [3, 4], [5, 6], [7, 9]])
    row = pair_row(engine("ddtree", 8), 8, (4, 0.0, False), measured, ar, args)
    assert (row["label"], row["speedup"], row["same_as_ar"]) == ("ddtree-8", 3.0, 0.75)
    assert (row["batch_size"], row["temperature"], row["graphs"]) == (4, 0.0, False) and "token_ids" not in row
    row = pair_row(engine("dflash", 7), None, (4, 0.0, False), {**measured, "tokens_per_s": 50.0}, ar, args)
    assert (row["label"], row["speedup"]) == ("dflash", 0.5)
    row = pair_row(engine("ar", None), None, (4, 0.0, False), {**measured, "tokens_per_s": 100.0}, ar, args)
    assert (row["speedup"], row["same_as_ar"]) == (1.0, None)


def test_the_pair_table_right_aligns_numbers_and_shows_each_columns_value():
    from treeflash.bench.pairs import PAIR_COLUMNS
    from treeflash.bench.report import format_table
    rows = [{"label": "ar", "graphs": True, "batch_size": 1, "temperature": 0.0, "tokens_per_s": 1234.56, "tau": 1.0,
             "ms_per_round": 3.456, "speedup": 1.0, "vs_dflash": None, "same_as_ar": None},
            {"label": "ddtree-16", "graphs": False, "batch_size": 16, "temperature": 0.7, "tokens_per_s": 99.0,
             "tau": 3.25, "ms_per_round": 12.0, "speedup": 2.5, "vs_dflash": 1.125, "same_as_ar": 1.0}]
    assert format_table(rows, PAIR_COLUMNS).splitlines() == [
        "method     graphs  bs    T   tok/s   tau  ms/round  speedup  vs dflash  same as AR",
        "---------  ------  --  ---  ------  ----  --------  -------  ---------  ----------",
        "ar         on       1    0  1234.6  1.00      3.46    1.00x          -           -",
        "ddtree-16  off     16  0.7    99.0  3.25     12.00    2.50x      1.12x        1.00"]


def test_shape_ratios_are_printed_per_setting_and_op(capsys):
    """verify(N)/AR and round(N)/AR: each line the ratios of its own op, one line per
    (context, batch size, temperature, graphs)."""
    from treeflash.bench.report import print_ratios

    def row(op, n, vs_ar, **setting):
        return {"context": 32, "batch_size": 1, "temperature": 0.0, "graphs": False, **setting,
                "op": op, "N": n, "vs_ar": vs_ar}
    print_ratios([row("ar", 0, 1.0), row("verify", 3, 1.5), row("verify", 7, 1.75), row("draft", 15, 0.5),
                  row("tree", 3, None), row("round", 3, 2.25),
                  row("verify", 3, 1.25, context=64, batch_size=2, temperature=0.7, graphs=True)])
    assert capsys.readouterr().out.splitlines() == [
        "verify(N)/AR  C=32 bs=1 T=0 graphs off:  N=3: 1.50  N=7: 1.75",
        "round(N)/AR  C=32 bs=1 T=0 graphs off:  N=3: 2.25",
        "verify(N)/AR  C=64 bs=2 T=0.7 graphs on:  N=3: 1.25"]


def test_pair_mode_notes_only_requests_that_do_not_fit(tmp_path, capsys):
    """A prompt and --max-new-tokens that fill the context exactly make every token asked
    for: no note; one token more is cut, and noted."""
    import json

    from treeflash.checkpoints import write_random_target
    from treeflash.cli import main
    from treeflash.engine.llm import LLM
    target = write_random_target(tmp_path / "t", max_position_embeddings=48)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fib(n):\n")
    room = 48 - len(LLM(target, method="ar", device="cpu").encode("def fib(n):"))  # the line, as bench reads it
    out = tmp_path / "rows.jsonl"
    argv = ["bench", "--model", str(target), "--prompt-file", str(prompts), "--methods", "ar", "--batch-sizes",
            "1", "--graphs", "off", "--temperatures", "0", "--device", "cpu", "--out", str(out)]
    assert main(argv + ["--max-new-tokens", str(room)]) == 0
    assert "note:" not in capsys.readouterr().err and json.loads(out.read_text())["new_tokens"] == room
    out.unlink()
    assert main(argv + ["--max-new-tokens", str(room + 1)]) == 0
    assert "note: 1 of 1 prompts leave less than" in capsys.readouterr().err


def test_builtin_prompts_are_cycled_up_to_num_prompts():
    from treeflash.bench.pairs import PYTHON_PROMPTS, load_prompts
    args = bench_args("--num-prompts", str(len(PYTHON_PROMPTS) + 3))
    prompts = [p for p, _ in load_prompts(args)]
    assert prompts == PYTHON_PROMPTS + PYTHON_PROMPTS[:3]


def test_ms_per_round_divides_by_the_rounds_the_batches_ran(monkeypatch):
    """A batch takes as many rounds as its longest request: ms/round is the time over
    those (not over every request's rounds); tau is over the requests' own rounds."""
    from types import SimpleNamespace

    from treeflash.bench import pairs
    rounds = {0: 3, 1: 5, 2: 2, 3: 2}  # by prompt: batches [0, 1] and [2, 3]

    class Engine:
        device, graph_captures = torch.device("cpu"), 0

        def generate(self, prompts, params):
            return [SimpleNamespace(stats={"rounds": rounds[p], "new_tokens": 2 * rounds[p]}, token_ids=[p])
                    for p in prompts]
    clock = iter([10.0, 10.7])  # 0.7 s timed
    monkeypatch.setattr(pairs.time, "perf_counter", lambda: next(clock))
    args = bench_args("--max-new-tokens", "8")
    m = pairs.measure_pair(Engine(), [0, 1, 2, 3], 2, 0.0, args)
    assert (m["batch_rounds"], m["request_rounds"], m["new_tokens"]) == (7, 12, 24)
    assert m["ms_per_round"] == pytest.approx(100.0) and m["tau"] == 2.0 and m["tokens_per_s"] == round(24 / 0.7, 2)


# ----------------------------------------------------------------------------- defaults, limits, floors and timers (a second mutation review)

def test_pair_mode_defaults_are_the_documented_ones(monkeypatch):
    """`treeflash bench` with no options runs what --help says: every method, budgets
    15..255 (verifies of 16-256 rows), batch sizes 1,2,4, temperatures 0,0.7,1.0, graphs
    on and off, 8 built-in prompts of 128 new tokens, --max-budget 512, and sampled
    drafts 'coupled'."""
    from treeflash.bench import pairs
    from treeflash.engine.round import METHODS
    monkeypatch.setattr(pairs, "usable_graphs", lambda graphs, device: graphs)  # as on a CUDA device
    args = bench_args()
    plan = pairs._pair_plan(args)
    assert plan.methods == list(METHODS) == ["ar", "dflash", "ddtree"]
    assert plan.budgets == [15, 31, 63, 127, 255] and plan.batch_sizes == [1, 2, 4]
    assert plan.temperatures == [0.0, 0.7, 1.0] and plan.graphs == [True, False]
    assert len(plan.prompts) == 8 and args.max_new_tokens == 128 and args.max_budget == 512
    assert plan.draft_mode == "coupled"


def test_shape_mode_defaults_are_the_documented_ones():
    """`--shape` alone: contexts 1024,4096,16384, budgets 0..255, batch size 1, greedy,
    no graphs on a CPU (float32), 50 timed calls, a drafter of 5 layers drafting 'coupled'."""
    from treeflash.bench import shape
    args = bench_args("--shape", "tiny", "--device", "cpu")
    plan = shape._shape_plan(args)
    assert plan.contexts == [1024, 4096, 16384] and plan.budgets == [0, 15, 31, 63, 127, 255]
    assert plan.batch_sizes == [1] and plan.temperatures == [0.0] and plan.graphs == [False]
    assert plan.dtype == torch.float32 and args.iters == 50 and args.draft_layers == 5
    assert plan.draft_mode == "coupled"


def test_values_at_their_limits_are_accepted_and_repeats_timed_once():
    """--budgets up to --max-budget, --batch-sizes up to 4096 and a seed whose last
    request's seed is 2^63 - 1 are accepted (the bounds are inclusive); a value given
    twice is one setting, timed once."""
    from treeflash.bench.pairs import _pair_plan
    from treeflash.bench.shape import _shape_plan
    prompts = 8  # the built-in prompts: request i samples with seed S + i
    plan = _pair_plan(bench_args(
        "--methods", "ddtree", "--budgets", "512,4,4", "--batch-sizes", "4096,2,2", "--temperatures",
        "0,0.5,0.5", "--graphs", "off,off", "--device", "cpu", "--seed", str(2 ** 63 - prompts)))
    assert (plan.budgets, plan.batch_sizes, plan.temperatures, plan.graphs) == ([512, 4], [4096, 2], [0.0, 0.5],
                                                                                [False])
    plan = _shape_plan(bench_args(
        "--shape", "tiny", "--budgets", "0,3,0", "--contexts", "32,32,32752", "--max-budget", "3", "--device", "cpu"))
    # 32752: the tiny shape's 32768 positions less a round's drafted block of 16 (above budget 3)
    assert (plan.budgets, plan.contexts) == ([0, 3], [32, 32752])


def test_num_prompts_takes_the_first_prompts_of_the_file(tmp_path):
    from treeflash.bench.pairs import load_prompts
    f = tmp_path / "p.txt"
    f.write_text("a = 1\nb = 2\n")
    for k, expected in ((1, [("a = 1", f"{f}:1")]), (2, [("a = 1", f"{f}:1"), ("b = 2", f"{f}:2")])):
        args = bench_args("--prompt-file", str(f), "--num-prompts", str(k))
        assert load_prompts(args) == expected


def test_measure_pair_warms_up_before_the_clock_and_counts_recaptures(monkeypatch):
    """Untimed warm-up: on a CPU the first batch, on CUDA every batch; graphs captured
    while timed (each timed batch here) are counted in `recaptures`, those of the warm-up
    not."""
    from types import SimpleNamespace

    from treeflash.bench import pairs
    now, calls = [0.0], []

    class Engine:
        graph_captures = 0

        def __init__(self, device):
            self.device = torch.device(device)

        def generate(self, prompts, params):
            calls.append((list(prompts), now[0]))
            self.graph_captures += 1
            now[0] += 1.0  # a second per batch
            return [SimpleNamespace(stats={"rounds": 1, "new_tokens": 1}, token_ids=[p]) for p in prompts]
    monkeypatch.setattr(pairs.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(pairs, "sync", lambda device: None)
    args = bench_args("--max-new-tokens", "1")
    for device, warm in (("cpu", [[0, 1]]), ("cuda", [[0, 1], [2, 3]])):
        calls.clear()
        m = pairs.measure_pair(Engine(device), [0, 1, 2, 3], 2, 0.0, args)
        assert [batch for batch, _ in calls] == warm + [[0, 1], [2, 3]]
        assert m["seconds"] == 2.0 and m["recaptures"] == 2  # the two timed batches alone


def test_a_pair_rows_run_fields():
    """A row says what it ran with, so that rows of different runs are not mistaken for
    each other: device, dtype (without 'torch.'), quantization, the model ('built-in'
    without --model) and the drafter (the built-in one too), the draft mode of a drafted
    method, new tokens, --eos, --seed and the kind of constraint."""
    from types import SimpleNamespace

    from treeflash.bench.pairs import pair_row

    def row(method, drafter, *options):
        engine = SimpleNamespace(method=method, decoder=SimpleNamespace(budget=None, draft_mode="scaled"),
                                 device=torch.device("cpu"), dtype=torch.bfloat16, drafter=drafter)
        args = bench_args(*options)
        return pair_row(engine, None, (1, 0.0, False), {"tokens_per_s": 100.0, "token_ids": [[1]]}, None, args)

    fields = ("device", "dtype", "quantization", "model", "draft_model", "draft_mode", "max_new_tokens", "eos",
              "seed", "constraint")
    plain = row("ar", None)
    assert [plain[f] for f in fields] == ["cpu", "bfloat16", None, "built-in", None, None, 128, False, 0, None]
    assert row("dflash", object())["draft_model"] == "built-in"  # the built-in pair's drafter
    given = row("dflash", object(), "--model", "/m/target", "--draft-model", "/m/drafter", "--quantization", "fp8",
                "--max-new-tokens", "9", "--eos", "--seed", "7", "--regex", "a+")
    assert [given[f] for f in fields] == ["cpu", "bfloat16", "fp8", "/m/target", "/m/drafter", "scaled", 9, True, 7,
                                          "regex"]
    assert row("ar", None, "--eos", "--regex", "")["constraint"] == "regex"  # the empty text: a constraint too


def test_rows_are_on_disk_as_soon_as_they_are_measured(tmp_path):
    """--out is flushed row by row: an interrupted run keeps what it measured."""
    from treeflash.bench.report import close_out, emit, open_out
    path = tmp_path / "rows.jsonl"
    out = open_out(str(path))
    emit(out, {"op": "ar"})
    assert path.read_text() == '{"op": "ar"}\n'
    emit(out, {"op": "verify"})
    assert path.read_text().splitlines() == ['{"op": "ar"}', '{"op": "verify"}']
    close_out(out, str(path))


@pytest.mark.skipif(not HAVE_MPL, reason="needs matplotlib")
def test_a_plot_name_in_capitals_is_accepted(tmp_path):
    from treeflash.bench.report import check_plot_path
    check_plot_path(str(tmp_path / "BENCH.PNG"), None)  # matplotlib reads the format case-blind


@pytest.mark.skipif(not HAVE_MPL, reason="needs matplotlib")
def test_the_plots_draw_the_figures_their_axes_name(monkeypatch, tmp_path):
    """The pair plot: tokens/s per label, one line per (batch size, temperature, graphs);
    the shape plot: time_us against N + 1 per op, and the AR step's time as a line."""
    from treeflash.bench import report
    figs = []
    monkeypatch.setattr(report, "_save", lambda fig, plt, path: figs.append(fig))
    rows = [{"label": lab, "batch_size": 1, "temperature": 0.0, "graphs": g, "tokens_per_s": tps, "ms_per_round": 9.0}
            for lab, g, tps in (("ar", True, 100.0), ("ddtree-16", True, 250.0), ("ar", False, 80.0))]
    report.plot_pairs(rows, str(tmp_path / "p.png"))
    ax = figs[-1].axes[0]
    assert ax.get_ylabel() == "tokens/s"
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines == {"bs 1, T 0, graphs on": [100.0, 250.0], "bs 1, T 0, graphs off": [80.0]}

    def row(op, n, us, floor):
        return {"shape": "tiny", "context": 32, "batch_size": 1, "temperature": 0.0, "graphs": False,
                "op": op, "N": n, "time_us": us, "floor_us": floor}
    report.plot_shape([row("ar", 0, 50.0, 10.0), row("verify", 3, 60.0, 11.0), row("verify", 7, 70.0, 12.0),
                       row("round", 3, 90.0, 20.0)], str(tmp_path / "s.png"))
    ax = figs[-1].axes[0]
    assert ax.get_ylabel() == "time (us)" and ax.get_xlabel() == "tokens verified per round (N + 1)"
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines["verify C=32 bs 1 eager"] == ([4, 8], [60.0, 70.0])
    assert lines["round C=32 bs 1 eager"] == ([4], [90.0])
    (ar,) = [line for label, line in zip(lines, ax.get_lines()) if label.startswith("_")]  # the AR step
    assert list(ar.get_ydata()) == [50.0, 50.0]


def test_the_shape_table_shows_each_columns_value():
    from treeflash.bench.report import format_table
    from treeflash.bench.shape import SHAPE_COLUMNS
    rows = [{"context": 32, "batch_size": 1, "temperature": 0.0, "graphs": False, "op": "ar", "N": 0, "time_us": 50.0,
             "floor_us": 10.0, "ratio": 5.0, "vs_ar": 1.0, "host_us": None},
            {"context": 32, "batch_size": 1, "temperature": 0.0, "graphs": True, "op": "round", "N": 3,
             "time_us": 125.0, "floor_us": 25.0, "ratio": 5.0, "vs_ar": 2.5, "host_us": 7.5}]
    assert format_table(rows, SHAPE_COLUMNS).splitlines() == [
        "context  bs  T  graphs  op     N  time us  floor us  ratio  x AR  host us",
        "-------  --  -  ------  -----  -  -------  --------  -----  ----  -------",
        "     32   1  0  off     ar     0     50.0      10.0   5.00  1.00        -",
        "     32   1  0  on      round  3    125.0      25.0   5.00  2.50      7.5"]


def _qwen3_layer_params(cfg) -> int:
    """A Qwen3 decoder layer's parameters, from its shape: q, k, v and o; the q/k norms;
    gate, up and down; the two norms."""
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    return h * q + 2 * h * kv + q * h + 2 * cfg.head_dim + 3 * h * cfg.intermediate_size + 2 * h


def test_shape_floors_are_the_bytes_each_op_reads(tmp_path, monkeypatch, capsys):
    """Each floor's bytes, derived from the tiny shape: the target's layers and final norm
    (not its embedding: rows are looked up), its LM head, and K and V of C tokens in every
    layer for every request; a draft step reads the drafter's layers and norms, the LM
    head and the drafter's KV; a round both, the LM head twice, plus the fc and the k/v
    rows of the drafter's QKV weights. floor_us is those bytes over the copy bandwidth
    (µs), and x AR the op's time over the AR step's."""
    from treeflash.bench import shape
    from treeflash.bench.options import DRAFT_LAYERS
    bandwidth, mibs = 2e9, []  # bytes/s

    def copy_bandwidth(device, mib):
        mibs.append(mib)
        return bandwidth
    monkeypatch.setattr(shape, "copy_bandwidth", copy_bandwidth)
    out, C, bs = tmp_path / "rows.jsonl", 32, 2
    assert main(["bench", "--shape", "tiny", "--contexts", str(C), "--batch-sizes", str(bs), "--budgets", "0,3",
                 "--iters", "1", "--device", "cpu", "--out", str(out)]) == 0
    assert mibs == [256]  # the copy's default size on a CPU
    assert "copy bandwidth 2.0 GB/s (read + write, 256 MiB)" in capsys.readouterr().out
    rows = {(r["op"], r["N"]): r for r in map(json.loads, out.read_text().splitlines())}
    cfg, f32 = shape.SHAPES["tiny"], 4
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    body = cfg.num_layers * _qwen3_layer_params(cfg) + h
    head = cfg.vocab_size * h
    kv_target = bs * cfg.num_layers * 2 * kv * C
    drafter = DRAFT_LAYERS * _qwen3_layer_params(cfg) + 2 * h    # its hidden and final norms
    kv_drafter = bs * DRAFT_LAYERS * 2 * kv * C
    fc = 1 * h * h  # one tapped target layer (4 target layers, 5 drafter layers)
    context_rows = DRAFT_LAYERS * 2 * kv * h
    forward, draft = body + head + kv_target, drafter + head + kv_drafter
    round_ = body + 2 * head + kv_target + drafter + fc + context_rows + kv_drafter
    D = shape.BLOCK_SIZE - 1
    expected = {("ar", 0): forward, ("verify", 0): forward, ("verify", 3): forward, ("draft", D): draft,
                ("round-dflash", D): round_, ("round", 3): round_}
    for key, params in expected.items():
        r = rows[key]
        assert r["bytes"] == f32 * params, key
        assert r["floor_us"] == pytest.approx(1e6 * r["bytes"] / bandwidth, abs=0.01) and r["bandwidth_gbs"] == 2.0
        assert r["vs_ar"] == pytest.approx(r["time_us"] / rows["ar", 0]["time_us"], rel=1e-2)


def test_a_sliding_window_layer_floors_only_its_windows_kv(tmp_path, monkeypatch):
    """A sliding-window layer (gpt-oss: every other one) reads the K and V of its window
    alone, not of the whole context."""
    import dataclasses

    from treeflash.bench import shape
    window, C = 8, 32
    tiny = shape.SHAPES["tiny"]
    monkeypatch.setitem(shape.SHAPES, "tiny-swa", dataclasses.replace(tiny, sliding_window=window,
                                                                      sliding_layers=(0, 2)))
    ar = {}
    for name in ("tiny", "tiny-swa"):
        out = tmp_path / f"{name}.jsonl"
        assert main(["bench", "--shape", name, "--contexts", str(C), "--budgets", "0", "--iters", "1",
                     "--device", "cpu", "--copy-mib", "1", "--out", str(out)]) == 0
        ar[name] = next(r["bytes"] for r in map(json.loads, out.read_text().splitlines()) if r["op"] == "ar")
    f32, kv = 4, tiny.num_kv_heads * tiny.head_dim
    assert ar["tiny"] - ar["tiny-swa"] == f32 * 2 * 2 * kv * (C - window)  # 2 layers, K and V


def test_time_device_on_a_cpu_is_the_median_call_in_microseconds(monkeypatch):
    """The reset before each call is not timed; the median, not the mean, of the calls."""
    from treeflash.bench import shape
    now, durations = [0.0], iter([0.003, 0.001, 0.010])  # seconds

    def run():
        now[0] += next(durations)

    def reset():
        now[0] += 1.0
    monkeypatch.setattr(shape.time, "perf_counter", lambda: now[0])
    assert shape.time_device(run, reset, 3, torch.device("cpu")) == pytest.approx(3000.0)


def test_copy_bandwidth_counts_the_read_and_the_write(monkeypatch):
    """bytes/s = 2 x the copy's size over its time; the copy needs room for its source
    and its destination (exactly that much is enough)."""
    from treeflash.bench import shape
    from treeflash.errors import UsageError
    mib, us = 1, 1000.0
    size = mib * 2 ** 20
    monkeypatch.setattr(shape, "time_device", lambda run, reset, iters, device: us)
    monkeypatch.setattr(shape, "available_bytes", lambda device: 2 * size)
    assert shape.copy_bandwidth(torch.device("cpu"), mib) == pytest.approx(2 * size / (us * 1e-6))
    monkeypatch.setattr(shape, "available_bytes", lambda device: 2 * size - 1)
    with pytest.raises(UsageError, match="--copy-mib 1 needs 2 MiB"):
        shape.copy_bandwidth(torch.device("cpu"), mib)


def test_shape_rows_allreduce_fields_follow_each_ops_plan():
    """Under --tp: allreduce_us is one all-reduce at the op's first token count (target
    tokens x batch), allreduces their count, allreduce_share count x latency / op time,
    summed over the op's forwards (a latency of 1 µs per token here)."""
    from treeflash.bench import shape
    from treeflash.bench.options import DRAFT_LAYERS
    args = bench_args("--shape", "tiny", "--iters", "1")
    cfg, cpu, bs = shape.SHAPES["tiny"], torch.device("cpu"), 2
    target, drafter = shape.random_models(cfg, shape.draft_config(cfg, DRAFT_LAYERS), cpu, torch.float32)
    with torch.inference_mode():
        rows = shape.shape_rows(args, target, drafter, 32, bs, 0.0, False, [0, 3], "sdpa", "coupled", 1e9, cpu,
                                torch.float32, None, allreduce=lambda tokens, graphs: float(tokens), lead=False)
    target_fwd = 2 * cfg.num_layers + 1   # after the embedding, and each layer's attention and MLP
    draft_fwd = 2 * DRAFT_LAYERS + 1
    block = bs * shape.BLOCK_SIZE
    plans = {("ar", 0): [(target_fwd, bs)], ("verify", 3): [(target_fwd, bs * 4)],
             ("draft", block // bs - 1): [(draft_fwd, block)],
             ("round", 3): [(target_fwd, bs * 4), (draft_fwd, block), (1, block)]}  # + the fc over the block
    seen = {(r["op"], r["N"]): r for r in rows}
    for key, plan in plans.items():
        r = seen[key]
        assert r["allreduce_us"] == plan[0][1] and r["allreduces"] == sum(c for c, _ in plan), key
        share = sum(c * t for c, t in plan) / r["time_us"]
        assert r["allreduce_share"] == pytest.approx(share, rel=1e-2, abs=1e-3), key  # (rounded to 3 decimals)


def test_each_timed_op_runs_its_own_budget(monkeypatch):
    """verify N, tree N and round N each run a tree of N nodes (root + N tokens), the AR
    step no drafter, the draft step and round-dflash the drafter's chain: each row's
    time is of the op its (op, N) names."""
    from treeflash.bench import shape
    from treeflash.bench.options import DRAFT_LAYERS
    from treeflash.engine.round import SpeculativeDecoder
    cfg, cpu, budgets, C = shape.SHAPES["tiny"], torch.device("cpu"), [0, 3, 7], 32
    target, drafter = shape.random_models(cfg, shape.draft_config(cfg, DRAFT_LAYERS), cpu, torch.float32)
    calls, depth = [], [0]

    def spy(name):  # logs the outermost calls: (name, method, ddtree's budget, the tree's nodes)
        method = getattr(SpeculativeDecoder, name)

        def called(self, *args, **kwargs):
            depth[0] += 1
            got = method(self, *args, **kwargs)
            depth[0] -= 1
            tree = args[1] if name == "verify" else got if name == "tree_from_logits" else None
            if not depth[0]:
                calls.append((name, self.method, self.budget if self.method == "ddtree" else None,
                              None if tree is None else tree.tokens.shape[1] - 1))
            return got
        return called
    for name in ("round", "verify", "tree_from_logits"):
        monkeypatch.setattr(SpeculativeDecoder, name, spy(name))
    with torch.inference_mode():
        st = shape.new_shape_state(target, drafter, C, 1, 0.0, budgets, 0)
        assert st.n.tolist() == [C]  # the timed state: C tokens committed
        ops = shape.round_ops(target, drafter, st, budgets, "sdpa", "coupled", C)
        ran = {}
        for op, n, _, fn, _ in ops:
            calls.clear()
            st.n.fill_(C)
            fn()
            ran[op, n] = list(calls)
    assert ran["ar", 0] == [("round", "ar", None, None)]
    for n in budgets:
        assert ran["verify", n] == [("verify", "dflash", None, n)]
    for n in (3, 7):
        assert ran["tree", n] == [("tree_from_logits", "ddtree", n, n)]
        assert ran["round", n] == [("round", "ddtree", n, None)]
    D = shape.BLOCK_SIZE - 1
    assert ran["round-dflash", D] == [("round", "dflash", None, None)] and ran["draft", D] == []


def test_filters_set_off_are_not_filters():
    """--top-k -1 is off (as 0, and as vLLM's): not refused at temperature 0 as a filter
    that the run would ignore, and not named as a filter of the sampled requests."""
    from treeflash.bench.options import filters_note
    from treeflash.bench.shape import _shape_plan
    args = bench_args("--shape", "tiny", "--top-k", "-1", "--device", "cpu")
    assert _shape_plan(args).temperatures == [0.0]
    args = bench_args("--shape", "tiny", "--top-k", "-1", "--temperatures", "0.7")
    assert filters_note(args) == ""
    args = bench_args("--shape", "tiny", "--top-k", "3", "--temperatures", "0.7")
    assert filters_note(args) == "; sampled requests with top-k 3"


def test_pair_mode_counts_every_prompt_cut_by_the_context(tmp_path, capsys):
    target = write_random_target(tmp_path / "t", max_position_embeddings=48)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fib(n):\nimport os\n")
    assert main(["bench", "--model", str(target), "--prompt-file", str(prompts), "--methods", "ar", "--batch-sizes",
                 "1", "--graphs", "off", "--temperatures", "0", "--device", "cpu", "--max-new-tokens", "40"]) == 0
    assert "note: 2 of 2 prompts leave less than --max-new-tokens 40" in capsys.readouterr().err


def test_pair_mode_runs_each_timed_batch_as_one_engine_batch(pair, tmp_path, monkeypatch, capsys):
    """The engine is made for the largest batch size: a timed batch of bs requests is one
    batch of the engine, not several smaller ones after another."""
    from treeflash.bench import pairs
    made = []

    class Engine(pairs.LLM):
        def __init__(self, *args, **kwargs):
            made.append(kwargs["max_batch"])
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(pairs, "LLM", Engine)
    target, _ = pair
    assert main(["bench", "--model", str(target), "--methods", "ar", "--num-prompts", "4", "--batch-sizes", "1,4,2",
                 "--temperatures", "0", "--max-new-tokens", "2", "--device", "cpu"]) == 0, capsys.readouterr().err
    assert made == [4]



@pytest.mark.skipif(not HAVE_MPL, reason="needs matplotlib")
def test_a_plot_that_cannot_be_written_is_one_error(tmp_path):
    """A folder removed during the run: one TreeflashError, not matplotlib's traceback."""
    from treeflash.bench.report import plot_pairs
    from treeflash.errors import TreeflashError
    row = {"label": "ar", "batch_size": 1, "temperature": 0.0, "graphs": False, "tokens_per_s": 1.0}
    with pytest.raises(TreeflashError, match="cannot write"):
        plot_pairs([row], str(tmp_path / "gone" / "p.png"))


def test_corpus_prompts_default_to_8(pair, tmp_path):
    """--corpus without --num-prompts: 8 held-out prompts, as the built-in ones."""
    from treeflash.bench.pairs import load_prompts
    target, _ = pair
    corpus = tiny_corpus(tmp_path / "corpus", target)
    for given in ([], ["--corpus", str(corpus)]):
        args = bench_args("--model", str(target), *given)
        assert len(load_prompts(args)) == 8


# ----------------------------------------------------------------------------- figures, pairings, plots and shapes (a third mutation review)

def fake_pair_run(monkeypatch, tmp_path, argv, recaptured=()):
    """`treeflash bench` in model-pair mode over a stand-in engine whose measurements are
    made up from each row's (method, batch size, temperature, graphs), CUDA graphs 'on'
    allowed as on a CUDA device; the rows written to --out. `recaptured`: the (method,
    batch size, temperature, graphs) whose timing captured a graph."""
    from types import SimpleNamespace

    from treeflash.bench import pairs

    def token_ids(method, bs, temperature, graphs, requests):
        # AR's tokens differ per setting; a drafted method's first request has AR's tokens there
        ar = [[int(graphs), bs, int(10 * temperature), i] for i in range(requests)]
        return ar if method == "ar" else [ar[0]] + [[-1, i] for i in range(1, requests)]

    def tokens_per_s(method, bs, temperature, graphs):
        return 100.0 * bs + 10.0 * temperature + (7.0 if graphs else 0.0) + {"ar": 0.0, "dflash": 1000.0}.get(method, 1500.0)

    class Engine:
        drafter, device, dtype, max_model_len = object(), torch.device("cpu"), torch.float32, 4096

        def __init__(self, *args, **kwargs):
            pass

        def encode(self, prompt):
            return [1, 2, 3]

        def with_method(self, method, budget, graphs, draft_mode):
            return SimpleNamespace(method=method, decoder=SimpleNamespace(budget=budget, draft_mode=draft_mode),
                                   graphs=graphs, device=self.device, dtype=self.dtype, drafter=self.drafter,
                                   drop_graphs=lambda: None)

    def measure_pair(llm, prompts, bs, temperature, args):
        key = (llm.method, bs, temperature, llm.graphs)
        return {"requests": 4, "new_tokens": 8, "batch_rounds": 4, "request_rounds": 4, "seconds": 1.0,
                "tokens_per_s": tokens_per_s(*key), "tau": 2.0, "ms_per_round": 250.0,
                "recaptures": int(key in recaptured), "token_ids": token_ids(*key, 4)}
    monkeypatch.setattr(pairs, "LLM", Engine)
    monkeypatch.setattr(pairs, "measure_pair", measure_pair)
    monkeypatch.setattr(pairs, "usable_graphs", lambda graphs, device: graphs)
    out = tmp_path / "rows.jsonl"
    assert main(["bench", "--num-prompts", "4", "--device", "cpu", "--out", str(out), *argv]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()], token_ids


def test_each_pair_row_is_compared_with_ar_at_its_own_batch_size_temperature_and_graphs(monkeypatch, tmp_path):
    """speedup and same_as_ar are against the AR row of the same (batch size,
    temperature, CUDA graphs): with graphs on and off, a row is not compared with AR of
    the other graphs setting (nor AR with itself across settings)."""
    rows, token_ids = fake_pair_run(monkeypatch, tmp_path, ["--methods", "ar,ddtree", "--budgets", "4",
                                                            "--graphs", "on,off", "--batch-sizes", "1,2",
                                                            "--temperatures", "0,1"])
    assert len(rows) == 2 * 2 * 2 * 2
    ar = {(r["batch_size"], r["temperature"], r["graphs"]): r for r in rows if r["method"] == "ar"}
    assert len(ar) == 8
    for r in rows:
        key = (r["batch_size"], r["temperature"], r["graphs"])
        assert r["speedup"] == round(r["tokens_per_s"] / ar[key]["tokens_per_s"], 3), r
        if r["method"] != "ar":
            mine, theirs = token_ids(r["method"], *key, 4), token_ids("ar", *key, 4)
            assert r["same_as_ar"] == sum(a == b for a, b in zip(mine, theirs)) / 4 == 0.25, r


@pytest.mark.parametrize("recaptured,noted", [((), False), ((("ddtree", 2, 0.0, True),), True)])
def test_a_graph_captured_while_timed_in_any_row_is_noted(monkeypatch, tmp_path, capsys, recaptured, noted):
    """One row that captured a CUDA graph inside its timed region is enough for the note
    under the table (its time holds the capture)."""
    rows, _ = fake_pair_run(monkeypatch, tmp_path, ["--methods", "ar,ddtree", "--budgets", "4", "--graphs", "on,off",
                                                    "--batch-sizes", "1,2", "--temperatures", "0"], recaptured)
    assert sum(r["recaptures"] for r in rows) == len(recaptured)
    assert ("note: some rows captured a CUDA graph while timed" in capsys.readouterr().out) == noted


@pytest.mark.skipif(not HAVE_MPL, reason="needs matplotlib")
def test_the_plots_name_each_point_and_colour_each_setting(monkeypatch, tmp_path):
    """Pair plot: the tick under each point names the method/budget whose tokens/s it
    is. Shape plot: one colour per setting (its verify, round and AR lines alike), ticks
    at the verified token counts (N + 1) only, and the shape named in the title."""
    from treeflash.bench import report
    figs = []
    monkeypatch.setattr(report, "_save", lambda fig, plt, path: figs.append(fig))
    tps = {("ar", True): 100.0, ("dflash", True): 180.0, ("ddtree-16", True): 250.0,
           ("ar", False): 80.0, ("dflash", False): 150.0, ("ddtree-16", False): 210.0}
    rows = [{"label": lab, "batch_size": 1, "temperature": 0.0, "graphs": g, "tokens_per_s": v}
            for (lab, g), v in tps.items()]
    report.plot_pairs(rows, str(tmp_path / "p.png"))
    ax = figs[-1].axes[0]
    names = [t.get_text() for t in ax.get_xticklabels()]
    for line in ax.get_lines():
        g = line.get_label().endswith("on")
        assert {names[int(x)]: y for x, y in zip(line.get_xdata(), line.get_ydata())} == \
            {lab: v for (lab, on), v in tps.items() if on == g}

    def row(op, n, us, context):
        return {"shape": "qwen3-8b", "context": context, "batch_size": 1, "temperature": 0.0, "graphs": True,
                "op": op, "N": n, "time_us": us}
    rows = [r for c in (32, 64) for r in (row("ar", 0, 50.0 + c, c), row("verify", 3, 60.0 + c, c),
                                          row("draft", 15, 20.0, c), row("tree", 7, 5.0, c),
                                          row("round", 7, 90.0 + c, c))]
    report.plot_shape(rows, str(tmp_path / "s.png"))
    ax = figs[-1].axes[0]
    assert "--shape qwen3-8b" in ax.get_title()
    assert [t for t in ax.get_xticks()] == [4, 8]  # verify N=3 and round N=7: not AR's 1 or the draft's 16
    colours = {}
    for line in ax.get_lines():
        ar = line.get_label().startswith("_")  # the AR step's dotted line, drawn after its setting's lines
        context = next(r["context"] for r in rows if r["op"] == "ar" and r["time_us"] == line.get_ydata()[0]) \
            if ar else int(line.get_label().split("C=")[1].split()[0])
        colours.setdefault(context, set()).add(line.get_color())
    assert sorted(colours) == [32, 64] and all(len(c) == 1 for c in colours.values())
    assert colours[32] != colours[64]


# the published config.json of each named shape (Llama-3-8B's sizes with Llama 3.1's 128K context and RoPE scaling)
PUBLISHED = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6,
                     num_experts=0, tie_word_embeddings=False),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6,
                       num_experts=0, attention_bias=True, o_proj_bias=False, tie_word_embeddings=False),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, num_experts=0, tie_word_embeddings=False),
    "qwen3-32b": dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64,
                      num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6,
                      num_experts=0, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                          num_kv_heads=4, head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                          rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, tie_word_embeddings=False),
    "gpt-oss-20b": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_layers=24, num_heads=64,
                        num_kv_heads=8, head_dim=64, rope_theta=150000.0, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880,
                        sliding_window=128, attention_bias=True, o_proj_bias=True, attention_sinks=True,
                        swiglu_limit=7.0, tie_word_embeddings=False),
}
PUBLISHED_PARAMS = {"qwen3-8b": 8.19e9, "qwen2.5-7b": 7.61e9, "llama3-8b": 8.03e9, "qwen3-32b": 32.8e9,
                    "qwen3-30b-a3b": 30.5e9,
                    "gpt-oss-20b": 20.9e9}  # the model cards' totals


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_named_shape_is_the_published_models(name):
    """--shape qwen3-8b times the bytes of Qwen3-8B: the layers, heads, KV heads, head and
    intermediate sizes, vocabulary and experts of its published config (every layer an
    MoE layer where it has experts; gpt-oss's window in layers 0, 2, 4, ...), and the
    model card's parameter total when built."""
    from treeflash.bench.shape import LLAMA3_ROPE, SHAPES
    from treeflash.config import GPT_OSS_ROPE_SCALING
    from treeflash.distributed import TPGroup
    from treeflash.models.loader import build_on
    from treeflash.models.transformer import CausalLM
    cfg = SHAPES[name]
    assert {k: getattr(cfg, k) for k in PUBLISHED[name]} == PUBLISHED[name]
    assert [cfg.sparse_layer(i) for i in range(cfg.num_layers)] == [cfg.num_experts > 0] * cfg.num_layers
    assert [cfg.attention_window(i) for i in range(cfg.num_layers)] == \
        ([128, None] * 12 if name == "gpt-oss-20b" else [None] * cfg.num_layers)
    assert cfg.rope_scaling == {"llama3-8b": LLAMA3_ROPE, "gpt-oss-20b": GPT_OSS_ROPE_SCALING}.get(name)
    assert (LLAMA3_ROPE["factor"], LLAMA3_ROPE["original_max_position_embeddings"]) == (8.0, 8192)
    assert (GPT_OSS_ROPE_SCALING["factor"], GPT_OSS_ROPE_SCALING["original_max_position_embeddings"]) == (32.0, 4096)
    with build_on("meta", torch.float32):
        params = sum(p.numel() for p in CausalLM(cfg, TPGroup()).parameters())
    assert params == pytest.approx(PUBLISHED_PARAMS[name], rel=5e-3)


def test_the_shape_drafter_is_a_dense_qwen3_drafter_of_the_targets_width():
    """The shape mode's drafter, as DFlash publishes them: Qwen3 layers of the target's
    width with full attention (no window, sinks or biases even for gpt-oss and Qwen2.5), block 16,
    one tap per drafter layer (DFlash's default taps), the last vocabulary id as mask."""
    from treeflash.bench.shape import BLOCK_SIZE, SHAPES, draft_config
    from treeflash.config import default_target_layer_ids
    for name in ("gpt-oss-20b", "qwen3-8b", "qwen2.5-7b"):
        target = SHAPES[name]
        d = draft_config(target, 5)
        assert d.layers.arch == "qwen3" and d.layers.num_layers == 5 and d.layers.hidden_size == target.hidden_size
        assert [d.layers.attention_window(i) for i in range(5)] == [None] * 5
        assert not d.layers.attention_sinks and not d.layers.attention_bias and not d.layers.o_proj_bias
        assert d.block_size == BLOCK_SIZE == 16 and d.mask_token_id == target.vocab_size - 1
        assert d.target_layer_ids == default_target_layer_ids(target.num_layers, 5)
        assert len(d.target_layer_ids) == 5 and d.num_target_layers == target.num_layers


def test_moe_floors_count_the_distinct_experts_the_ops_tokens_pick(tmp_path, monkeypatch):
    """An MoE layer's routed experts count in a floor only as many times as the expected
    number of distinct experts its target tokens pick (k of E each, uniformly): the AR
    step's batch of 2 tokens, verify(N)'s 2 x (N + 1), a round's likewise, round-dflash's
    2 x 16."""
    import dataclasses

    from treeflash.bench import shape
    tiny = shape.SHAPES["tiny"]
    E, k, inter = 8, 2, 32
    monkeypatch.setitem(shape.SHAPES, "tiny-moe", dataclasses.replace(
        tiny, arch="qwen3_moe", num_experts=E, num_experts_per_tok=k, moe_intermediate_size=inter,
        norm_topk_prob=True))
    out, bs = tmp_path / "rows.jsonl", 2
    assert main(["bench", "--shape", "tiny-moe", "--contexts", "32", "--batch-sizes", str(bs), "--budgets", "0,3,7",
                 "--iters", "1", "--device", "cpu", "--copy-mib", "1", "--out", str(out)]) == 0
    rows = {(r["op"], r["N"]): r["bytes"] for r in map(json.loads, out.read_text().splitlines())}
    per_expert = 4 * 3 * tiny.hidden_size * inter  # float32 gate, up and down

    def experts(tokens):  # all layers' expected distinct experts' bytes
        return tiny.num_layers * per_expert * E * (1 - (1 - k / E) ** tokens)
    ar = rows["ar", 0]
    assert rows["verify", 0] == ar  # root only: the same tokens as the AR step
    for n in (3, 7):
        assert rows["verify", n] - ar == pytest.approx(experts(bs * (n + 1)) - experts(bs), abs=1)
        assert rows["round", n] - rows["round", 3] == pytest.approx(experts(bs * (n + 1)) - experts(bs * 4), abs=1)
    D = shape.BLOCK_SIZE - 1
    assert rows["round-dflash", D] - rows["round", 3] == pytest.approx(experts(bs * (D + 1)) - experts(bs * 4), abs=1)
    assert experts(bs * 8) < tiny.num_layers * per_expert * E  # not yet every expert: the count matters


def test_fp8_blocks_are_rows_by_columns():
    """--fp8 ROWSxCOLS: scales of ROWS x COLS blocks, in that order; --fp8 alone 128x128."""
    from treeflash.bench.shape import _shape_plan, fp8_block
    for given, block in ((["--fp8", "32x16"], (32, 16)), (["--fp8", "16X32"], (16, 32)), ([], None)):
        args = bench_args("--shape", "tiny", "--device", "cpu", *given)
        assert _shape_plan(args).cfg.fp8_block == block, given
    args = bench_args("--shape", "qwen3-8b", "--fp8")
    assert fp8_block(args.fp8) == (128, 128)


def test_eager_ops_read_the_committed_context_only(monkeypatch, capsys):
    """Without CUDA graphs the timed ops read the C committed tokens (max_n = C), as the
    engine's eager rounds do, not the whole (larger) cache that a graph reads."""
    from treeflash.bench import shape
    seen, round_ops = [], shape.round_ops

    def spy(target, drafter, st, budgets, backend, draft_mode, max_n):
        seen.append(max_n)
        return round_ops(target, drafter, st, budgets, backend, draft_mode, max_n)
    monkeypatch.setattr(shape, "round_ops", spy)
    assert main(TINY + ["--contexts", "32,48"]) == 0, capsys.readouterr().err
    assert seen == [32, 48]


def test_a_sampled_shape_state_samples_as_asked(monkeypatch, capsys):
    """The timed state of --temperatures T with filters: every request samples at T with
    the filters, request i with seed S + i (a T > 0 row times sampling, not greedy rounds)."""
    from treeflash.bench import shape
    states, new_shape_state = [], shape.new_shape_state

    def spy(*args, **kwargs):
        states.append(new_shape_state(*args, **kwargs))
        return states[-1]
    monkeypatch.setattr(shape, "new_shape_state", spy)
    assert main(TINY + ["--temperatures", "0.7", "--top-k", "5", "--min-p", "0.1", "--seed", "3",
                        "--batch-sizes", "2"]) == 0, capsys.readouterr().err
    (st,) = states
    s = st.sampling
    assert s.temperature.tolist() == pytest.approx([0.7, 0.7]) and s.top_k.tolist() == [5, 5]
    assert s.min_p.tolist() == pytest.approx([0.1, 0.1]) and s.seed.tolist() == [3, 4]


def test_the_kimi_k2_cut_has_k2s_moe_layers():
    """kimi-k2-4l: Kimi-K2's dense first layer and three of its MoE layers (384 experts
    of 2048, 8 per token, one shared; width 7168, 64 heads, vocabulary 163840): 108 GB
    of bf16 weights, each MoE layer 34 GB."""
    from treeflash.bench.shape import SHAPES
    from treeflash.distributed import TPGroup
    from treeflash.models.loader import build_on
    from treeflash.models.transformer import CausalLM
    cfg = SHAPES["kimi-k2-4l"]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.vocab_size) == (7168, 18432, 64, 163840)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.n_shared_experts) == \
        (384, 8, 2048, 1)
    assert [cfg.sparse_layer(i) for i in range(cfg.num_layers)] == [False, True, True, True]
    with build_on("meta", torch.float32):
        model = CausalLM(cfg, TPGroup())
    bf16 = 2 * sum(p.numel() for p in model.parameters())
    layer = 2 * sum(p.numel() for p in model.model.layers[1].parameters())
    assert round(bf16 / 1e9) == 108 and round(layer / 1e9) == 34


def test_the_shape_header_and_the_fast_ops_note_count_what_they_name(tmp_path, monkeypatch, capsys):
    """The header gives the target's and the drafter's weights in decimal MB (GB from
    10^9 bytes); the note under the table counts the ops that ran under their floor."""
    from treeflash.bench import shape
    from treeflash.bench.options import DRAFT_LAYERS
    monkeypatch.setattr(shape, "copy_bandwidth", lambda device, mib: 1e3)  # every floor far above its op
    out = tmp_path / "rows.jsonl"
    assert main(TINY + ["--out", str(out)]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    fast = sum(r["ratio"] is not None and r["ratio"] < 1 for r in rows)
    assert 0 < fast < len(rows) and f"note: {fast} ops ran faster than their memory floor" in captured.err
    cfg = shape.SHAPES["tiny"]
    target, drafter = shape.random_models(cfg, shape.draft_config(cfg, DRAFT_LAYERS), torch.device("cpu"),
                                          torch.float32)
    sizes = [4 * sum(p.numel() for p in m.parameters()) for m in (target, drafter)]
    assert f"({sizes[0] / 1e6:.2f} MB target, {sizes[1] / 1e6:.2f} MB drafter of 5 layers)" in captured.out
    assert shape._size(2_500_000_000) == "2.50 GB" and shape._size(10 ** 9) == "1.00 GB"
    assert shape._size(999_999_999) == "1000.00 MB"


def test_each_pair_row_is_compared_with_dflash_at_its_own_setting(monkeypatch, tmp_path):
    """vs_dflash (issue 7's ddtree ÷ dflash) is tokens/s over the dflash row of the same
    (batch size, temperature, CUDA graphs); dflash's own row is 1, AR's (run before any
    chain) has none; without dflash among the methods no row has one."""
    rows, _ = fake_pair_run(monkeypatch, tmp_path, ["--methods", "ar,dflash,ddtree", "--budgets", "4,8",
                                                    "--graphs", "on,off", "--batch-sizes", "1,2",
                                                    "--temperatures", "0,1"])
    chain = {(r["batch_size"], r["temperature"], r["graphs"]): r for r in rows if r["method"] == "dflash"}
    assert len(chain) == 8 and len(rows) == 4 * 8
    for r in rows:
        key = (r["batch_size"], r["temperature"], r["graphs"])
        want = None if r["method"] == "ar" else round(r["tokens_per_s"] / chain[key]["tokens_per_s"], 3)
        assert r["vs_dflash"] == want, r
    assert {r["vs_dflash"] for r in rows if r["method"] == "dflash"} == {1.0}
    rows, _ = fake_pair_run(monkeypatch, tmp_path, ["--methods", "ar,ddtree", "--budgets", "4"])
    assert rows and {r["vs_dflash"] for r in rows} == {None}
