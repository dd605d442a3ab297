"""`treeflash train ... --resume`: a resumed run keeps the options and shape it was started
with (run.json), compares only the flags actually given, refuses a changed run option,
and its log holds every step once (CPU, tiny shapes, a few seconds)."""
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from test_train import OPTS, TINY, _corpus_files, _tensors, interrupt_after_saving

from treeflash.train.cli import main as cli_main
from treeflash.train.common import Trainer, TrainOptions
from treeflash.train.corpus import collect, write_corpus
from treeflash.train.target import train_target
from treeflash.train.tokenizer import train_tokenizer

SHAPE = ["--hidden-size", "32", "--num-layers", "2", "--num-heads", "2", "--num-kv-heads", "1",
         "--head-dim", "16", "--intermediate-size", "64"]
# all unlike the defaults, so a resume that fell back to them would train other batches
RUN = ["--batch-size", "4", "--seq-len", "24", "--lr", "1e-2", "--warmup-steps", "3", "--eval-tokens", "128",
       "--eval-every", "4", "--save-every", "5", "--log-every", "1", "--seed", "3", "--device", "cpu",
       "--dtype", "float32"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume-corpus")
    src = _corpus_files(base / "src")
    train_tokenizer(collect([src], heldout_fraction=0.25).train, base / "tok", vocab_size=320)
    write_corpus(base / "tok", base / "data", [src], heldout_fraction=0.25)
    return base / "data"


def _log(run_dir):
    """(step, loss or eval_loss) of every log record: timings differ between runs."""
    return [(r["step"], r.get("loss", r.get("eval_loss")))
            for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())]


def _refused(capsys, args: list[str]) -> str:
    """The one-line error of a command refused as a usage error (exit code 2)."""
    capsys.readouterr()
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treeflash: error: ") and "\n" not in err, err
    return err


