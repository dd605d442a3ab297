"""The sampling filters' floor by its definition, from the whole row sorted in float64:
exactly (`floor_of_sorted_row`) and up to a tolerance of mass (`floor_is_valid`), for
implementations that sum in another order (float32 kernels, sharded vocabularies)."""
import math

import torch


def _pre_floor(v: torch.Tensor, temperature: float, top_k: int, min_p: float) -> tuple[float, float]:
    """(T clamped as the sampler clamps it, min-p's and top-k's floor) of a row v sorted
    in descending order."""
    T = max(temperature, 1e-6)
    return T, max(v[min(top_k, len(v)) - 1].item() if top_k > 0 else -math.inf,
                  v[0].item() + T * math.log(min_p) if min_p > 0 else -math.inf)


def _kept_probs(v: torch.Tensor, T: float, pre: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits min-p and top-k keep, largest first; their probabilities at T)."""
    kept = v[v >= pre]
    return kept, torch.softmax((kept - kept[0]) / T, 0)


def floor_of_sorted_row(row: torch.Tensor, p) -> float:
    """The filters' smallest kept logit of `row` [V] for SamplingParams p (with the
    float32 parameters a batch holds)."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).double().item()
    v = row.sort(descending=True).values
    T, pre = _pre_floor(v, f32(p.temperature), p.top_k, f32(p.min_p))
    if f32(p.top_p) >= 1:
        return pre
    kept, probs = _kept_probs(v, T, pre)
    return kept[(probs.cumsum(0) - probs) < f32(p.top_p)].min().item()


def floor_is_valid(row: torch.Tensor, floor: float, temperature: float, top_k: int, top_p: float, min_p: float,
                   tol: float = 1e-4) -> bool:
    """Whether `floor` is the filters' floor of `row` [V] up to `tol` of probability mass:
    min-p's and top-k's floor where top-p is off; else a logit of the row whose mass
    strictly above is below p + tol and at or above reaches p - tol, over what min-p and
    top-k keep."""
    v = row.double().sort(descending=True).values
    T, pre = _pre_floor(v, temperature, top_k, min_p)
    if top_p >= 1:
        return abs(floor - pre) <= 1e-5 * max(1.0, abs(pre)) if pre > -math.inf else floor == -math.inf
    kept, probs = _kept_probs(v, T, pre)
    above, upto = probs[kept > floor].sum().item(), probs[kept >= floor].sum().item()
    return bool((kept == floor).any()) and above < top_p + tol and upto >= top_p - tol
