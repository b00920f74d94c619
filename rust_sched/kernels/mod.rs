//! CPU kernels the executor calls where PyTorch has no fused operator for our layout.
//!
//! [`paged_decode`] is single-query attention straight over the paged KV cache: on CPU the
//! decode step is bound by reading K and V, and composing PyTorch operators either
//! gathers the blocks (a second copy of every byte) or reads them once per query head.
//! Pure Rust over slices; the bindings hand it numpy views of the torch tensors.
//! [`release_calling_thread_workers`] frees a thread's idle OpenMP team, which otherwise
//! throttles the executor thread's team (see there).

pub mod paged_decode;
mod parallel;
mod vector;

pub use paged_decode::{paged_decode_attention, DecodeQueries, KernelError, PagedKv};
pub use parallel::release_calling_thread_workers;
