"""What a filter floor must be, checked in float64 against the whole row: for tests of
implementations that sum in another order (float32 kernels, sharded vocabularies)."""
import math

import torch


def floor_is_valid(row: torch.Tensor, floor: float, temperature: float, top_k: int, top_p: float, min_p: float,
                   tol: float = 1e-4) -> bool:
    """Whether `floor` is the filters' floor of `row` [V] up to `tol` of probability mass:
    min-p's and top-k's floor where top-p is off; else a logit of the row whose mass
    strictly above is below p + tol and at or above reaches p - tol, over what min-p and
    top-k keep."""
    v = row.double().sort(descending=True).values
    T = max(temperature, 1e-6)
    pre = max(v[min(top_k, len(v)) - 1].item() if top_k > 0 else -math.inf,
              v[0].item() + T * math.log(min_p) if min_p > 0 else -math.inf)
    if top_p >= 1:
        return abs(floor - pre) <= 1e-5 * max(1.0, abs(pre)) if pre > -math.inf else floor == -math.inf
    kept = v[v >= pre]
    probs = torch.softmax((kept - kept[0]) / T, 0)
    above, upto = probs[kept > floor].sum().item(), probs[kept >= floor].sum().item()
    return bool((kept == floor).any()) and above < top_p + tol and upto >= top_p - tol