def test_resume_restores_the_runs_options_and_log(data_dir, tmp_path, capsys, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["target", "--data", str(data_dir), *SHAPE, *RUN, "--max-steps", "12"]
    assert cli_main(common + ["--run", str(a), "--out", str(tmp_path / "a_out")]) == 0
    lr = Trainer.lr

    def die_at_step_9(self):  # state saved at step 5; steps 6-8 logged, then lost
        if self.step == 8:
            raise KeyboardInterrupt
        return lr(self)

    monkeypatch.setattr(Trainer, "lr", die_at_step_9)
    assert cli_main(common + ["--run", str(b), "--out", str(tmp_path / "b_out")]) == 130
    monkeypatch.undo()
    assert [s for s, _ in _log(b)][-1] == 8
    # only --resume: batch size, sequence length, LR schedule, seed, budget, export folder
    # and dtype all come from the run
    assert cli_main(["target", "--data", str(data_dir), "--run", str(b), "--resume"]) == 0
    assert _log(b) == _log(a)  # the same batches, and steps 6-8 logged once
    full, resumed = _tensors(tmp_path / "a_out"), _tensors(tmp_path / "b_out")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    config = json.loads((tmp_path / "b_out" / "config.json").read_text())
    assert config["max_position_embeddings"] == 24 and config["torch_dtype"] == "float32"
    summary = json.loads((b / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["tokens_seen"] == 12 * 4 * 24
    # a finished run resumed with no more budget exports the same weights, logging nothing again
    shutil.rmtree(tmp_path / "b_out")
    assert cli_main(["target", "--data", str(data_dir), "--run", str(b), "--resume"]) == 0
    assert _log(b) == _log(a)
    capsys.readouterr()
    assert cli_main(["target", "--data", str(data_dir), "--run", str(b), "--resume", "--max-steps", "10"]) == 0
    assert "note: the run is past --max-steps 10: nothing to train" in capsys.readouterr().out
    assert _log(b) == _log(a)
    again = _tensors(tmp_path / "b_out")
    assert again.keys() == full.keys() and all(torch.equal(full[k], again[k]) for k in full)
    # a run option given with another value is refused, in one line, before training
    err = _refused(capsys, ["target", "--data", str(data_dir), "--run", str(b), "--resume", "--max-steps", "13",
                            "--batch-size", "8"])
    assert "batch_size = 8 differs from the run's 4" in err
    assert json.loads((b / "summary.json").read_text())["steps"] == 12


@pytest.fixture
def ctrl_c_interrupts():
    """SIGINT as an interactive shell delivers it (a background job starts with it ignored)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_keeps_the_step_it_interrupts(data_dir, tmp_path, capsys, monkeypatch, ctrl_c_interrupts):
    """Ctrl-C (SIGINT) while training stops where its step ends and saves that step:
    nothing trained is lost (saves fall every 5 steps here), and the resumed run gives the
    uninterrupted run's log and weights: its next log line, at step 9, is the mean loss of
    steps 7-9, as if the run had not stopped."""
    a, b = tmp_path / "a", tmp_path / "b"
    run = [*RUN[:RUN.index("--log-every")], "--log-every", "3", *RUN[RUN.index("--log-every") + 2:]]
    common = ["target", "--data", str(data_dir), *SHAPE, *run, "--max-steps", "12"]
    assert cli_main(common + ["--run", str(a), "--out", str(tmp_path / "a_out")]) == 0
    lr = Trainer.lr

    def ctrl_c_in_step_8(self):
        if self.step == 7:  # the 8th step is under way
            os.kill(os.getpid(), signal.SIGINT)
        return lr(self)

    monkeypatch.setattr(Trainer, "lr", ctrl_c_in_step_8)
    capsys.readouterr()
    assert cli_main(common + ["--run", str(b), "--out", str(tmp_path / "b_out")]) == 130
    monkeypatch.undo()
    assert "the state of step 8 is saved" in capsys.readouterr().out
    assert torch.load(b / "state.pt", weights_only=False)["step"] == 8 and not (tmp_path / "b_out").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert cli_main(["target", "--data", str(data_dir), "--run", str(b), "--resume"]) == 0
    assert _log(b) == _log(a) and [s for s, _ in _log(a)][:4] == [3, 4, 6, 8]  # losses at 3, 6; evals at 4, 8
    full, resumed = _tensors(tmp_path / "a_out"), _tensors(tmp_path / "b_out")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)


def test_ctrl_c_in_the_last_evaluation_keeps_the_finished_run(data_dir, tmp_path, capsys, monkeypatch,
                                                               ctrl_c_interrupts):
    """Ctrl-C while the last step's held-out evaluation runs (long, with the default
    --eval-tokens) lets it finish and saves it, then stops before the export: --resume
    trains nothing more and exports the uninterrupted run's weights."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["target", "--data", str(data_dir), *SHAPE, *RUN, "--max-steps", "6"]
    assert cli_main(common + ["--run", str(a), "--out", str(tmp_path / "a_out")]) == 0
    evaluate = Trainer._evaluate

    def ctrl_c_in_the_last(self, *args):
        if self.step == 6:
            os.kill(os.getpid(), signal.SIGINT)
        return evaluate(self, *args)

    monkeypatch.setattr(Trainer, "_evaluate", ctrl_c_in_the_last)
    capsys.readouterr()
    assert cli_main(common + ["--run", str(b), "--out", str(tmp_path / "b_out")]) == 130
    monkeypatch.undo()
    assert "the state of step 6 is saved" in capsys.readouterr().out and not (tmp_path / "b_out").exists()
    assert [p.name for p in b.glob("*.tmp")] == []
    assert cli_main(["target", "--data", str(data_dir), "--run", str(b), "--resume"]) == 0
    assert "resuming at step 6" in capsys.readouterr().out and _log(b) == _log(a)
    full, resumed = _tensors(tmp_path / "a_out"), _tensors(tmp_path / "b_out")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)


def test_a_state_save_cut_short_leaves_the_last_whole_one(tmp_path, monkeypatch):
    """A second Ctrl-C (or a full disk) while the state is written leaves the state of
    the save before, and no half-written file beside it."""
    from treeflash.train.common import RunDir
    run = RunDir(tmp_path / "run", resume=False, kind="target")
    run.path.mkdir()
    run.save_state({"step": 1})
    real = torch.save

    def cut_short(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", cut_short)
    with pytest.raises(KeyboardInterrupt):
        run.save_state({"step": 2})
    monkeypatch.setattr(torch, "save", real)
    assert sorted(p.name for p in run.path.iterdir()) == ["state.pt"] and run.load_state() == {"step": 1}


def test_resume_compares_only_the_given_shape_flags(data_dir, tmp_path, capsys):
    run = ["target", "--data", str(data_dir), "--run", str(tmp_path / "run")]
    assert cli_main(run + SHAPE + RUN + ["--max-steps", "2"]) == 0
    # --num-heads matches; the shape flags left out are not compared with the defaults
    assert cli_main(run + ["--resume", "--num-heads", "2", "--max-steps", "3", "--log-every", "2"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
    err = _refused(capsys, run + ["--resume", "--num-layers", "1", "--max-steps", "4"])
    assert "num_layers = 1 differs from the run's 2" in err


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, data_dir):
    base = tmp_path_factory.mktemp("resume-target")
    train_target(data_dir, base / "run", base / "model", TINY, TrainOptions(max_steps=4, **OPTS))
    return base / "model"  # bfloat16 export


def test_drafter_resume_keeps_its_options(target_dir, data_dir, tmp_path, capsys):
    run = ["drafter", "--target", str(target_dir), "--data", str(data_dir), "--run", str(tmp_path / "run")]
    assert cli_main(run + ["--num-layers", "1", "--block-size", "4", "--gamma", "3", "--blocks-per-seq", "3",
                           "--batch-size", "2", "--seq-len", "16", "--dtype", "float32", "--eval-tokens", "64",
                           "--max-steps", "2", "--tau-prompts", "0", "--device", "cpu"]) == 0
    assert cli_main(run + ["--resume", "--block-size", "4", "--max-steps", "3"]) == 0
    saved = json.loads((tmp_path / "run" / "run.json").read_text())
    assert saved["num_layers"] == 1 and saved["options"]["gamma"] == 3.0
    assert saved["options"]["blocks_per_seq"] == 3 and saved["options"]["max_steps"] == 3
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["num_hidden_layers"] == 1  # not the target's bf16
    assert "gamma = 7.0 differs from the run's 3.0" in _refused(capsys, run + ["--resume", "--gamma", "7"])
    err = _refused(capsys, run + ["--resume", "--generated", str(tmp_path / "gen.npz")])
    assert "this run trains on the corpus" in err


def test_a_resumed_drafter_run_equals_an_uninterrupted_one(target_dir, data_dir, tmp_path, monkeypatch):
    """A drafter run stopped after its state save at step 2 and resumed to step 4 logs the
    same losses and exports the same weights, bit for bit, as one run of 4 steps."""
    from treeflash.train.drafter import DrafterShape, train_drafter
    opts = TrainOptions(max_steps=4, **{**OPTS, "batch_size": 2, "eval_every": 2, "save_every": 2, "log_every": 1,
                                        "eval_tokens": 64})
    args = dict(shape=DrafterShape(num_layers=1, block_size=4), opts=opts, blocks_per_seq=3, tau_prompts=0)
    train_drafter(target_dir, data_dir, tmp_path / "full", tmp_path / "full_out", **args)
    interrupt_after_saving(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(target_dir, data_dir, tmp_path / "half", tmp_path / "half_out", **args)
    monkeypatch.undo()
    train_drafter(target_dir, data_dir, tmp_path / "half", tmp_path / "half_out", resume=True, **args)
    assert _log(tmp_path / "half") == _log(tmp_path / "full")
    full, resumed = _tensors(tmp_path / "full_out"), _tensors(tmp_path / "half_out")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)


# ----------------------------------------------------------------------------- options on resume (cases a mutation review found untested)

def _run_dir(tmp_path, options):
    from treeflash.train.common import RunDir
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.pt").write_bytes(b"")
    (tmp_path / "run" / "run.json").write_text(json.dumps({"kind": "target", "options": options}))
    return RunDir(tmp_path / "run", True, "target")


def test_a_budget_given_on_resume_replaces_both_limits(tmp_path):
    """A run started with --max-steps, resumed with --max-minutes: the time is its budget
    (the old step count, already reached, would train nothing)."""
    from treeflash.train.common import DEFAULT_OPTIONS
    run = _run_dir(tmp_path, {**DEFAULT_OPTIONS, "max_steps": 12})
    got = run.settle_options({k: None for k in DEFAULT_OPTIONS} | {"max_minutes": 5}, DEFAULT_OPTIONS)
    assert got["max_minutes"] == 5 and got["max_steps"] is None
    kept = run.settle_options({k: None for k in DEFAULT_OPTIONS}, DEFAULT_OPTIONS)
    assert kept["max_steps"] == 12


def test_a_resumed_run_may_move_to_another_device(tmp_path):
    from treeflash.train.common import DEFAULT_OPTIONS
    run = _run_dir(tmp_path, {**DEFAULT_OPTIONS, "max_steps": 12, "device": "cpu"})
    got = run.settle_options({k: None for k in DEFAULT_OPTIONS} | {"device": "cuda"}, DEFAULT_OPTIONS)
    assert got["device"] == "cuda"


def test_a_second_ctrl_c_interrupts_at_once(ctrl_c_interrupts):
    """The first Ctrl-C waits for the step's end; a second one (a step that never ends)
    interrupts where it lands."""
    from treeflash.train.common import interrupt_at_step_end
    with interrupt_at_step_end() as interrupted:
        assert not interrupted()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert interrupted()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_session_options_may_change_on_resume(tmp_path):
    """The intervals, the export and the τ measurement are this session's: given on
    resume, they replace the run's rather than being refused."""
    from treeflash.train.common import DEFAULT_OPTIONS, SESSION_OPTIONS
    saved = {**DEFAULT_OPTIONS, "max_steps": 12, "dtype": "bfloat16", "tau_prompts": 16, "tau_new_tokens": 128,
             "generated": "/data/gen.npz", "out": "/models/a"}
    run = _run_dir(tmp_path, saved)
    changed = {"eval_every": 7, "save_every": 9, "log_every": 3, "device": "cuda", "out": "/models/b",
               "max_shard_mb": 4, "dtype": "float32", "tau_prompts": 2, "tau_new_tokens": 64,
               "generated": "/moved/gen.npz"}
    assert set(changed) == SESSION_OPTIONS - {"max_steps", "max_minutes"}
    got = run.settle_options({k: None for k in saved} | changed, DEFAULT_OPTIONS)
    assert {k: got[k] for k in changed} == changed and got["max_steps"] == 12


def test_a_run_resumes_only_as_its_own_kind(tmp_path):
    from treeflash.errors import UsageError
    from treeflash.train.common import RunDir
    _run_dir(tmp_path, {})
    with pytest.raises(UsageError, match="is a target run, not a drafter run"):
        RunDir(tmp_path / "run", True, "drafter")
