"""transfer.py: host arrays reach the device (here: stay on the host) with their values and the
asked dtype; a HostCopy gives back the tensor's values; on CUDA neither synchronises."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eaglebatch.transfer import HostCopy, copy_into, to_device


def test_to_device_on_the_cpu_uses_the_array_in_place_or_casts():
    a = np.arange(5, dtype=np.int64)
    t = to_device(a, torch.device("cpu"))
    t[0] = 7
    assert a[0] == 7  # no copy on the CPU
    cast = to_device(np.arange(3, dtype=np.int32), torch.device("cpu"), np.int64)
    assert cast.dtype == torch.int64 and cast.tolist() == [0, 1, 2]
    strided = to_device(np.arange(10)[::3], torch.device("cpu"))
    assert strided.tolist() == [0, 3, 6, 9]


def test_copy_into_and_host_copy_on_the_cpu():
    dst = torch.zeros(4, dtype=torch.int64)
    copy_into(dst[:3], np.array([3, 4, 5], dtype=np.int32))
    copy_into(dst[3:], torch.tensor([9]))
    assert dst.tolist() == [3, 4, 5, 9]
    assert HostCopy(dst * 2).numpy().tolist() == [6, 8, 10, 18]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_do_not_synchronise():
    dev = torch.device("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        up = to_device(np.arange(1000, dtype=np.int32), dev, np.int64)
        buf = torch.zeros(1000, dtype=torch.int64, device=dev)
        copy_into(buf, np.arange(1000))
        down = HostCopy(up + buf)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert down.numpy().tolist() == [2 * i for i in range(1000)]
