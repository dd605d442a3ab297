"""What memory this process and a device have left: the checks that refuse a cache, a
batch of graphed states or a training run that would not fit, and the load figures."""
from __future__ import annotations

import torch


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
