//! Scheduler configuration: one validated value passed explicitly.

use crate::error::{SchedError, SchedResult};

/// Order in which waiting requests are admitted and running ones are preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served: admission in arrival order; the latest arrival is
    /// preempted first.
    Fcfs,
    /// Lower `priority` value first, ties by arrival; the highest value (then the latest
    /// arrival) is preempted first.
    Priority,
}

impl Policy {
    pub fn parse(name: &str) -> SchedResult<Self> {
        match name {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => Ok(Policy::Priority),
            other => {
                Err(SchedError::InvalidConfig(format!("policy must be 'fcfs' or 'priority', got {other:?}")))
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::Fcfs => "fcfs",
            Policy::Priority => "priority",
        }
    }
}

/// Everything the scheduler needs to know about the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// KV blocks in the pool (the executor sizes its cache to match).
    pub num_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Cap on running sequences; also the number of persistent-batch rows.
    pub max_num_seqs: usize,
    /// Token budget of one step (decode tokens plus prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output) the model accepts.
    pub max_model_len: usize,
    /// Cap on the prefill tokens one sequence may take in one step; 0 = no cap beyond the
    /// budget.
    pub long_prefill_token_threshold: usize,
    pub enable_prefix_caching: bool,
    /// Record the prefix cache's changes into each output event (`kv_events.rs`).
    pub enable_kv_events: bool,
    pub policy: Policy,
    /// Steps planned ahead of their results: 1 (plan, run, update in turn) or 2 (plan N+1
    /// while N runs).
    pub pipeline_depth: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            num_blocks: 4096,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 4096,
            long_prefill_token_threshold: 0,
            enable_prefix_caching: true,
            enable_kv_events: false,
            policy: Policy::Fcfs,
            pipeline_depth: 2,
        }
    }
}

impl SchedulerConfig {
    /// Checks every field; the message names the argument at fault.
    pub fn validate(&self) -> SchedResult<()> {
        let positive = [
            ("num_blocks", self.num_blocks),
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(SchedError::InvalidConfig(format!("{name} must be at least 1")));
            }
        }
        if !(1..=2).contains(&self.pipeline_depth) {
            return Err(SchedError::InvalidConfig(format!(
                "pipeline_depth must be 1 or 2, got {}",
                self.pipeline_depth
            )));
        }
        let fits = |v: usize| v <= i32::MAX as usize;
        if !(fits(self.max_num_seqs) && fits(self.num_blocks) && fits(self.max_model_len)) {
            return Err(SchedError::InvalidConfig(
                "num_blocks, max_num_seqs and max_model_len must fit in int32".into(),
            ));
        }
        if self.max_num_batched_tokens < self.max_num_seqs.min(self.max_model_len) {
            // Not fatal for correctness, but a budget below the sequence cap can never run a
            // full decode batch; ask for an explicit, consistent pair.
            return Err(SchedError::InvalidConfig(format!(
                "max_num_batched_tokens ({}) must be at least max_num_seqs ({}) so that every \
                 running sequence can decode in one step",
                self.max_num_batched_tokens, self.max_num_seqs
            )));
        }
        Ok(())
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}
