"""Stage 3 with `offload_param` and fp32, without `offload_optimizer`: the parameter parts
live on the host, the gradients and the optimizer on the device. The fp32 master must be a
device copy (stepped with the device's gradients, copied back to the host part after the
step), never the host part itself: on a GPU that would put a host master next to a device
gradient and fail at the first step, while on the CPU both are the host and nothing shows.
A device other than the host is simulated with the meta device."""

from __future__ import annotations

import torch
from torch import nn

from zerowatch.engine.comm import Comm
from zerowatch.engine.flat import Segment
from zerowatch.engine.hooks import ObserverRegistry
from zerowatch.engine.optim import MasterWeights
from zerowatch.engine.phases import Phases


def _segment(device: torch.device) -> Segment:
    seg = Segment(0, [("w", nn.Parameter(torch.zeros(6)))], group=0, shards=1, rank=0)
    seg.param_shard = torch.arange(6, dtype=torch.float32)  # the host part
    seg.grad_shard = torch.zeros(6, device=device)
    seg.param_shard_on_host = device.type != "cpu"
    return seg


def test_fp32_masters_of_host_parameter_parts_live_on_the_device() -> None:
    observers = ObserverRegistry()
    device = torch.device("meta")
    masters = MasterWeights([_segment(device)], Comm(observers), Phases(observers),
                            precision="fp32", offload=False, params_on_host=True,
                            device=device)  # fmt: skip
    (m,) = masters.masters
    assert not m.alias and m.param.device == device
    assert masters.master_tensors() == [m.param]


def test_fp32_masters_stay_the_parameter_parts_without_offload() -> None:
    observers = ObserverRegistry()
    seg = _segment(torch.device("cpu"))
    masters = MasterWeights([seg], Comm(observers), Phases(observers), precision="fp32",
                            offload=False, params_on_host=False, device=torch.device("cpu"))  # fmt: skip
    (m,) = masters.masters
    assert m.alias and m.param.data_ptr() == seg.param_shard.data_ptr()
