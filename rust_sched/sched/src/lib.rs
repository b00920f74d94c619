//! pyengine's scheduler core.
//!
//! A pure Rust crate: the paged KV [`block_pool`], the continuous-batching [`scheduler`],
//! the [`plan`] it emits and the [`engine`] thread that runs it, and the [`constraint`]
//! interface through which it drives grammar matchers (implemented in `rust_sched/grammar`). It knows nothing of
//! Python or of the model: the bindings (`rust_sched/python`, the Python module
//! `pyengine._sched`) only convert and call through, and the executor's CPU kernels live
//! in their own crate (`rust_sched/kernels`).

pub mod attachment;
pub mod block_hash;
pub mod block_pool;
pub mod config;
pub mod constraint;
pub mod engine;
pub mod error;
pub mod kv_events;
pub mod kv_groups;
mod lru;
pub mod plan;
pub mod request;
pub mod scheduler;
pub mod sim;
pub mod spec;

pub use attachment::Attachment;
pub use block_pool::{BlockId, BlockPool, PoolUsage, PrefixCacheStats, NULL_BLOCK};
pub use config::{Policy, SchedulerConfig};
pub use constraint::{
    Advance, Constraint, ConstraintHandle, ConstraintState, GrammarMask, MaskTicket, MaskWait,
};
pub use engine::{DraftResult, EngineHandle, SchedulerThreadStats};
pub use error::{panic_message, SchedError, SchedResult};
pub use kv_groups::KvGroup;
pub use plan::{FinishReason, OutputEvent, StepPlan, FINISH_REASONS, PLACEHOLDER_TOKEN};
pub use request::{RequestSpec, SeqId};
pub use scheduler::{Scheduler, SchedulerCounters, SchedulerSnapshot, SpecResult, SpecStats};
pub use spec::SpecMethod;

/// The crate version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
