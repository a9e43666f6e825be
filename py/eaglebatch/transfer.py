"""Host <-> device copies of a step that never make the host wait for the device.

On CUDA a plain `tensor.to("cuda")` of host memory and `.cpu()` both synchronise the stream:
the host stops until every kernel queued before finishes, so it cannot prepare the next step
while this one runs (engine.overlap). Here host arrays go up through pinned staging (PyTorch's
caching host allocator keeps a staging block until its copy is done) and a step's tokens come
down into pinned memory behind an event, waited for only when the host needs them. On the CPU
both are no-ops: the arrays are used in place.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device, dtype: np.dtype | None = None):
    """`array` (cast to `dtype`) as a tensor on `device`; queued, not waited for, on CUDA."""
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, array: np.ndarray | torch.Tensor) -> None:
    """dst.copy_(array) from host memory; queued, not waited for, on CUDA."""
    host = torch.from_numpy(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) else array
    if dst.device.type != "cpu" and host.device.type == "cpu":  # up, through pinned staging
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)


class HostCopy:
    """A device tensor's copy on the host, started now and waited for by `numpy()`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu":
            self._host, self._event = tensor, None
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def numpy(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()  # only this copy and what was queued before it
        return self._host.numpy()
