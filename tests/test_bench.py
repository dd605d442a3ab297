"""`treeflash bench` on the CPU: model-pair mode on tiny random checkpoints, shape mode
on the tiny shape, and one-line usage errors (exit code 2)."""
import importlib.util
import json

import pytest

from treeflash.bench import batch_indices
from treeflash.checkpoints import write_random_drafter, write_random_target
from treeflash.cli import main

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None

PAIR_FIELDS = {"mode", "method", "budget", "label", "batch_size", "graphs", "temperature", "requests",
               "new_tokens", "rounds", "seconds", "tokens_per_s", "tau", "ms_per_round", "speedup",
               "same_as_ar", "recaptures", "device", "dtype"}
SHAPE_FIELDS = {"mode", "shape", "context", "batch_size", "temperature", "graphs", "op", "N", "time_us",
                "floor_us", "ratio", "vs_ar", "host_us", "bytes", "bandwidth_gbs"}


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
               "--temperatures", "0,1", "--max-new-tokens", "8", "--device", "cpu",
               "--out", str(out), "--plot", str(png)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 * 2 * 2  # (ar, dflash, ddtree-4, ddtree-8) x batch sizes x temperatures
    assert [r["label"] for r in rows[::4]] == ["ar", "dflash", "ddtree-4", "ddtree-8"]  # AR runs first
    for r in rows:
        assert PAIR_FIELDS <= r.keys()
        assert r["requests"] == 2 and r["new_tokens"] == 16 and r["graphs"] is False
        assert r["tokens_per_s"] > 0 and r["ms_per_round"] > 0 and r["tau"] >= 1
        assert r["speedup"] > 0
        if r["method"] == "ar":
            assert r["tau"] == 1.0 and r["speedup"] == 1.0 and r["same_as_ar"] is None
        else:
            assert 0 <= r["same_as_ar"] <= 1
    assert {r["budget"] for r in rows if r["method"] == "ddtree"} == {4, 8}
    assert {r["budget"] for r in rows if r["method"] == "dflash"} == {7}  # block 8: chain of 7

    lines = captured.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method"))
    assert all(h in lines[header] for h in ("tok/s", "tau", "ms/round", "speedup"))
    table = lines[header + 2:header + 2 + len(rows)]
    assert [line.split()[0] for line in table] == [r["label"] for r in rows]
    assert len({len(line) for line in lines[header:header + 2]}) == 1  # header and rule aligned
    if HAVE_MPL:
        assert png.read_bytes()[:4] == b"\x89PNG"
    else:
        assert not png.exists() and "matplotlib" in captured.err


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


def test_pair_mode_corpus_prompts(pair, tmp_path, capsys):
    """--corpus: token-id prompts from the held-out split of a tokenized training corpus."""
    import numpy as np
    target, _ = pair
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    np.save(corpus / "train.npy", (np.arange(4000) % 200 + 3).astype(np.uint16))
    np.save(corpus / "heldout.npy", (np.arange(1000) % 200 + 3).astype(np.uint16))
    (corpus / "corpus.json").write_text("{}")
    out = tmp_path / "rows.jsonl"
    rc = main(["bench", "--model", str(target), "--methods", "ar", "--corpus", str(corpus), "--num-prompts", "2",
               "--batch-sizes", "1", "--temperatures", "0", "--max-new-tokens", "4", "--device", "cpu",
               "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["requests"] == 2 and row["new_tokens"] == 8


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
        assert SHAPE_FIELDS <= r.keys()
        assert r["time_us"] > 0 and r["graphs"] is False and r["host_us"] is None  # CPU: eager, no host split
        if r["op"] == "tree":
            assert r["floor_us"] is None and r["ratio"] is None
        else:
            assert r["floor_us"] > 0 and r["ratio"] == pytest.approx(r["time_us"] / r["floor_us"], rel=1e-2)
        if r["op"] == "ar":
            assert r["vs_ar"] == 1.0
    floor = {(r["context"], r["op"], r["N"]): r["bytes"] for r in rows}
    assert floor[(64, "ar", 0)] > floor[(32, "ar", 0)]           # more context, more KV to read
    assert floor[(32, "round", 3)] > max(floor[(32, "verify", 3)], floor[(32, "draft", 15)])
    assert "verify(N)/AR  C=32" in captured.out and "floor us" in captured.out


@pytest.mark.parametrize("argv,message", [
    (["--shape", "gpt5"], "unknown shape"),
    (["--methods", ""], "empty method list"),
    (["--methods", "ar,beam"], "unknown method"),
    (["--methods", "ddtree", "--budgets", "0,16"], "budget must be >= 1"),
    (["--batch-sizes", "0"], "batch size must be >= 1"),
    (["--temperatures", "hot"], "bad temperature"),
    (["--temperatures", "0,nan"], "bad temperature"),
    (["--graphs", "maybe"], "--graphs takes"),
    (["--graphs", "on", "--device", "cpu"], "needs a CUDA device"),
    (["--shape", "tiny", "--model", "x"], "takes no --model"),
    (["--prompt-file", "a", "--corpus", "b"], "not both"),
])
def test_bad_inputs_exit_2_with_one_line(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
