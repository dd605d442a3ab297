"""Model configurations read from Hugging Face `config.json` files.

One dataclass per kind of checkpoint: `ModelConfig` for targets (Qwen3, Qwen2, Llama,
Mistral, Qwen3-MoE, whose mixture-of-experts keys it reads too, and gpt-oss) and `DraftConfig` for DFlash
drafters (a Qwen3-style stack plus the DFlash keys).
Both refuse what they cannot run with a one-line `TreeflashError`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from treeflash.errors import TreeflashError
from treeflash.files import is_hub_id, read_json_object

TARGET_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
                        "MistralForCausalLM": "mistral", "Qwen3MoeForCausalLM": "qwen3_moe",
                        "GptOssForCausalLM": "gpt_oss"}

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "double": torch.float64, "fp64": torch.float64,
}


def read_config_json(path: str | Path, what: str = "model") -> dict:
    """Read `<dir>/config.json`, with a clear error for every way it can be wrong;
    `what` names the folder in them (model, drafter)."""
    if not str(path).strip():  # Path("") is the current folder: never what was meant
        raise TreeflashError(f"empty {what} path")
    folder = Path(path)
    if not folder.exists():
        hint = (f" (nor in the Hugging Face cache: treeflash does not download; fetch it first, e.g. "
                f"`hf download {path}`)") if is_hub_id(str(path)) else ""
        raise TreeflashError(f"{what} folder not found: {path}{hint}")
    if not folder.is_dir():
        raise TreeflashError(f"{what} path is not a folder: {folder}")
    cfg = folder / "config.json"
    if not cfg.exists():
        raise TreeflashError(f"config.json not found in {folder} (the {what} folder)")
    return read_json_object(cfg, missing_ok=False)


def _flag(data: dict, key: str, where: str, default: bool = False) -> bool:
    """A true/false key (absent or null: `default`). Not bool(): "false" would read as true."""
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TreeflashError(f"{where}: '{key}' must be true or false, got {value!r}")
    return value


def _require(data: dict, key: str, where: str) -> int:
    """A required size: a positive integer (below 2^31, as torch's shapes take them)."""
    if key not in data or data[key] is None:
        raise TreeflashError(f"{where} lacks required key '{key}'")
    value = data[key]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2 ** 31:
        raise TreeflashError(f"{where}: '{key}' must be a positive integer below 2^31, got {value!r}")
    return value


def _number(value, key: str, where: str, positive: bool = True) -> float:
    """A finite number > 0 (>= 0 unless `positive`), or a one-line error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise TreeflashError(f"{where}: '{key}' must be a number "
                             f"{'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _rope(data: dict, where: str = "config.json") -> tuple[float, dict | None]:
    """RoPE theta and scaling as transformers 5 reads them from either style of config:
    `rope_scaling` (transformers 4's key), when given, is the whole of it, else
    `rope_parameters`; a `rope_theta` inside it wins over the top-level one; its type is
    `rope_type`, else `type`. A scaling's original context is the top-level
    `original_max_position_embeddings` (Phi-3's layout), else its own, else
    `max_position_embeddings`; where the two are given and differ, transformers 4 and 5
    disagree, so the config is refused."""
    params = data.get("rope_parameters") or {}
    scaling = data.get("rope_scaling") or None
    if not isinstance(params, dict) or not isinstance(scaling, (dict, type(None))):
        raise TreeflashError(f"{where}: rope_parameters / rope_scaling must be JSON objects")
    rope = scaling if scaling is not None else params
    if any(isinstance(v, dict) for v in rope.values()):
        raise TreeflashError(f"{where}: RoPE parameters per layer type are not supported")
    theta = _number(rope.get("rope_theta", data.get("rope_theta", 10000.0)), "rope_theta", where)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("llama3", "yarn"):
        raise TreeflashError(f"{where}: unsupported rope scaling type '{kind}' (supported: llama3, yarn)")
    outer, inner = data.get("original_max_position_embeddings"), rope.get("original_max_position_embeddings")
    if outer is not None and inner is not None and outer != inner:
        raise TreeflashError(f"{where}: original_max_position_embeddings is {outer} but the rope scaling's is "
                             f"{inner} (transformers 4 reads the second, 5 the first)")
    original = next((v for v in (outer, inner, data.get("max_position_embeddings")) if v is not None), None)
    if original is None:
        raise TreeflashError(f"{where}: {kind} rope scaling lacks 'original_max_position_embeddings'")
    scaling = {**rope, "original_max_position_embeddings": original}
    if kind == "yarn":
        return theta, _yarn(scaling, where)
    for key in ("factor", "low_freq_factor", "high_freq_factor"):  # as transformers and vLLM: no defaults
        if key not in scaling:
            raise TreeflashError(f"{where}: llama3 rope scaling lacks '{key}'")
    _require(scaling, "original_max_position_embeddings", f"{where}: llama3 rope scaling")
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        _number(scaling[key], f"rope scaling {key}", where)
    # the band between them is a ramp over 1 / their difference
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    if not high > low:
        raise TreeflashError(f"{where}: llama3 rope scaling needs high_freq_factor > low_freq_factor, "
                             f"got {high} and {low}")
    return theta, scaling


def _yarn(scaling: dict, where: str) -> dict:
    """YaRN's keys (gpt-oss), checked; the frequencies are made in `layers.rotary`."""
    for key in ("factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            raise TreeflashError(f"{where}: yarn rope scaling lacks '{key}'")
    _require(scaling, "original_max_position_embeddings", f"{where}: yarn rope scaling")
    for key in ("factor", "beta_fast", "beta_slow", "attention_factor"):
        if scaling.get(key) is not None:
            _number(scaling[key], f"rope scaling {key}", where)
    if not 2 <= scaling["original_max_position_embeddings"] * scaling["factor"] < 2 ** 31:
        raise TreeflashError(f"{where}: yarn rope scaling's original_max_position_embeddings x factor is the "
                             f"context served, and must be from 2 to 2^31 - 1 positions, got "
                             f"{scaling['original_max_position_embeddings']} x {scaling['factor']:g}")
    if scaling.get("mscale") or scaling.get("mscale_all_dim"):
        raise TreeflashError(f"{where}: yarn rope scaling with mscale (DeepSeek's) is not supported")
    return {**scaling, "rope_type": "yarn"}


MAX_ATTENTION_FACTOR = 10.0  # YaRN's own, 0.1 ln(factor) + 1, reaches it at a factor of e^90


def _check_rotary(head_dim: int, theta: float, scaling: dict | None, max_pos: int, where: str) -> None:
    """Refuse RoPE settings that pass as numbers but overflow float32 (a tiny rope_theta or
    scaling factor makes infinite frequencies, a huge YaRN attention_factor infinite cos
    and sin): every logit would be NaN, and the model would answer token 0."""
    from treeflash.layers.rotary import rope_inv_freq, yarn_attention_factor
    if not torch.isfinite(rope_inv_freq(head_dim, theta, scaling) * max_pos).all():
        raise TreeflashError(f"{where}: rope_theta {theta:g}" + (" with its rope scaling" if scaling else "")
                             + f" gives rotary angles that overflow float32 over {max_pos} positions")
    if yarn_attention_factor(scaling) > MAX_ATTENTION_FACTOR:
        raise TreeflashError(f"{where}: rope scaling attention_factor {yarn_attention_factor(scaling):g} is above "
                             f"{MAX_ATTENTION_FACTOR:g} (it scales every attention score by its square)")


def served_context(max_pos: int, scaling: dict | None) -> tuple[int, str]:
    """The positions a model serves, and where that number comes from: its
    max_position_embeddings, or with YaRN its original context times its factor, the
    context YaRN stretches the rotation to (Qwen3's recipe: 32768 x 4, past its
    max_position_embeddings of 40960), as vLLM derives it; llama3 scaling keeps
    max_position_embeddings (Llama 3.1 gives it)."""
    if scaling is not None and scaling.get("rope_type") == "yarn":
        original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
        return int(original * factor), f"YaRN's original_max_position_embeddings {original} x factor {factor:g}"
    return max_pos, "max_position_embeddings"


def token_id_list(value, key: str, where: str) -> list[int]:
    """A config's token id or list of them (eos_token_id's two forms) as a list."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TreeflashError(f"{where}: '{key}' must be a token id or a list of token ids, got {value!r}")
    return list(values)


def _moe_fields(data: dict, num_layers: int, where: str) -> dict:
    """The mixture-of-experts keys of a Qwen3-MoE config. The router-loss keys
    (`router_aux_loss_coef`, `output_router_logits`) only matter in training: ignored.
    `n_shared_experts` (DeepSeek's name; Qwen3-MoE has none) adds always-on experts."""
    experts = data.get("num_experts")
    if experts is None:
        experts = data.get("num_local_experts")  # transformers 5's name
    top_k = _require(data, "num_experts_per_tok", where)
    fields = dict(
        num_experts=_require({"num_experts": experts}, "num_experts", where),
        num_experts_per_tok=top_k,
        moe_intermediate_size=_require(data, "moe_intermediate_size", where),
        decoder_sparse_step=_require({"decoder_sparse_step": data.get("decoder_sparse_step", 1)},
                                     "decoder_sparse_step", where),
        norm_topk_prob=_flag(data, "norm_topk_prob", where),
        mlp_only_layers=data.get("mlp_only_layers") or [],
        n_shared_experts=data.get("n_shared_experts") or 0,
    )
    if top_k > fields["num_experts"]:
        raise TreeflashError(f"{where}: num_experts_per_tok ({top_k}) exceeds "
                             f"num_experts ({fields['num_experts']})")
    layers = fields["mlp_only_layers"]
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                               and 0 <= i < num_layers for i in layers):
        raise TreeflashError(f"{where}: 'mlp_only_layers' must list layer ids "
                             f"0..{num_layers - 1}, got {layers!r}")
    shared = fields["n_shared_experts"]
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise TreeflashError(f"{where}: 'n_shared_experts' must be an integer >= 0, got {shared!r}")
    return fields


def _gpt_oss_fields(data: dict, num_layers: int, where: str) -> dict:
    """gpt-oss: every layer has experts (softmax over the top-k router logits, which is
    the top-k of the softmax renormalized), biases in the router and the experts, the
    experts' clamped SwiGLU, attention sinks, and a sliding window in the layers
    `layer_types` names "sliding_attention" (by default every other one, from layer 0)."""
    experts = _require(data, "num_local_experts", where)
    top_k = _require(data, "num_experts_per_tok", where) if "num_experts_per_tok" in data \
        else _require(data, "experts_per_token", where)
    if top_k > experts:
        raise TreeflashError(f"{where}: num_experts_per_tok ({top_k}) exceeds "
                             f"num_local_experts ({experts})")
    window = data.get("sliding_window", 128)
    types = _layer_types(data, num_layers, where) or \
        ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise TreeflashError(f"{where}: 'sliding_window' must be a positive integer, got {window!r}")
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=_require(data, "intermediate_size", where), norm_topk_prob=True,
                sliding_window=window if sliding else None, sliding_layers=sliding, attention_sinks=True,
                expert_bias=True, swiglu_limit=_number(data.get("swiglu_limit", 7.0), "swiglu_limit", where),
                swiglu_alpha=_number(data.get("swiglu_alpha", 1.702), "swiglu_alpha", where))


# transformers' defaults (its Qwen3Config, Qwen2Config, LlamaConfig, MistralConfig,
# Qwen3MoeConfig, GptOssConfig) for the keys a config leaves out, where they differ from
# the fallbacks in `from_dict` (head_dim: hidden / heads; num_key_value_heads: the heads;
# rms_norm_eps 1e-6; rope_theta 10000; sliding_window: `_sliding_windows`); published
# configs hold them all, hand-written ones may not.
ARCH_DEFAULTS = {
    "qwen3": {"head_dim": 128, "max_position_embeddings": 32768},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072},
    "qwen3_moe": {"max_position_embeddings": 32768},
    "llama": {"max_position_embeddings": 2048},
    "gpt_oss": {"rms_norm_eps": 1e-5, "head_dim": 64, "max_position_embeddings": 131072, "rope_theta": 150000.0},
}
GPT_OSS_ROPE_SCALING = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096}


def _with_arch_defaults(data: dict, arch: str) -> dict:
    """`data` with its architecture's defaults for the keys it leaves out (gpt-oss: YaRN
    unless the config gives a scaling, at its own rope_theta if it gives one)."""
    filled = {**ARCH_DEFAULTS[arch], **data}  # (a null head_dim is hidden / heads, as transformers' gpt-oss)
    if arch == "gpt_oss" and data.get("rope_parameters") is None and data.get("rope_scaling") is None:
        filled["rope_scaling"] = GPT_OSS_ROPE_SCALING
    return filled


def _mxfp4(quant, arch: str, where: str) -> bool:
    """Whether quantization_config says MXFP4: gpt-oss's experts as published, which its
    experts dequantize when they load (`models.moe.GptOssExperts`); gpt-oss takes no other
    quantization."""
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        if arch != "gpt_oss":
            raise TreeflashError(f"{where}: MXFP4 quantization is supported only for gpt-oss experts")
        return True
    if quant and arch == "gpt_oss":
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise TreeflashError(f"{where}: gpt-oss is supported unquantized or with MXFP4 experts, "
                             f"not with quant_method '{method}'")
    return False


def _architectures(data: dict, where: str) -> list[str]:
    """`architectures` as a list of names (a lone string is one name; absent: none)."""
    archs = data.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise TreeflashError(f"{where}: 'architectures' must be a list of names, got {archs!r}")
    return archs


# The MLP is SwiGLU: gate activation SiLU ("swish" is transformers' other name for it).
SUPPORTED_ACTS = ("silu", "swish")


def _check_hidden_act(data: dict, where: str) -> None:
    """Refuse an MLP activation other than SiLU: the model would run, with wrong logits."""
    act = data.get("hidden_act")
    if act is not None and act not in SUPPORTED_ACTS:
        raise TreeflashError(f"{where}: hidden_act {act!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ACTS)})")


def _layer_types(data: dict, num_layers: int, where: str, windows: bool = True) -> list[str] | None:
    """`layer_types`, checked: full_attention or sliding_attention for each layer (None:
    absent). Without `windows` (they do not apply, the list is unused) only the names."""
    types = data.get("layer_types")
    if types is not None and (not isinstance(types, list) or (windows and len(types) != num_layers)
                              or not set(types) <= {"full_attention", "sliding_attention"}):
        raise TreeflashError(f"{where}: 'layer_types' must name full_attention or sliding_attention "
                             f"for each of the {num_layers} layers, got {types!r}")
    return types


def _sliding_windows(data: dict, arch: str, num_layers: int, context: int, where: str) -> dict:
    """The sliding window of Qwen2, Qwen3, Qwen3-MoE and Mistral (the `sliding_window` and
    `sliding_layers` of ModelConfig), by transformers' rules. Qwen2 and Qwen3 apply it
    only with `use_sliding_window` (else `sliding_window` is ignored), in the layers
    `layer_types` names "sliding_attention", or, without it, from layer
    `max_window_layers` on; Qwen3-MoE slides in every layer once `use_sliding_window` is
    set. Mistral ignores `use_sliding_window` and slides unless `sliding_window` is null:
    in every layer, or in those its `layer_types` names (transformers' AutoConfig reads a
    Mistral config with that key as Ministral's, whose layers follow it). An absent
    `sliding_window` is 4096. Llama has no sliding window (gpt-oss: `_gpt_oss_fields`).
    A window at least as long as the served `context` is full attention."""
    if arch not in ("qwen2", "qwen3", "qwen3_moe", "mistral"):
        return {}
    if arch == "mistral":
        types = _layer_types(data, num_layers, where)
    else:
        slides = _flag(data, "use_sliding_window", where)
        types = _layer_types(data, num_layers, where, windows=slides)
        if not slides:
            return {}
    window = data.get("sliding_window", 4096)  # transformers' default
    if window is None:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise TreeflashError(f"{where}: 'sliding_window' must be a positive integer or null, got {window!r}")
    if window >= context:
        return {}  # a window as long as the context is full attention
    if arch == "qwen3_moe" or (arch == "mistral" and types is None):
        sliding = range(num_layers)
    elif types is not None:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    else:
        first = data.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int):
            raise TreeflashError(f"{where}: 'max_window_layers' must be an integer, got {first!r}")
        sliding = range(max(first, 0), num_layers)
    return {"sliding_window": window, "sliding_layers": tuple(sliding)} if sliding else {}


