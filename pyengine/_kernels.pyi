"""Type stubs for ``pyengine._kernels``: the executor's native CPU kernels (Rust,
``rust_sched/kernels``), called on numpy views of torch tensors.

Provided by the extension ``pyengine._native`` (``rust_sched/python``). Every kernel runs
with the GIL released; a refused argument raises ``pyengine.errors.KernelError``.
"""

from typing import final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self

__all__ = [
    "DecodeLayer",
    "apply_token_bitmask",
    "gemv_f32",
    "gemv_quantized",
    "host_all_reduce",
    "host_gather",
    "host_group_bytes",
    "host_group_register",
    "paged_decode_attention",
    "qk_norm_rope",
    "release_openmp_workers",
    "rms_norm",
    "shared_word_advance",
    "shared_word_read",
    "shared_word_wait_past",
    "shared_word_write",
]

#: A linear as ``DecodeLayer`` takes it: (weight, scales, biases, group_size, bias). The
#: weight is float32 [n, k] (scales and biases None), int8 [n, k] or uint8 int4 nibbles
#: [n, k / 2] with float32 scales (and optional biases) [n, k / group_size]; bias [n] or None.
_Linear = tuple[
    npt.NDArray[np.float32] | npt.NDArray[np.int8] | npt.NDArray[np.uint8],
    npt.NDArray[np.float32] | None,
    npt.NDArray[np.float32] | None,
    int,
    npt.NDArray[np.float32] | None,
]

@final
class DecodeLayer:
    """A decoder layer's weights, held (not copied), for the front of its decode step in
    one call: input RMSNorm, q/k/v projection, q/k norm and rotary embedding, the K/V
    write, paged decode attention, output projection, post-attention RMSNorm and the
    MLP's gate/up projection (``rust_sched/kernels/src/decode_layer.rs``). The arrays must
    not be replaced or resized after."""

    def __new__(
        cls,
        input_norm: npt.NDArray[np.float32],
        eps: float,
        post_norm: npt.NDArray[np.float32],
        post_eps: float,
        qkv: _Linear,
        o: _Linear,
        gate_up: _Linear,
        q_norm: npt.NDArray[np.float32] | None,
        k_norm: npt.NDArray[np.float32] | None,
        qk_eps: float,
        heads: int,
        kv_heads: int,
        head_dim: int,
        scale: float,
        softcap: float = 0.0,
    ) -> Self: ...
    def run(
        self,
        gate_up: npt.NDArray[np.float32],
        residual: npt.NDArray[np.float32],
        hidden: npt.NDArray[np.float32],
        first: bool,
        cos: npt.NDArray[np.float32],
        sin: npt.NDArray[np.float32],
        key_cache: npt.NDArray[np.float32],
        value_cache: npt.NDArray[np.float32],
        slots: npt.NDArray[np.int64],
        block_tables: npt.NDArray[np.int32],
        seq_lens: npt.NDArray[np.int32],
        num_threads: int = 1,
        window: int = 0,
    ) -> None:
        """The layer's front for the step's rows: ``residual`` [rows, hidden] set to
        ``hidden`` when ``first``, else added to, then the attention output added;
        each row's key and value written at ``slots[r]`` of the layer's caches
        (``[blocks, block_size, kv_heads, head_dim]``); ``gate_up`` [rows, outputs] written.
        Attention covers each row's last ``window`` positions (0: all)."""

