"""What the launchers share (plain Python: importing it imports no Triton): the launch parameters (`TUNING`), the switch
to the tensors' CUDA device (`on_input_device`), split-K sizing and its float32 partial results, and the pointer and
stride arguments of places, masks and lengths, which every attention kernel takes in the same order.

Each kernel module has its launchers beside it, `X_launch.py` next to `X.py` (`decode`, `nuq`, `turbo`, `pack`,
`hadamard`): a kernel file holds kernels, its launcher states the math (checks, grid, the formula and layouts), and
the two sort together in a listing. A launcher imports its kernel module inside the function, when it first launches,
so that importing `hf_kvcache.kernels` imports no Triton. `dispatch.py` picks the attention launcher of a layer's
formats; `ops.py` gathers every launcher in one namespace, what the rest of the package calls.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from . import backend
from .layout import StaticLayout, StreamTensors

# Launch parameters of the fused attention (the benchmark's sweep sets them; the environment can too):
# tokens per tile (per-token formats; per-channel keys use their block), warps, software-pipelining stages, and
# split-K's target of programs per multiprocessor (each split keeps at least `min_tiles_per_split` tiles).
# Defaults from the H200 sweeps (BENCHMARKS.md): 64-token tiles with 3 stages (2026-11-29); 2 warps a program and
# about 16 programs per multiprocessor (2026-12-01: the 4 warps of a program split each tile's columns, so every
# tile's row maxima and sums and p's operand layout crossed warps through shared memory and barriers; 2 warps with
# twice the programs were 1.08-1.16x faster for every format at batch 16), each split at least 8 tiles (H100,
# 2026-12-07, one layer at batch 1 x 32k, `gpu_next.sh E`, the split counts of 8 tiles: against 4, fp8-e4m3 60.3 ->
# 55.0 us, int4-g32 84.9 -> 74.1, kivi-2 173.6 -> 158.9, turboquant-4 100.2 -> 102.4; 2 and 1 tiles were slower
# still; batch 16 x 32k splits more than 8 tiles anyway). KVQuant's kernel keeps 4 warps (2 were 1.7x slower).
TUNING = {
    "block_n": int(os.environ.get("HF_KVCACHE_BLOCK_N", "64")),
    "num_warps": int(os.environ.get("HF_KVCACHE_NUM_WARPS", "2")),
    "num_stages": int(os.environ.get("HF_KVCACHE_NUM_STAGES", "3")),
    "programs_per_sm": int(os.environ.get("HF_KVCACHE_PROGRAMS_PER_SM", "16")),
    "nuq_block_n": int(os.environ.get("HF_KVCACHE_NUQ_BLOCK_N", "32")),  # KVQuant's tiles (its own kernel)
    "nuq_num_warps": int(os.environ.get("HF_KVCACHE_NUQ_NUM_WARPS", "4")),
    "nuq_fast_trig": True,  # KVQuant's RoPE: reduced angles and the approximate hardware cos/sin
    # KVQuant's codebook lookup (`nuq.py`): "registers" (PTX over fp16 byte tables; fp16 and bf16 models on the GPU,
    # the others take "selects"), "selects" (a chain over the centroids) or "load" (a gather, the ablation)
    "nuq_lookup": os.environ.get("HF_KVCACHE_NUQ_LOOKUP", "registers"),
    "nuq_maxnreg": int(os.environ.get("HF_KVCACHE_NUQ_MAXNREG", "0")),  # a register cap for its programs (0: none)
    # with the register lookup: dequantize, rotate and multiply in fp16 (pairs of channels an instruction, the
    # slots written by a packed compare), where the format's values fit fp16 (`NUQFormat.fp16`)
    "nuq_fp16": os.environ.get("HF_KVCACHE_NUQ_FP16", "1") == "1",
    "min_tiles_per_split": int(os.environ.get("HF_KVCACHE_MIN_TILES_PER_SPLIT", "8")),
    # and at least this many tokens (the launchers of `decode.py` and `turbo.py`, whose tiles are 32-128 tokens):
    # KIVI's 32-token tiles in splits of 16 took 74.7 -> 68.6 us at batch 1 x 32k against 8 (27% -> 28% of fp8-e4m3's
    # GB/s in the same calls; H100, 2026-12-07, `results/bench__h100__batch1-tail-places__20261207`, h3_knobs.log);
    # 16 tiles of TurboQuant's 128 tokens were slower (52.5 -> 66.3 us, 52% -> 40%), of fp8's 64 within 2% (52.3 ->
    # 51.1)
    "min_tokens_per_split": int(os.environ.get("HF_KVCACHE_MIN_TOKENS_PER_SPLIT", "512")),
    # the most programs the tail's tiles (the exact tokens, and the packed ones outside whole body tiles) are dealt
    # to, while the grid is small (`_tail_split`); 1: a single tail program (H100, 2026-12-07, one layer at batch 1 x
    # 32k, 1 against 16: kivi-2 152.8 -> 75.0 us, 13% -> 27% of fp8-e4m3's GB/s of its own bytes; turboquant-4 57.5 ->
    # 52.8, 47% -> 52%; batch 16 within 1.5%, kivi-4 +2.6%)
    "tail_programs": int(os.environ.get("HF_KVCACHE_TAIL_PROGRAMS", "16")),
    # a decode step's mask row loaded one tile ahead in the body loops (`decode._attn_fwd`, `turbo._turbo_attn`)
    "mask_ahead": os.environ.get("HF_KVCACHE_MASK_AHEAD", "1") == "1",
    # integer codes split by inline PTX, two elements a 32-bit register (`tiles.plane_asm`): bit planes
    # (`tiles.planes`) and a 16-bit model's grouped tiles, then dequantized in fp16 by plane (`tiles.group_planes`),
    # instead of Triton's integer operations on one element at a time (and grouped tiles in fp32, joined)
    "plane_asm": os.environ.get("HF_KVCACHE_PLANE_ASM", "1") == "1",
    # 16-bit product operands built from codes behind an opaque copy (`tiles.opaque`), so that Triton lays them out
    # as 16-bit operands (ldmatrix, no copies before each mma) rather than as the bytes they came from: "1" where it
    # measured faster (TurboQuant's looked-up tiles, KVQuant's, the decode kernel where both streams are grouped fp16
    # planes; BENCHMARKS.md 2026-12-05, ninth session), "0" nowhere, "all" every decode kernel too (to measure)
    "operand_copy": os.environ.get("HF_KVCACHE_OPERAND_COPY", "1"),
    # fp16 products for bf16 models where every code converts to fp16 exactly (`decode_launch._product_dtype`)
    "fp16_products": os.environ.get("HF_KVCACHE_FP16_PRODUCTS", "1") == "1",
    # TurboQuant's kernel (`turbo.py`): its codebook lookup, "registers" (PTX, fp16 products) or "load"
    # (BENCHMARKS.md, 2026-12-01: x0.84 against x0.28 at batch 16 x 32k), its tiles, warps and stages
    "turbo_lookup": os.environ.get("HF_KVCACHE_TURBO_LOOKUP", "registers"),
    "turbo_block_n": int(os.environ.get("HF_KVCACHE_TURBO_BLOCK_N", "128")),
    "turbo_num_warps": int(os.environ.get("HF_KVCACHE_TURBO_NUM_WARPS", "4")),
    "turbo_num_stages": int(os.environ.get("HF_KVCACHE_TURBO_NUM_STAGES", "2")),
    # a register cap for its body programs (0: none): 4 warps at 128 registers keep 4 programs on a multiprocessor;
    # local compiles of small edits went to 134-168, and the cap measured 678 -> 670 us at batch 16 (BENCHMARKS.md)
    "turbo_maxnreg": int(os.environ.get("HF_KVCACHE_TURBO_MAXNREG", "128")),
    # streams of one 4-bit part multiplied by plane of 16-bit halves (channels 4j + i: four products of D / 4
    # channels straight from the lookup's registers, `turbo._half_planes`) instead of as one tile joined from its
    # outputs through shared memory: 51.9 -> 38.5 warp instructions a held token for sm_90 (`hf-kvcache bench --parts
    # sass`, BENCHMARKS.md 2026-12-05), unmeasured on the GPU
    "turbo_planes": os.environ.get("HF_KVCACHE_TURBO_PLANES", "1") == "1",
    # a prefill's many rows rotated by cuBLAS's float32 product rather than `hadamard._rows_times` (`rows_times`)
    "rows_cublas": os.environ.get("HF_KVCACHE_ROWS_CUBLAS", "1") == "1",
    # a graphed decode step's token placed by one launch (`storage.StreamStorage._write_token`), or ("0", to measure)
    # by the PyTorch operations of any other write
    "token_places": os.environ.get("HF_KVCACHE_TOKEN_PLACES", "1") == "1",
    # FP8 conversions: "auto" (the hardware's where the target has them, sm_89 on; integer operations on the bits
    # before), or "bits" everywhere (to check pre-Ada's path on any GPU, and on the interpreter)
    "fp8_convert": os.environ.get("HF_KVCACHE_FP8_CONVERT", "auto"),
}


def fp8_native(device: torch.device) -> bool:
    """Whether the kernels on `device` convert FP8 with the hardware's instructions (`cvt` to and from e4m3/e5m2, sm_89
    on) rather than by integer operations on the bits (`pack._fp8_bits`, `tiles.fp8_bits_to_f16`): the same bytes and
    values either way. The interpreter converts natively."""
    mode = TUNING["fp8_convert"]
    if mode not in ("auto", "bits"):
        raise ValueError(f"HF_KVCACHE_FP8_CONVERT must be auto or bits, not {mode!r}")
    if mode == "bits":
        return False
    arch = backend.target_arch(device)
    return arch is None or arch >= backend.FP8_ARCH


def operand_copy(measured_faster: bool) -> bool:
    """Whether a launch takes `tiles.opaque` (`TUNING["operand_copy"]`): `measured_faster` says whether its format is
    one where the copy measured faster."""
    mode = TUNING["operand_copy"]
    if mode not in ("0", "1", "all"):
        raise ValueError(f"HF_KVCACHE_OPERAND_COPY must be 0, 1 or all, not {mode!r}")
    return mode == "all" or (mode == "1" and measured_faster)


def on_input_device(launcher):
    """Run a launcher under the CUDA device of its first tensor argument.

    Triton launches on the *current* CUDA device and its stream. A model split over GPUs (accelerate's
    `device_map`) calls the attention and pack launchers for layers whose tensors live on another GPU than the
    current one; without the switch the kernel would run on the wrong device, reading the other GPU's memory
    over the interconnect (or faulting)."""

    @functools.wraps(launcher)
    def run(x: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling():  # the launcher calls its operator (`library`), which switches itself
            return launcher(x, *args, **kwargs)
        if x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return launcher(x, *args, **kwargs)
        return launcher(x, *args, **kwargs)

    return run


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def head_dim_ok(d: int) -> bool:
    """The kernels handle head_dim a power of two from 16 to 256 (arange sizes); others use the reference."""
    return 16 <= d <= 256 and not d & (d - 1)


def _len(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.shape[2]


def _step_counts(query: torch.Tensor, keys: StreamTensors, k_new: torch.Tensor,
                 exact_new: bool) -> tuple[int, int, int, int, int]:
    """The launchers' counts of one step: (kv-heads, query heads per kv-head, sinks, new tokens read exactly, `stop`:
    the held tokens before them). Hq must be a multiple of Hkv (GQA/MQA are read by head mapping)."""
    hq, hkv = query.shape[1], k_new.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv-heads")
    n_sink = _len(keys.sink)
    n_new = k_new.shape[2] if exact_new else 0
    return hkv, hq // hkv, n_sink, n_new, n_sink + keys.n_packed + _len(keys.residual) - n_new


def _place(t: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """A (B, H, T, D) place and its batch, head and token strides (a dummy pointer when the place is empty, with
    the token stride of a place's own storage, D, so that the kernel's specialization does not change)."""
    if t is None or t.shape[2] == 0:
        return dummy, 0, 0, dummy.shape[-1]
    if t.stride(3) != 1:
        raise ValueError("the innermost axis of a cache place must be contiguous")
    return t, t.stride(0), t.stride(1), t.stride(2)


def _length_args(static: StaticLayout | None, dummy: torch.Tensor) -> list:
    """The kernels' `LENS, cap_len`: the storage's length tensor and capacity (a dummy and 0 otherwise)."""
    return [static.length, static.capacity] if static is not None else [dummy, 0]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _copy_fields(out: dict[str, torch.Tensor], fields: list[torch.Tensor], names: tuple[str, ...]) -> None:
    for name, value in zip(names, fields):
        out[name].copy_(value)


def _tail_tiles(block_n: int, n_sink: int, n_body_tiles: int, stop: int, n_new: int,
                static: StaticLayout | None) -> int:
    """The tiles of `block_n` tokens the tail reads (`decode._attn_fwd`, BODY=False): the sinks' and those from the
    body's end to the last token. `static` (lengths on the device): a bound for every length, from the places'
    sizes: the body ends at most one ring and a tile short of the held tokens."""
    if static is not None:
        ring = max(static.key_ring, static.value_ring)
        return -(-static.sink_tokens // block_n) + -(-(ring + block_n - 1 + n_new) // block_n)
    rest = max(stop + n_new - n_sink - n_body_tiles * block_n, 0)
    return -(-n_sink // block_n) + -(-rest // block_n)


def _split_k(query: torch.Tensor, n_tiles: int, programs: int, tile_tokens: int | None = None) -> tuple[int, int]:
    """Split-K sizing: (n_splits, tiles_per_split) for `n_tiles` tiles of packed tokens and `programs` programs per
    split; on CUDA about `programs_per_sm` programs per multiprocessor, each split at least `min_tiles_per_split`
    tiles and, given `tile_tokens` (the tokens of a tile), at least `min_tokens_per_split` tokens."""
    if query.is_cuda and n_tiles:
        target = TUNING["programs_per_sm"] * _multiprocessors(query.device.index or 0)
        least = TUNING["min_tiles_per_split"]
        if tile_tokens:
            least = max(least, -(-TUNING["min_tokens_per_split"] // tile_tokens))
        n_splits = max(1, min(math.ceil(target / programs), n_tiles // least))
    else:
        n_splits = 1 if n_tiles else 0
    tiles_per_split = math.ceil(n_tiles / n_splits) if n_splits else 0
    n_splits = math.ceil(n_tiles / tiles_per_split) if n_splits else 0
    return n_splits, tiles_per_split


def _tail_split(query: torch.Tensor, n_tiles: int, programs: int) -> int:
    """How many programs the tail's `n_tiles` tiles (at most; an upper bound where lengths come from the device) are
    dealt to, for `programs` programs per tail program: on CUDA, up to `tail_programs` while the grid stays within
    half of `programs_per_sm` programs a multiprocessor (a decode step's few rows; each tail program has a partial
    result of its own, and a prefill chunk's grid, 1024 programs for 2048 tokens of 32 query heads, keeps one); one
    elsewhere."""
    if not (query.is_cuda and n_tiles > 1):
        return 1
    room = TUNING["programs_per_sm"] * _multiprocessors(query.device.index or 0) // (2 * programs)
    return max(1, min(n_tiles, TUNING["tail_programs"], room))


# Split-K workspaces by (CUDA stream, rows, parts, D), reused from call to call without a storage layout (the kernel
# benchmarks and tests; a cache's eager decode step replays its graph's own): each call otherwise pays three
# allocations (~5 us of host time each on the H200 host). Kernels on one stream run in order, so a workspace is
# never read by one call while the next writes it; a few shapes live at once (the split count settles once a cache
# is long), and the oldest is dropped past `_WORKSPACES_KEPT`.
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_WORKSPACES_KEPT = 8


def _partials(query: torch.Tensor, rows: int, n_parts: int,
              reuse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 split-K partial results of `rows` query rows: acc `(rows * n_parts, D)`, running max and sum.

    `reuse` (calls without a storage layout: the kernel benchmarks and tests): from the shared workspaces. Never for a
    cache's calls, which may be captured into a layer's CUDA graph or run inside torch.compile's CUDA-graph trees:
    there even the warm-up allocates from the graph's pool, which refuses tensors kept alive outside its outputs
    (measured on the H200: "tensors in the cudagraph pool not tracked as outputs"); nor while any CUDA graph is
    captured (a graph must own its workspace, which could otherwise be dropped from here while the graph still
    replays into it); nor on CPU (the interpreter's tests)."""
    shared = reuse and query.is_cuda and not torch.cuda.is_current_stream_capturing()
    key = (torch.cuda.current_stream(query.device).cuda_stream if shared else 0, rows, n_parts, query.shape[-1])
    found = _WORKSPACES.get(key) if shared else None
    if found is not None:
        return found
    acc = torch.empty((rows * n_parts, query.shape[-1]), device=query.device, dtype=torch.float32)
    m = torch.empty((rows * n_parts,), device=query.device, dtype=torch.float32)
    parts = acc, m, torch.empty_like(m)
    if shared:
        if len(_WORKSPACES) >= _WORKSPACES_KEPT:
            _WORKSPACES.pop(next(iter(_WORKSPACES)))
        _WORKSPACES[key] = parts
    return parts


def _mask_args(attention_mask: torch.Tensor | None, dummy: torch.Tensor) -> list:
    if attention_mask is None:
        return [dummy, 0, 0, 0]
    if attention_mask.dtype != torch.bool:
        raise ValueError("the fused attention takes a boolean mask (True = attend)")
    mask = attention_mask.view(torch.uint8)
    return [mask, mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2), mask.stride(3)]


def _compute_dtype(query: torch.Tensor) -> tuple:
    """The products' operand dtype and precision: the model dtype on tensor cores, exact fp32 for fp32 models
    and the interpreter (whose bf16 products are not trustworthy)."""
    import triton.language as tl

    if query.dtype == torch.float32 or backend.interpreting():
        return tl.float32, "ieee"
    return (tl.bfloat16 if query.dtype == torch.bfloat16 else tl.float16), "tf32"


_PACK_BLOCK_T = 16  # tokens a pack program writes (`pack_launch`, `nuq_launch.pack_nuq`)


def _bh_t_strides(t: torch.Tensor) -> tuple[int, int, int]:
    if t.stride(-1) != 1:
        raise ValueError("the innermost axis must be contiguous")
    return t.stride(0), t.stride(1), t.stride(2)
