//! CPU kernels the executor calls where PyTorch has no fused operator for our layout.
//!
//! [`paged_decode`] is single-query attention straight over the paged KV cache: on CPU the
//! decode step is bound by reading K and V, and composing PyTorch operators either
//! gathers the blocks (a second copy of every byte) or reads them once per query head.
//! Pure Rust over slices; the bindings hand it numpy views of the torch tensors.
//! [`norm`] holds the decoder's elementwise steps between matmuls (RMSNorm with the
//! residual add, q/k norm with the rotary embedding), one pass each instead of a chain
//! of operators. [`release_calling_thread_workers`] frees a thread's idle OpenMP team,
//! which otherwise throttles the executor thread's team (see there). [`token_mask`]
//! applies grammar masks (structured outputs) to logits in place. [`host_group`] holds
//! the shared-memory all-reduce and gather of tensor-parallel ranks on one host;
//! [`sequence_word`] the plan segment's sequence number, advanced and polled across processes.
//! [`gemv`] multiplies a few rows by a float32, int8 or int4 weight read once (decode steps
//! at the memory-bandwidth limit; the AVX2 loops in `gemv_avx2`, int4's and int8's AVX-512
//! loops in `gemv_planes`, `gemv_int4_vnni` and `gemv_int8_vnni` (on `x` as `gemv_digits`)
//! and `gemv_int8_avx512`).

// The crate's MSRV went from the workspace's 1.85 to 1.89 for the AVX-512 intrinsics;
// `x % n == 0` stays as written rather than `is_multiple_of` (stable since 1.87).
#![allow(clippy::manual_is_multiple_of)]

pub mod decode_layer;
pub mod gemv;
#[cfg(target_arch = "x86_64")]
mod gemv_avx2;
#[cfg(target_arch = "x86_64")]
mod gemv_avx512;
mod gemv_digits;
#[cfg(target_arch = "x86_64")]
mod gemv_digits_avx512;
#[cfg(target_arch = "x86_64")]
mod gemv_int4_vnni;
#[cfg(target_arch = "x86_64")]
mod gemv_int8_avx512;
#[cfg(target_arch = "x86_64")]
mod gemv_int8_vnni;
#[cfg(target_arch = "x86_64")]
mod gemv_planes;
pub mod host_group;
pub mod norm;
pub mod paged_decode;
mod parallel;
pub mod sequence_word;
pub mod token_mask;
mod vector;

use thiserror::Error;

pub use decode_layer::{decode_layer_front, LayerCache, LayerWeights, Linear, StepRows};
pub use gemv::{gemv, Weight, WeightData};
pub use host_group::{process_exists, segment_bytes, ElementType, GroupError, HostGroup};
pub use norm::{qk_norm_rope, rms_norm, Norm, QkHeads};
pub use paged_decode::{paged_decode_attention, DecodeQueries, PagedKv};
pub use parallel::release_calling_thread_workers;
pub use token_mask::apply_token_bitmask;

/// Why a kernel refused its arguments (checked before any work).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct KernelError(String);

impl KernelError {
    pub fn new(message: String) -> Self {
        KernelError(message)
    }
}