def _biases(data: dict, arch: str, where: str) -> dict:
    """Which projections have biases (ModelConfig's attention_bias: q/k/v; o_proj_bias;
    mlp_bias), as transformers builds each architecture: Qwen2 always on q/k/v and never
    on o_proj or the MLP, Mistral never, whatever the config says (their classes read no
    such keys); the others by `attention_bias` (q/k/v and o_proj alike; gpt-oss's default
    is true) and `mlp_bias`."""
    if arch in ("qwen2", "mistral"):
        return dict(attention_bias=arch == "qwen2", o_proj_bias=False, mlp_bias=False)
    attention = _flag(data, "attention_bias", where, default=arch == "gpt_oss")
    return dict(attention_bias=attention, o_proj_bias=attention, mlp_bias=_flag(data, "mlp_bias", where))


FP8_BLOCK = (128, 128)  # the blocks of DeepSeek-V3 and Qwen3-FP8, and of `quantization="fp8"`


def _fp8_blocks(quant, where: str) -> dict:
    """ModelConfig's fp8 fields from a quantization_config: the block-scaled FP8 format
    (weights e4m3, `weight_scale_inv` per block, activations left in the model's dtype);
    any other quantization is refused, never loaded as garbage."""
    if not quant:
        return {}
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if method != "fp8" or block is None:
        what = f"quant_method '{method}'" + (" without weight_block_size (per-tensor scales)" if method == "fp8" else "")
        raise TreeflashError(f"quantized checkpoints are supported only as block-scaled FP8 (quant_method fp8 with "
                             f"weight_block_size, as DeepSeek-V3 and Qwen3-FP8); {where} has {what}")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool)
                                                                and b > 0 for b in block)):
        raise TreeflashError(f"{where}: quantization_config.weight_block_size must be two positive "
                             f"integers, got {block!r}")
    fmt, scheme = quant.get("fmt", "e4m3"), quant.get("activation_scheme", "dynamic")
    if fmt != "e4m3" or scheme != "dynamic":
        raise TreeflashError(f"{where}: FP8 {fmt} weights with {scheme} activation scales are not supported "
                             f"(only e4m3, dynamic)")
    return {"fp8_block": tuple(block)}  # which layers: `from_pretrained` reads the weights' dtypes


