"""Where the middle layers live: one device, or several GPUs of one node by memory (accelerate device maps).

`plan_device_map` asks accelerate (`get_balanced_memory` + `infer_auto_device_map`, the mechanism HF's own
`device_map="balanced"` uses) to spread whole decoder layers over the given devices within their memory,
leaving headroom on each device for its layers' share of the KV cache. `place_layers` moves each layer
there; the stack then hands activations from device to device (model/stack.py), and each layer's KV
buffers are allocated on that layer's device (kv.py allocates like the keys it is given). This is
pipeline placement within one process: one pass uses one GPU at a time, which is what a middle too large
for one GPU needs; tensor parallelism, where every pass uses every GPU, is model/tensorparallel.py (`serve --tp`).

Nothing here assumes CUDA exists: the planner runs on meta-device layers and fake device names, so it is
tested on CPU; only `cuda_devices` asks the driver.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import ConfigError
from .stack import LayerStack


def cuda_devices() -> dict[str, int]:
    """Every visible CUDA device with its free memory in bytes (empty without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    free = {}
    for index in range(torch.cuda.device_count()):
        free[f"cuda:{index}"] = torch.cuda.mem_get_info(index)[0]
    return free


def plan_device_map(
    stack: LayerStack, memory: Mapping[str, int], dtype: torch.dtype, kv_fraction: float = 0.3
) -> dict[int, str]:
    """Layer index (0-based within the stack) -> device, spreading layers over `memory` (device -> bytes).

    `kv_fraction` of each device's memory is kept back for KV buffers and activations. Raises ConfigError
    when the layers do not fit, instead of spilling them to the CPU behind the user's back.
    """
    try:
        from accelerate import infer_auto_device_map
        from accelerate.utils import get_balanced_memory
    except ImportError as exc:
        raise ConfigError("placing layers on several GPUs needs accelerate: pip install 'splitinfer[gpu]'.") from exc
    if not memory:
        raise ConfigError("no devices to place the middle layers on; name at least one (e.g. --devices cuda:0).")
    if not 0 <= kv_fraction < 1:
        raise ConfigError("the KV fraction of device memory must be in [0, 1).")
    names = list(memory)
    # accelerate numbers GPUs 0..n-1; the mapping back to our device names is positional.
    budget = {i: int(memory[name] * (1 - kv_fraction)) for i, name in enumerate(names)}
    layer_class = [type(stack.layers[0]).__name__] if len(stack.layers) else []
    if len(names) > 1:
        budget = get_balanced_memory(stack.layers, max_memory=budget, no_split_module_classes=layer_class, dtype=dtype)
    plan = infer_auto_device_map(stack.layers, max_memory=budget, no_split_module_classes=layer_class, dtype=dtype)
    device_map: dict[int, str] = {}
    for module, where in plan.items():
        if not isinstance(where, int):
            raise ConfigError(
                f"the middle layers do not fit in {', '.join(names)} (layer {module or 'all'} would go to {where}); "
                "add devices, use float16/bfloat16, or move fewer layers to the cloud."
            )
        indices = range(len(stack.layers)) if module == "" else [int(module.split(".")[0])]
        for index in indices:
            device_map[index] = names[where]
    assert sorted(device_map) == list(range(len(stack.layers))), device_map
    return device_map


def place_layers(stack: LayerStack, device_map: Mapping[int, str]) -> LayerStack:
    """Move layer i to device_map[i] (the rotary table goes with layer 0); returns the stack."""
    if sorted(device_map) != list(range(len(stack.layers))):
        raise ConfigError(f"the device map must name every layer 0..{len(stack.layers) - 1} once.")
    for index, layer in enumerate(stack.layers):
        layer.to(device_map[index])
    if len(stack.layers):
        stack.rotary.to(device_map[0])
    stack.refresh_devices()
    return stack


def parse_devices(text: str) -> list[str]:
    """'cuda:0,cuda:1' -> ['cuda:0', 'cuda:1']; 'auto' -> every visible CUDA device."""
    if text.strip() == "auto":
        devices = list(cuda_devices())
        if not devices:
            raise ConfigError("--devices auto found no CUDA device; use --device cpu or name the devices.")
        return devices
    devices = [d.strip() for d in text.split(",") if d.strip()]
    for device in devices:
        try:
            torch.device(device)
        except RuntimeError as exc:
            raise ConfigError(f"{device!r} is not a device name; use e.g. cuda:0,cuda:1.") from exc
    return devices


def spread(stack: LayerStack, devices: Sequence[str], dtype: torch.dtype) -> dict[int, str]:
    """Plan over the free memory of `devices` (CUDA) and place the stack; returns the map used."""
    free = cuda_devices()
    missing = [d for d in devices if d not in free]
    if missing:
        raise ConfigError(f"{', '.join(missing)} not visible here (visible: {', '.join(free) or 'none'}).")
    device_map = plan_device_map(stack, {d: free[d] for d in devices}, dtype)
    place_layers(stack, device_map)
    return device_map
