"""What memory this process and a device have left: the checks that refuse weights, a
cache, a batch of graphed states or a training run that would not fit, and the load
figures."""
from __future__ import annotations

import torch

from treeflash.errors import TreeflashError


def available_bytes(device: torch.device) -> int | None:
    """Memory a new tensor can still take on `device` (None: unknown). On CUDA the
    free memory plus what torch's allocator holds unused; on CPU Linux's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    """Resident set size of this process (Linux), or None."""
    return _proc_status("VmRSS")


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def peak_rss_bytes() -> int | None:
    return _proc_status("VmHWM")


def check_weights_fit(shells, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before loading, weights that cannot fit in this host's memory. `shells`
    are the models built on the meta device in float32: their float32 parameters are
    made in `dtype`, FP8 and packed ones keep their own. Only on CPU: there Linux kills
    the process mid-load without a word, where CUDA raises an error the caller reports
    (and tensor-parallel ranks on one host share its memory, so the whole model counts)."""
    if device.type != "cpu":
        return
    need = sum(p.numel() * (dtype.itemsize if p.dtype == torch.float32 else p.element_size())
               for m in shells for p in m.parameters())
    have = available_bytes(device)
    if have is not None and need > have:
        hint = "load them in bfloat16 (--dtype bfloat16) or on a GPU" if dtype.itemsize > 2 else "load them on a GPU"
        raise TreeflashError(f"not enough cpu memory for the weights: {need / 2**30:.1f} GiB in "
                             f"{str(dtype).removeprefix('torch.')}, {have / 2**30:.1f} GiB free: {hint}")
