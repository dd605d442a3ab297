"""The built-in pair shipped in the package (issue 6): it loads with no arguments, in
treeflash and in transformers, and both give the same greedy continuation."""
import pytest
import torch

from treeflash import LLM, SamplingParams
from treeflash.engine.options import BUILTIN_DIR

PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def builtin():
    return LLM(device="cpu", dtype="float32")


def test_defaults_are_the_builtin_pair_with_ddtree(builtin):
    assert builtin.method == "ddtree" and builtin.drafter is not None
    out = builtin.generate(PROMPT, SamplingParams(max_new_tokens=48))[0]
    assert len(out.token_ids) == 48 and out.text.strip()
    assert out.stats["tau"] > 1.5  # a trained drafter: several tokens per target forward


def test_transformers_gives_the_same_greedy_continuation(builtin):
    import transformers  # the test extra: the oracle
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN_DIR / "target", dtype=torch.float32)
    ids = builtin.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                          eos_token_id=None, pad_token_id=0, min_new_tokens=48)[0, len(ids):].tolist()
    ar = LLM(device="cpu", dtype="float32", method="ar")
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    assert ar.generate(ids, params)[0].token_ids == ref
    assert builtin.generate(ids, params)[0].token_ids == ref  # and DDTree gives that same stream


def test_builtin_drafter_config_is_what_training_exports():
    """The shipped drafter's config.json has every key a `treeflash train drafter` export
    writes (TRAINING.md), with the same values where the target fixes them: it is the
    format the README says treeflash trains."""
    import json

    from treeflash.config import ModelConfig
    from treeflash.train.drafter import DrafterShape, drafter_config
    shipped = json.loads((BUILTIN_DIR / "drafter" / "config.json").read_text())
    target = ModelConfig.from_pretrained(BUILTIN_DIR / "target")
    shape = DrafterShape(num_layers=shipped["num_hidden_layers"], block_size=shipped["block_size"],
                         target_layer_ids=shipped["dflash_config"]["target_layer_ids"],
                         mask_token_id=shipped["dflash_config"]["mask_token_id"])
    assert shipped == drafter_config(shape, target, shipped["torch_dtype"])
