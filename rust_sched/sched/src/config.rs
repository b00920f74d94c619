//! Scheduler configuration: one validated value passed explicitly.

use crate::error::{SchedError, SchedResult};
use crate::kv_groups::{self, KvGroup};
use crate::spec::{SpecMethod, MAX_SPECULATIVE_TOKENS};

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
    /// Drafts proposed per sequence and step (k); 0 turns speculation off.
    pub num_speculative_tokens: usize,
    /// Where drafts come from (`spec/mod.rs`).
    pub speculative_method: SpecMethod,
    /// Shortest and longest match the n-gram and suffix proposers look for.
    pub prompt_lookup_min: usize,
    pub prompt_lookup_max: usize,
    /// Adaptive speculation: a sequence whose running acceptance rate falls below this,
    /// after a warm-up, gets no more drafts (0 = never).
    pub spec_min_acceptance: f64,
    /// The model's layers grouped by attention need (`kv_groups.rs`); empty: every layer
    /// sees the whole context. When every group is windowed, blocks behind the widest
    /// window are freed while a sequence runs.
    pub kv_groups: Vec<KvGroup>,
    /// Give a hybrid model's groups block tables of their own (`kv_groups::table_layout`),
    /// so that its windowed layers free their blocks; the executor sets it when its cache
    /// is laid out per table. Off, or for a model that is not hybrid: one shared table.
    pub group_tables: bool,
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
            num_speculative_tokens: 0,
            speculative_method: SpecMethod::None,
            prompt_lookup_min: 1,
            prompt_lookup_max: 3,
            spec_min_acceptance: 0.1,
            kv_groups: Vec::new(),
            group_tables: false,
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
        kv_groups::validate(&self.kv_groups)?;
        self.validate_speculation()
    }

    fn validate_speculation(&self) -> SchedResult<()> {
        let bad = |m: String| Err(SchedError::InvalidConfig(m));
        let (k, method) = (self.num_speculative_tokens, self.speculative_method);
        if k > MAX_SPECULATIVE_TOKENS {
            return bad(format!("num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, got {k}"));
        }
        if (k == 0) != (method == SpecMethod::None) {
            return bad(format!(
                "num_speculative_tokens ({k}) and speculative_method ({:?}) disagree: give both or neither",
                method.name()
            ));
        }
        if self.prompt_lookup_min == 0 || self.prompt_lookup_max < self.prompt_lookup_min {
            return bad(format!(
                "prompt_lookup_min ({}) must be at least 1 and at most prompt_lookup_max ({})",
                self.prompt_lookup_min, self.prompt_lookup_max
            ));
        }
        if self.prompt_lookup_max > 64 {
            return bad(format!("prompt_lookup_max must be at most 64, got {}", self.prompt_lookup_max));
        }
        if !(0.0..=1.0).contains(&self.spec_min_acceptance) {
            return bad(format!(
                "spec_min_acceptance must be within [0, 1], got {}",
                self.spec_min_acceptance
            ));
        }
        Ok(())
    }

    /// Whether drafts are planned at all.
    pub fn speculates(&self) -> bool {
        self.num_speculative_tokens > 0
    }

    /// The window behind which blocks are freed while a sequence runs (`kv_groups.rs`).
    pub fn shared_window(&self) -> Option<usize> {
        kv_groups::shared_window(&self.kv_groups)
    }

    /// The per-group tables the scheduler keeps, when it keeps more than one.
    pub fn table_layout(&self) -> Option<kv_groups::TableLayout> {
        if self.group_tables {
            kv_groups::table_layout(&self.kv_groups)
        } else {
            None
        }
    }

    /// Block tables per sequence: 1 unless a hybrid model has per-group tables.
    pub fn num_tables(&self) -> usize {
        self.table_layout().map_or(1, |l| l.num_tables())
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}
