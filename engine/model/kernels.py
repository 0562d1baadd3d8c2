"""The model's fused ops, two ways: TorchOps (the reference, plain torch, any device) and CpuKernelOps (C++ kernels
from engine/model/csrc/cpu_kernels.cpp, CPU only).

The kernels are compiled at first use with the machine's C++ compiler (torch.utils.cpp_extension, -O3 -march=native)
and cached under ~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR moves it); `make install` builds them once, so a
server does not compile on its first request. Where they cannot build (no compiler), select_ops logs why once and
the engine runs the reference path. tests/engine/test_kernels.py holds every kernel to its reference.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import shutil

import torch
import torch.nn.functional as F

from engine.model.attention import AttentionMetadata, paged_attention, prefill_attention
from engine.config import this_cpu_flags

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("csrc") / "cpu_kernels.cpp"


class TorchOps:
    """Reference ops, in the order and dtypes of transformers' modeling code (PARITY.md)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in fp32, cast back, *then* scale: the order transformers uses, which matters in bf16.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, rms_norm(x + residual)); x may be overwritten."""
        x = x + residual
        return x, self.rms_norm(x, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(T, 2I) -> silu(gate) * up (T, I)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(T, 2I) -> gelu_tanh(gate) * up (T, I): Gemma's gelu_pytorch_tanh."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rope(self, qkv, cos, sin, num_heads: int, num_kv_heads: int, head_dim: int):
        """qkv (T, (heads + 2 kv_heads) * head_dim), cos/sin (T, 1, head_dim) -> rotated q (T, heads, head_dim),
        rotated k and v (T, kv_heads, head_dim)."""
        q, k, v = split_heads(qkv, num_heads, num_kv_heads, head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def paged_attention(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window):
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale, window)


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    t = qkv.shape[0]
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
    # (T, heads, head_dim), (T, kv_heads, head_dim), (T, kv_heads, head_dim): views into qkv
    return q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim), cos/sin (T, 1, head_dim): rotation by halves (not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class CpuKernelOps(TorchOps):
    """The same ops as C++ kernels: fewer passes over memory and no per-op dispatch; decode attention reads the
    paged cache in place instead of gathering a contiguous copy of every sequence's keys and values each step."""

    name = "cpu-kernels"

    def __init__(self, module, batch_invariant: bool = False):
        self.k = module
        self._prefill_bf16 = module.prefill_available()  # built for a CPU with AVX512-BF16 (AMX or not)
        self._prefill_f32 = module.prefill_f32_available()  # built for a CPU with AVX2 + FMA and no AVX-512
        self.prefill_tiles = True  # AMX tiles where the CPU has them; False: its VDPBF16PS path (tests run both)
        # Every query (prefill tokens too) attends through the per-query decode kernel: a token's attention, and so
        # its sequence's logits, are then the same bits however the step batches, chunks or resumes it.
        self.batch_invariant = batch_invariant

    def rms_norm(self, x, weight, eps):
        if x.dim() != 2 or not x.is_contiguous():
            return super().rms_norm(x, weight, eps)
        return self.k.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if x.dim() != 2 or not (x.is_contiguous() and residual.is_contiguous()):
            return super().add_rms_norm(x, residual, weight, eps)
        return x, self.k.rms_norm(x, weight, eps, residual)  # x += residual in place

    def silu_and_mul(self, gate_up):
        return self.k.silu_and_mul(gate_up)

    def rope(self, qkv, cos, sin, num_heads, num_kv_heads, head_dim):
        if not qkv.is_contiguous():
            return super().rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
        # q and k are the first heads + kv_heads heads of each row: rotated in place in one pass.
        self.k.rope_(qkv, cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1), num_heads + num_kv_heads,
                     head_dim)
        return split_heads(qkv, num_heads, num_kv_heads, head_dim)

    def paged_attention(self, q, k, v, k_cache, v_cache, meta, scale, window):
        self.k.write_kv(k, v, k_cache, v_cache, meta.write_blocks, meta.write_offsets)
        q = q.contiguous()
        out = torch.empty_like(q)  # (T, heads, head_dim)
        if self.batch_invariant:
            batch = meta.query_batch
            self.k.decode_attention(out, q, k_cache, v_cache, batch.tables, batch.rows, batch.context_lens,
                                    window or 0, scale)
            return out
        if meta.num_decode:
            batch = meta.decode_batch
            self.k.decode_attention(out, q, k_cache, v_cache, batch.tables, batch.rows, batch.context_lens,
                                    window or 0, scale)
        if meta.prefills and self._prefill_in_place(q, window):
            for plan in meta.prefills:  # the chunk's keys are in the cache already: read it in place
                if q.dtype == torch.float32:
                    self.k.prefill_attention_f32(out, q, k_cache, v_cache, plan.table, plan.row, plan.start,
                                                 plan.num_new, scale)
                else:
                    self.k.prefill_attention(out, q, k_cache, v_cache, plan.table, plan.row, plan.start,
                                             plan.num_new, scale, self.prefill_tiles)
            return out
        for plan, mask in zip(meta.prefills, meta.prefill_masks(window, q.dtype)):
            rows = slice(plan.row, plan.row + plan.num_new)
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, plan, mask, scale)
        return out

    def _prefill_in_place(self, q, window) -> bool:
        """The C++ prefill kernels, causal without a window: bf16 where the CPU has AVX512-BF16 (on AMX tiles where
        it has AMX-BF16), head_dim a multiple of 32 up to 256; fp32 on 8 lanes where it has AVX2 + FMA but no
        AVX-512 (torch's SDPA is slow there), head_dim a multiple of 16 up to 256. Elsewhere SDPA."""
        dim = q.shape[2]
        if window is not None or dim > 256:
            return False
        if q.dtype == torch.bfloat16:
            return dim % 32 == 0 and self._prefill_bf16
        return q.dtype == torch.float32 and dim % 16 == 0 and self._prefill_f32


