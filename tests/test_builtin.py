"""The built-in pair shipped in the package (issue 6): it loads with no arguments, in
treeflash and in transformers, and both give the same greedy continuation."""
import pytest
import torch

from treeflash import LLM, SamplingParams
from treeflash.engine.llm import BUILTIN_DIR

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