def paged_decode_attention(
    out: npt.NDArray[np.float32],
    query: npt.NDArray[np.float32],
    key_cache: npt.NDArray[np.float32],
    value_cache: npt.NDArray[np.float32],
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    scale: float,
    num_threads: int = 1,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Single-query attention of each row over its paged context, written into ``out``.

    ``query`` and ``out`` are ``[rows, heads, head_dim]``; the caches are one layer's
    ``[num_blocks, block_size, kv_heads, head_dim]``; row r attends to the first
    ``seq_lens[r]`` slots named by ``block_tables[r]`` (``[rows, width]``), with scores
    ``q . k * scale``; with ``window > 0`` to the last ``window`` of them only (the blocks
    before are not read), and with ``softcap > 0`` the scores become
    ``softcap * tanh(score / softcap)``. All arrays C-contiguous. Runs with the GIL released, on
    ``num_threads`` threads (PyTorch's OpenMP team when libgomp is loaded). Raises
    ``KernelError`` (a ``ValueError``) for inconsistent shapes, lengths beyond a table or unknown block ids.
    """

def rms_norm(
    out: npt.NDArray[np.float32],
    x: npt.NDArray[np.float32],
    weight: npt.NDArray[np.float32],
    eps: float,
    residual: npt.NDArray[np.float32] | None = None,
    num_threads: int = 1,
) -> None:
    """RMSNorm of every row of ``x`` (rows of ``len(weight)`` floats) into ``out``:
    ``x / sqrt(mean(x^2) + eps) * weight``. With ``residual`` (``x``'s shape), first
    ``residual += x`` in place and the norm is of the sum. All arrays C-contiguous; runs
    with the GIL released, on up to ``num_threads`` threads for large calls. Raises
    ``KernelError`` (a ``ValueError``) for arrays that are not whole rows or do not match.
    """

def gemv_f32(
    out: npt.NDArray[np.float32],
    x: npt.NDArray[np.float32],
    weight: npt.NDArray[np.float32],
    num_threads: int = 1,
) -> None:
    """``out = x @ weight.T`` for a few rows of ``x`` [rows, k] and a float32 ``weight``
    [n, k], reading the weight once (decode steps); ``out`` is [rows, n]. ``k`` must be a
    multiple of 16. All arrays C-contiguous; GIL released; up to ``num_threads`` threads.
    """

def gemv_quantized(
    out: npt.NDArray[np.float32],
    x: npt.NDArray[np.float32],
    qweight: npt.NDArray[np.int8] | npt.NDArray[np.uint8],
    scales: npt.NDArray[np.float32],
    biases: npt.NDArray[np.float32] | None,
    group_size: int,
    num_threads: int = 1,
) -> None:
    """``out = x @ W.T`` for a PackedWeight ``W`` read as stored: ``qweight`` int8 [n, k]
    or uint8 [n, k // 2] (two nibbles per byte, low nibble the even column), ``scales``
    and ``biases`` [n, k // group_size], ``W[n, k] = scale * q + bias`` per group. ``k``
    and ``group_size`` must be multiples of 16. GIL released; up to ``num_threads`` threads.
    """

def qk_norm_rope(
    qkv: npt.NDArray[np.float32],
    cos: npt.NDArray[np.float32],
    sin: npt.NDArray[np.float32],
    q_heads: int,
    k_heads: int,
    q_norm_weight: npt.NDArray[np.float32] | None = None,
    k_norm_weight: npt.NDArray[np.float32] | None = None,
    eps: float = 1e-6,
    num_threads: int = 1,
) -> None:
    """In place on a fused q/k/v projection ``qkv`` (``[tokens, row_stride]``: q heads, then
    k heads, then v heads, each ``head_dim`` wide): RMSNorm of every q and k head by its
    weight when given (Qwen3), then the rotary embedding (rotate-half layout) by ``cos``
    and ``sin`` (``[tokens, head_dim]``, each half repeating the other). v is untouched.
    All arrays C-contiguous; GIL released. Raises ``KernelError`` (a ``ValueError``) for inconsistent shapes.
    """

def release_openmp_workers() -> bool:
    """Frees the idle OpenMP worker threads of the calling thread's team (libgomp's
    ``omp_pause_resource_all``); the next parallel region on this thread starts new ones.

    libgomp cuts its workers' spin-wait to almost nothing while it manages more worker
    threads than there are CPUs, idle teams of other threads included; the executor
    thread's team then sleeps and wakes on a futex around every PyTorch operator. The
    engine calls this on the threads that load the model and add requests. Returns
    False when libgomp is not loaded or did not release (inside a parallel region).
    """

def apply_token_bitmask(
    logits: npt.NDArray[np.float32],
    bits: npt.NDArray[np.uint32],
    rows: npt.NDArray[np.int64],
) -> None:
    """Grammar masks in place: ``logits`` ``[S, vocab]``; for each ``rows[i]``, the tokens
    whose bit in ``bits[i]`` (bit ``t % 32`` of word ``t / 32``) is clear become ``-inf``,
    and so do tokens past the mask's width. C-contiguous arrays; the GIL is released.
    Raises ``KernelError`` for inconsistent shapes or rows outside ``logits``."""

def host_group_bytes(world_size: int, slot_bytes: int) -> int:
    """Bytes of the shared segment of a host group of ``world_size`` ranks with
    ``slot_bytes`` per rank's slot (a multiple of 64): a header line per word, then two
    banks of one slot per rank."""

def host_group_register(
    segment: npt.NDArray[np.uint8], rank: int, world_size: int, slot_bytes: int, pid: int
) -> None:
    """Records ``pid`` as ``rank``'s process in the segment; ranks waiting for ``rank``
    watch that process and fail the collective when it is gone."""

def host_all_reduce(
    segment: npt.NDArray[np.uint8],
    data: npt.NDArray[np.uint8],
    element: str,
    rank: int,
    world_size: int,
    slot_bytes: int,
    timeout_s: float,
) -> None:
    """Sums ``data`` (the bytes of a ``"float32"`` or ``"bfloat16"`` tensor, the same
    length on every rank) over the group in place, through the segment in chunks of
    ``slot_bytes``: every rank adds the ranks' slots in rank order, so every rank gets
    the same bits. The GIL is released. Raises ``EngineDeadError`` naming the rank when a
    peer's process is gone, a peer abandoned the group, or a peer did not arrive within
    ``timeout_s`` (the group is then abandoned for every rank); ``KernelError`` for a bad
    argument (segment too small, rank out of range, unknown element type)."""

def host_gather(
    segment: npt.NDArray[np.uint8],
    data: npt.NDArray[np.uint8],
    out: npt.NDArray[np.uint8] | None,
    rank: int,
    world_size: int,
    slot_bytes: int,
    timeout_s: float,
) -> None:
    """Every rank's ``data`` bytes into ``out`` on rank 0 (``world_size * len(data)``
    bytes, rank r's at ``r * len(data)``); the other ranks pass None. Waits and failures
    as ``host_all_reduce``."""

def shared_word_advance(words: npt.NDArray[np.int64], index: int) -> int:
    """Adds one to ``words[index]`` (an int64 array in shared memory), sequentially
    consistent: what this process wrote before is visible to a process that reads the
    new value. Returns the new value. Raises ``KernelError`` for an index out of range."""

def shared_word_read(words: npt.NDArray[np.int64], index: int) -> int:
    """``words[index]``, read sequentially consistent."""

def shared_word_write(words: npt.NDArray[np.int64], index: int, value: int) -> None:
    """Sets ``words[index]``, sequentially consistent."""

def shared_word_wait_past(words: npt.NDArray[np.int64], index: int, last: int, timeout_s: float) -> int | None:
    """Polls ``words[index]`` until it differs from ``last`` and returns the new value, or
    None after ``timeout_s``; spins, then yields its core, with the GIL released."""
