"""Host data onto the device without making the host wait for the device."""

from __future__ import annotations

import torch


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, copied without a host sync.

    A plain ``.to("cuda")`` from pageable memory is a synchronous copy: the
    host waits until the stream has run everything queued before it (inside a
    step, the forward). From pinned memory the copy is queued with
    ``non_blocking=True`` and the host goes on; torch's caching host allocator
    keeps the pinned block until the copy that reads it has run. Elsewhere
    this is ``host.to(device)`` (``host`` itself on the CPU).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
