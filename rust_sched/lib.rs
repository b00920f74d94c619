//! pyengine's scheduler core.
//!
//! A pure Rust crate: the paged KV [`block_pool`], the continuous-batching [`scheduler`],
//! the [`plan`] it emits and the [`engine`] thread that runs it; beside them, the CPU
//! [`kernels`] the executor calls (decode attention over the paged cache). The optional `python`
//! feature adds the PyO3 bindings (`pyengine._sched`), which only convert and call
//! through.

pub mod block_hash;
pub mod block_pool;
pub mod config;
pub mod engine;
pub mod error;
pub mod kernels;
mod lru;
pub mod plan;
pub mod request;
pub mod scheduler;
pub mod sim;

#[cfg(feature = "python")]
mod python;

/// The extension module allocates through mimalloc: a plan's arrays are allocated every
/// step and freed when Python drops them, and glibc's malloc turns such large, short-lived
/// blocks into fresh mmaps and page faults at thousands of sequences.
#[cfg(feature = "python")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub use block_pool::{BlockId, BlockPool, PoolUsage, PrefixCacheStats};
pub use config::{Policy, SchedulerConfig};
pub use engine::{EngineHandle, EngineStats};
pub use error::{SchedError, SchedResult};
pub use plan::{FinishReason, OutputEvent, StepPlan, FINISH_REASONS, PLACEHOLDER_TOKEN};
pub use request::{RequestSpec, SeqId};
pub use scheduler::{Scheduler, SchedulerCounters, SchedulerSnapshot};

/// The crate version, exported to Python as `pyengine.__version__`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