@dataclass
class ModelConfig:
    """A decoder-only target: Qwen3 (q/k norms), Qwen2 (q/k/v biases), Llama, Mistral,
    Qwen3-MoE (Qwen3 whose MLP is a sparse mixture of experts in the layers
    `sparse_layer` picks), or gpt-oss (experts, attention sinks, sliding-window layers,
    YaRN)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # biases on the q/k/v projections
    o_proj_bias: bool = False         # and on the output projection (not Qwen2's)
    mlp_bias: bool = False
    torch_dtype: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # mixture of experts (0 experts: every layer has the dense MLP of intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False      # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    n_shared_experts: int = 0         # always-on experts of moe_intermediate_size each
    # FP8 weights (quantization_config fp8 with weight_block_size, as DeepSeek-V3's and
    # Qwen3-FP8's): each linear layer's weight in float8 e4m3 with one float scale per
    # block of (rows, columns) (`layers.linear`), except the layers whose weights (by
    # checkpoint name) are in fp8_skip: those the checkpoint stores in higher precision
    fp8_block: tuple[int, int] | None = None
    fp8_skip: frozenset[str] = frozenset()
    # a sliding window in some layers (gpt-oss; Qwen2, Qwen3 with use_sliding_window; Mistral)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # gpt-oss: attention sinks, a router and experts with biases, the experts' SwiGLU
    # clamped at swiglu_limit (None: the plain SwiGLU) with sigmoid gain swiglu_alpha
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    @property
    def context_length(self) -> int:
        """The positions the model serves (see `served_context`)."""
        return served_context(self.max_position_embeddings, self.rope_scaling)[0]

    @property
    def context_origin(self) -> str:
        """Where `context_length` comes from, for messages."""
        return served_context(self.max_position_embeddings, self.rope_scaling)[1]

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3_moe")

    def attention_window(self, i: int) -> int | None:
        """The sliding window of layer i (a query at position p sees keys at positions
        > p - window), None for full attention."""
        return self.sliding_window if i in self.sliding_layers else None

    def sparse_layer(self, i: int) -> bool:
        """Whether layer i has experts (HF's rule: every `decoder_sparse_step`-th layer,
        except those in `mlp_only_layers`)."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, data: dict, where: str = "config.json") -> "ModelConfig":
        archs = _architectures(data, where)
        arch = None
        for a in archs:
            if a in TARGET_ARCHITECTURES:
                arch = TARGET_ARCHITECTURES[a]
        model_type = data.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise TreeflashError(f"{where}: 'model_type' must be a name, got {model_type!r}")
        if arch is None and not archs:
            arch = model_type if model_type in TARGET_ARCHITECTURES.values() else None
        if arch is None:
            name = archs[0] if archs else data.get("model_type", "<none>")
            if name == "DFlashDraftModel":
                raise TreeflashError(f"{where} is a DFlash drafter: pass it as the draft model (--draft-model), "
                                     f"with its target as the model")
            raise TreeflashError(f"{where}: unsupported architecture '{name}' "
                                 f"(supported: {', '.join(TARGET_ARCHITECTURES)})")
        if model_type is not None and model_type != arch:  # e.g. a Mistral's sliding window lost as Llama
            named = next(a for a in archs if TARGET_ARCHITECTURES.get(a) == arch)
            raise TreeflashError(f"{where}: architectures names {named} but model_type is '{model_type}' (transformers "
                                 f"builds the model that model_type names): make them agree")
        data = _with_arch_defaults(data, arch)
        fp8 = {} if _mxfp4(data.get("quantization_config"), arch, where) else \
            _fp8_blocks(data.get("quantization_config"), where)
        hidden = _require(data, "hidden_size", where)
        heads = _require(data, "num_attention_heads", where)
        kv_heads = _require(data, "num_key_value_heads", where) if data.get("num_key_value_heads") is not None else heads
        if heads % kv_heads:
            raise TreeflashError(f"{where}: num_attention_heads ({heads}) "
                                 f"is not a multiple of num_key_value_heads ({kv_heads})")
        theta, scaling = _rope(data, where)
        max_pos = data.get("max_position_embeddings")
        num_layers = _require(data, "num_hidden_layers", where)
        _check_hidden_act(data, where)
        moe = _moe_fields(data, num_layers, where) if arch == "qwen3_moe" else \
            _gpt_oss_fields(data, num_layers, where) if arch == "gpt_oss" else {}
        head_dim = _require(data, "head_dim", where) if data.get("head_dim") is not None else hidden // heads
        if head_dim % 2:
            raise TreeflashError(f"{where}: head_dim {head_dim} is odd (rotary embeddings turn "
                                 f"pairs of features)")
        max_pos = ARCH_DEFAULTS[arch]["max_position_embeddings"] if max_pos is None \
            else _require(data, "max_position_embeddings", where)
        context = served_context(max_pos, scaling)[0]
        _check_rotary(head_dim, theta, scaling, context, where)
        windows = _sliding_windows(data, arch, num_layers, context, where)
        vocab = _require(data, "vocab_size", where)
        eos = token_id_list(data.get("eos_token_id"), "eos_token_id", where)
        if any(e >= vocab for e in eos):
            raise TreeflashError(f"{where}: eos_token_id {max(eos)} is outside the vocabulary of {vocab} tokens")
        return cls(
            arch=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_require(data, "intermediate_size", where),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_number(data.get("rms_norm_eps", 1e-6), "rms_norm_eps", where, positive=False),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=_flag(data, "tie_word_embeddings", where),
            torch_dtype=data.get("dtype") or data.get("torch_dtype"),  # transformers 5 reads `dtype` first
            eos_token_ids=eos,
            **_biases(data, arch, where), **moe, **windows, **fp8,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        cfg = cls.from_dict(read_config_json(path), where=f"config.json in {path}")
        if cfg.fp8_block is None:
            return cfg
        # An FP8 checkpoint's layers are FP8 where its weights are: writers match the names in
        # modules_to_not_convert as substrings ("layers.1" skips layer 10 too), prefixes or
        # regexes, so only the stored dtypes say which layers they left unquantized.
        from treeflash.models.loader import stored_unquantized  # the loader reads configs: not at the top
        return replace(cfg, fp8_skip=stored_unquantized(path))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default taps: evenly spaced from layer 1 to layer L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    ids = [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    return sorted({min(max(i, 0), num_target_layers - 1) for i in ids})  # shallow targets: clamp


# Largest drafter block accepted. Published DFlash drafters use 16; each round drafts
# block_size - 1 tokens and the engine sizes per-request buffers (and masks, quadratic
# in the block) by it, so a typo like 100000 would allocate gigabytes and hang.
MAX_BLOCK_SIZE = 256


@dataclass
class DraftConfig:
    """A DFlash drafter: a Qwen3-style layer stack reading the target's hidden states."""

    layers: ModelConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None
    # as the reference DFlash drafter applies them: block embeddings x scale; draft logits
    # x multiplier, then cap * tanh(logits / cap) (None: no cap)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, data: dict, where: str = "config.json") -> "DraftConfig":
        archs = _architectures(data, where)
        if archs and "DFlashDraftModel" not in archs:
            raise TreeflashError(f"{where} is not a DFlash drafter (architectures: {archs})")
        dflash = data.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise TreeflashError(f"{where}: dflash_config must be a JSON object, got {dflash!r}")
        if data.get("quantization_config"):
            raise TreeflashError(f"{where} is quantized (quantization_config): drafters are loaded in "
                                 f"the model's dtype only")
        layers = ModelConfig.from_dict({**data, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, where)
        block = dflash.get("block_size", data.get("block_size", 16))
        if isinstance(block, bool) or not isinstance(block, int) or not 2 <= block <= MAX_BLOCK_SIZE:
            raise TreeflashError(f"{where}: block_size must be an integer from 2 to {MAX_BLOCK_SIZE}, "
                                 f"got {block!r}")
        mask = dflash.get("mask_token_id", data.get("mask_token_id"))
        if mask is None:
            raise TreeflashError(f"{where} lacks dflash_config.mask_token_id")
        if not isinstance(mask, int) or isinstance(mask, bool):
            raise TreeflashError(f"{where}: mask_token_id must be a token id (an integer), got {mask!r}")
        num_target = data.get("num_target_layers")
        if num_target is not None:
            num_target = _require(data, "num_target_layers", where)
        ids = dflash.get("target_layer_ids", data.get("target_layer_ids"))
        if ids is None:
            if num_target is None:
                raise TreeflashError(f"{where} has neither target_layer_ids nor num_target_layers")
            ids = default_target_layer_ids(num_target, layers.num_layers)
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TreeflashError(f"{where}: target_layer_ids must be a non-empty list of integers, got {ids!r}")
        if len(set(ids)) != len(ids):  # the same layer's features twice: surely a mistake
            raise TreeflashError(f"{where}: target_layer_ids names a layer twice: {ids!r}")
        if data.get("is_causal"):
            raise TreeflashError(f"{where} sets is_causal: a causal draft block is not supported "
                                 f"(DFlash drafters attend to the whole block)")
        # DFlash's rule: layers of type sliding_attention are causal unless is_causal is false
        types = data.get("layer_types")
        typed = "sliding_attention" in types if isinstance(types, list) else \
            bool(data.get("use_sliding_window")) and data.get("max_window_layers", 28) < layers.num_layers
        if typed and data.get("is_causal") is None:
            raise TreeflashError(f"{where} has sliding_attention layers without is_causal false: DFlash makes "
                                 f"them causal, and a causal draft block is not supported")

        def scale(key: str, default, positive: bool = True):  # dflash_config's, else the top level's
            value = dflash.get(key, data.get(key))
            return default if value is None else _number(value, key, where, positive)

        cap = scale("final_logit_softcapping", None, positive=False)  # 0: no cap
        if layers.sliding_layers and layers.sliding_window < block:  # its keys ahead in the block would slide too
            raise TreeflashError(f"{where}: a sliding window of {layers.sliding_window} is shorter than the "
                                 f"block of {block}")
        return cls(layers=layers, block_size=block, mask_token_id=mask,
                   target_layer_ids=list(ids), num_target_layers=num_target,
                   input_embedding_scale=scale("input_embedding_scale", 1.0),
                   output_multiplier=scale("output_multiplier", 1.0), final_logit_softcapping=cap or None)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DraftConfig":
        return cls.from_dict(read_config_json(path, "drafter"), where=f"drafter config.json in {path}")

    def check_fits(self, target: ModelConfig) -> None:
        """Refuse a drafter that was not made for this target."""
        if self.layers.hidden_size != target.hidden_size:
            raise TreeflashError(f"drafter hidden_size {self.layers.hidden_size} does not match "
                                 f"the target's {target.hidden_size}")
        if self.layers.vocab_size != target.vocab_size:
            raise TreeflashError(f"drafter vocab_size {self.layers.vocab_size} does not match "
                                 f"the target's {target.vocab_size}")
        if self.num_target_layers is not None and self.num_target_layers != target.num_layers:
            raise TreeflashError(f"drafter was made for a target of {self.num_target_layers} layers, "
                                 f"this target has {target.num_layers}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise TreeflashError(f"drafter taps target layers {bad}, but the target has "
                                 f"layers 0..{target.num_layers - 1}")
        if self.block_size > target.context_length:
            raise TreeflashError(f"drafter block_size {self.block_size} exceeds the target's context "
                                 f"({target.context_origin} {target.context_length})")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise TreeflashError(f"drafter mask_token_id {self.mask_token_id} is outside the "
                                 f"target's vocabulary of {target.vocab_size}")
