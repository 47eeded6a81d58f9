"""Host-to-device copies that do not stall the host."""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device``. To a GPU through pinned memory with ``non_blocking=True``: a copy from
    pageable memory synchronises the stream, so the host would wait for every kernel queued so far
    before it could launch the next (once per layer call, or per micro-batch, where the callers
    copy small tables). The copy is ordered on the current stream, where the consumers run, and
    torch's pinned-memory pool keeps the host buffer until the copy has finished."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
