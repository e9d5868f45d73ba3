"""The GPUs `hf-kvcache plan` knows by name (`GPUS`, their nominal memory and family) and the one it finds
(`detect_gpu`): what the recommendation needs of a GPU, its memory and whether it converts FP8 natively."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPU:
    """A GPU as the recommendation sees it: `memory` in bytes, `arch` its family (hopper, blackwell, ada, ampere,
    turing, volta, cdna3, cdna4, unknown), `capability` its compute capability or AMD architecture name."""

    name: str
    memory: int
    arch: str
    capability: str


# Memory is the spec sheet's nominal figure (decimal GB); `gpu_memory` overrides it with an exact one.
GPUS: dict[str, GPU] = {
    "b200": GPU("NVIDIA B200", 180 * 10**9, "blackwell", "sm_100"),
    "h200": GPU("NVIDIA H200", 141 * 10**9, "hopper", "sm_90"),
    "h100": GPU("NVIDIA H100 SXM", 80 * 10**9, "hopper", "sm_90"),
    "a100": GPU("NVIDIA A100 80GB", 80 * 10**9, "ampere", "sm_80"),
    "a100-40gb": GPU("NVIDIA A100 40GB", 40 * 10**9, "ampere", "sm_80"),
    "a10": GPU("NVIDIA A10", 24 * 10**9, "ampere", "sm_86"),
    "rtx3090": GPU("NVIDIA GeForce RTX 3090", 24 * 10**9, "ampere", "sm_86"),
    "l40s": GPU("NVIDIA L40S", 48 * 10**9, "ada", "sm_89"),
    "l4": GPU("NVIDIA L4", 24 * 10**9, "ada", "sm_89"),
    "rtx4090": GPU("NVIDIA GeForce RTX 4090", 24 * 10**9, "ada", "sm_89"),
    "t4": GPU("NVIDIA T4", 16 * 10**9, "turing", "sm_75"),
    "v100": GPU("NVIDIA V100 32GB", 32 * 10**9, "volta", "sm_70"),
    "mi300x": GPU("AMD Instinct MI300X", 192 * 10**9, "cdna3", "gfx942"),
    "mi325x": GPU("AMD Instinct MI325X", 256 * 10**9, "cdna3", "gfx942"),
}
# GPUs that convert FP8 natively, where FP8 presets are candidates. Ada has FP8 units too, but this project measured
# FP8 decode only on a Hopper GPU; elsewhere the FP8 presets are left out of the recommendation.
FP8_ARCHS = ("hopper", "blackwell", "cdna3", "cdna4")


def detect_gpu() -> GPU | None:
    """The first visible GPU (name, total memory, family from its compute capability), or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    if torch.version.hip:
        name = props.gcnArchName.split(":")[0]
        arch = {"gfx94": "cdna3", "gfx95": "cdna4"}.get(name[:5], "unknown")
        return GPU(props.name, props.total_memory, arch, name)
    major, minor = torch.cuda.get_device_capability(0)
    if major == 8:
        arch = "ada" if minor == 9 else "ampere"
    else:
        arch = {7: "turing" if minor == 5 else "volta", 9: "hopper", 10: "blackwell", 11: "blackwell",
                12: "blackwell"}.get(major, "unknown")
    return GPU(props.name, props.total_memory, arch, f"sm_{major}{minor}")