REFERENCE = TorchOps()


def select_ops(dtype: torch.dtype, device, batch_invariant: bool = False) -> TorchOps:
    """The C++ kernels for a CPU model when they build here, else the reference. batch_invariant needs the kernels
    (the reference path pads decode batches to their longest sequence): a ValueError says so where they are not."""
    cpu = torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)
    module = cpu_kernels() if cpu else None
    if batch_invariant and module is None:
        raise ValueError("batch_invariant needs raypd's C++ CPU kernels (a CPU model whose kernels build here); "
                         f"this engine runs {dtype} on {device}" + ("" if not cpu else " and they did not build"))
    return CpuKernelOps(module, batch_invariant) if module is not None else REFERENCE


@functools.cache
def cpu_kernels():
    """The compiled kernel module, or None (logged once) where this machine cannot build it."""
    try:
        _ninja_on_path()
        from torch.utils.cpp_extension import load

        # Named by CPU and source: checkouts holding different versions of the source keep one build each,
        # instead of rebuilding over one another.
        source = SOURCE.read_bytes()
        name = f"raypd_cpu_kernels_{_cpu_tag()}_{hashlib.sha256(source).hexdigest()[:8]}"
        return load(name=name, sources=[str(_source_copy(name, source))],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, a failed build: the reference path still serves
        log.warning("raypd's C++ CPU kernels are unavailable (%s: %s); running the torch reference path",
                    type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None


def _source_copy(name: str, source: bytes) -> pathlib.Path:
    """The source, copied into the build's own folder: torch rebuilds when a build's source path changes, so
    checkouts holding the same source at other paths share one build instead of rebuilding it in turn, where they
    use the same torch install (its include path is part of the compile command too: another venv rebuilds)."""
    from torch.utils.cpp_extension import _get_build_directory

    path = pathlib.Path(_get_build_directory(name, verbose=False)) / "cpu_kernels.cpp"
    if not path.exists() or path.read_bytes() != source:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(source)
        os.replace(tmp, path)  # whole or not at all, for processes building at once
    return path


def _cpu_tag() -> str:
    """-march=native binds a build to this CPU's instruction sets: they are part of its cache key."""
    return hashlib.sha256(" ".join(sorted(this_cpu_flags())).encode()).hexdigest()[:12]


def _ninja_on_path() -> None:
    """cpp_extension runs the first `ninja` on PATH. It is always the pip package's (a dependency): two ninja versions
    hash a build's command line differently, so a shell that found the venv's ninja and a test run that found the
    system's (1.13 and 1.11 here) each took the other's build for a changed one and rebuilt it (~40 s)."""
    try:
        import ninja
    except ImportError:  # no package: whatever ninja the host has
        return
    if shutil.which("ninja") != os.path.join(ninja.BIN_DIR, "ninja"):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
