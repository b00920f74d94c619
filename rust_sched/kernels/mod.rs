//! CPU kernels the executor calls where PyTorch has no fused operator for our layout.
//!
//! [`paged_decode`] is single-query attention straight over the paged KV cache: on CPU the
//! decode step is bound by reading K and V, and composing PyTorch operators either
//! gathers the blocks (a second copy of every byte) or reads them once per query head.
//! Pure Rust over slices; the bindings hand it numpy views of the torch tensors.

pub mod paged_decode;
mod parallel;
mod vector;

pub use paged_decode::{paged_decode_attention, DecodeQueries, KernelError, PagedKv};
