//! The continuous-batching scheduler: owns every sequence's scheduling state and the KV
//! block pool. Plain Rust, single-threaded; `engine.rs` runs it on its own thread.
//!
//! Data flow: `add_request` → [`Scheduler::schedule`] (a [`StepPlan`]) → the executor runs
//! it → [`Scheduler::apply_result`] (appends tokens, checks stops, frees) →
//! [`Scheduler::take_output`] (an [`OutputEvent`]).
//!
//! **Progress (no livelock).** Running sequences are ordered by rank (priority, then
//! arrival). A sequence that needs blocks may only preempt sequences ranked *below* it, so
//! the top-ranked running sequence is never preempted and, since admission guarantees
//! that any single request fits in the whole pool, it can always get its blocks once the
//! others are preempted (or once in-flight steps release deferred blocks). It therefore
//! finishes within `max_tokens` steps, and by induction so does every request. Waiting
//! requests are not admitted in a step that preempted, so a victim is not re-admitted
//! only to be preempted again in the same breath.

mod drafts;
mod masks;
mod queues;
mod schedule;
mod tables;
mod update;
mod window;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::block_hash::BlockHash;
use crate::block_pool::{BlockId, BlockPool, PoolUsage, PrefixCacheStats, NULL_BLOCK};
use crate::config::{Policy, SchedulerConfig};
use crate::constraint::{GrammarMask, Matcher};
use crate::error::{SchedError, SchedResult};
use crate::plan::{FinishReason, OutputEvent};
use crate::request::{
    RequestSpec, SeqId, SeqIndex, SeqState, Sequence, StopCriteria, StopTokenFilter, NO_ROW,
};
use crate::spec::suffix::{SuffixCache, SUFFIX_CACHE_TOKENS};
use crate::spec::{SpecMethod, MAX_SPECULATIVE_TOKENS};

pub use queues::Rank;
use queues::{RowAllocator, RunningList, WaitingQueue};
pub use update::SpecResult;

/// A planned step that has not reported back. Its sequences are [`SeqIndex`]es into the
/// scheduler's slab.
#[derive(Debug, Default)]
struct InflightStep {
    step_id: u64,
    /// Every scheduled sequence, in plan order.
    scheduled: Vec<SeqIndex>,
    /// The sampled sequences, in `logits_indices` order.
    sampled: Vec<SeqIndex>,
    /// Pooling sequences that complete with this step.
    pooled: Vec<SeqIndex>,
    /// Blocks this step writes KV into (a decode: one per sequence). If the step fails,
    /// they lose any prefix-cache identity and whoever reused them fails too.
    written: Vec<BlockId>,
    /// Blocks that became full and known in this plan, to make findable in the prefix
    /// cache (in batches: see `flush_registrations`), with the sequence and block index
    /// they hold (read for KV-cache events) and the table (0 but for a hybrid model's
    /// extra tables, whose hash is `for_table`'s and which publish no event).
    to_register: Vec<(BlockId, BlockHash, SeqIndex, u32, u8)>,
    /// Leading entries of `to_register` already handed to the block pool.
    num_flushed: usize,
    /// First samples whose prompt completes in this step (their siblings may start).
    unpark: Vec<SeqIndex>,
    /// The constrained samples, in `mask_sample_indices` order.
    masked: Vec<SeqIndex>,
    /// Words per mask row (the widest of their constraints).
    mask_words: usize,
    /// Where their mask goes, until it is sent (`masks.rs`).
    mask_tx: Option<crossbeam_channel::Sender<GrammarMask>>,
    /// Drafts of each sampled sequence, in `sampled` order; empty when the step has none.
    draft_counts: Vec<u32>,
    /// The drafts, flat, in the same order.
    drafts: Vec<u32>,
}

/// The samples of one request, for abort and for id reuse.
#[derive(Debug)]
struct RequestGroup {
    seq_indices: Vec<SeqIndex>,
    live: usize,
}

/// Counters that only grow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerCounters {
    pub steps_planned: u64,
    pub steps_applied: u64,
    pub preemptions: u64,
    pub requests_added: u64,
    pub sequences_finished: u64,
    /// Prompt (and recomputed) tokens scheduled in prefill chunks.
    pub prefill_tokens_scheduled: u64,
    /// Tokens scheduled as decodes.
    pub decode_tokens_scheduled: u64,
    /// Sampled tokens accepted into sequences.
    pub generated_tokens: u64,
    /// Sampled tokens dropped because their sequence had already finished.
    pub discarded_tokens: u64,
    /// Steps whose grammar masks the scheduler computed, and the masks (sequences) in them.
    pub mask_steps: u64,
    pub masks_computed: u64,
    /// Total time spent computing masks, in nanoseconds.
    pub mask_ns: u64,
    /// Constrained sequences ended because their grammar allowed no token.
    pub dead_ends: u64,
    /// Block-table entries handed back while their sequence ran, every layer's sliding
    /// window having passed them (`window.rs`).
    pub window_freed_blocks: u64,
}

/// Speculative decoding's figures (counters that only grow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecStats {
    /// Drafts per sequence and step at most (the configured k): the length of
    /// `accepted_per_position` that counts.
    pub k: usize,
    /// Sequence-steps that carried drafts, and the drafts in them.
    pub drafts: u64,
    pub draft_tokens: u64,
    /// Drafts accepted, in all and by position (the first draft, the second, ...).
    pub accepted_tokens: u64,
    pub accepted_per_position: [u64; MAX_SPECULATIVE_TOKENS],
    /// Times the adaptive rule stopped proposing for a sequence: in all, because its rate
    /// fell below `spec_min_acceptance`, because `MAX_FAILED_STEPS` steps in a row kept
    /// nothing, because an executor proposer's first `EXECUTOR_LEARNING_STEPS` verified
    /// steps kept nothing.
    pub disabled_sequences: u64,
    pub disabled_low_rate: u64,
    pub disabled_failing: u64,
    pub disabled_learning: u64,
    /// Of the turn-offs above, those of the scheduler's own proposers (n-gram, suffix),
    /// which pause the sequence and probe again later (`spec::PAUSE_STEPS`) instead: a
    /// sequence paused again counts again, here and above.
    pub pauses: u64,
    /// Back-offs (plain decoding for a while) after a drafted step that kept nothing, and
    /// after a lookup that found nothing.
    pub backoffs: u64,
    pub empty_proposals: u64,
    /// Proposer calls (one per sequence and step it may draft in) and their time.
    pub proposals: u64,
    pub propose_ns: u64,
}

impl Default for SpecStats {
    fn default() -> Self {
        SpecStats {
            k: 0,
            drafts: 0,
            draft_tokens: 0,
            accepted_tokens: 0,
            accepted_per_position: [0; MAX_SPECULATIVE_TOKENS],
            disabled_sequences: 0,
            disabled_low_rate: 0,
            disabled_failing: 0,
            disabled_learning: 0,
            pauses: 0,
            backoffs: 0,
            empty_proposals: 0,
            proposals: 0,
            propose_ns: 0,
        }
    }
}

/// A snapshot for stats and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerSnapshot {
    pub num_running: usize,
    pub num_waiting: usize,
    /// Waiting sequences that have been preempted at least once.
    pub num_preempted_waiting: usize,
    pub num_inflight_steps: usize,
    pub kv: PoolUsage,
    /// The most KV blocks in use at once so far.
    pub kv_peak_used: usize,
    pub prefix: PrefixCacheStats,
    pub counters: SchedulerCounters,
    pub spec: SpecStats,
}

pub struct Scheduler {
    config: SchedulerConfig,
    pool: BlockPool,
    /// Sequence slab, indexed by [`SeqIndex`]; an index is reused only after its sequence
    /// ended and no in-flight step references it.
    seqs: Vec<Option<Sequence>>,
    free_indices: Vec<SeqIndex>,
    index_of_seq: HashMap<SeqId, SeqIndex>,
    requests: HashMap<Arc<str>, RequestGroup>,
    waiting: WaitingQueue,
    running: RunningList,
    rows: RowAllocator,
    inflight: VecDeque<InflightStep>,
    next_seq_id: SeqId,
    next_arrival: u64,
    next_step_id: u64,
    /// Rows released since the last plan.
    freed_rows: Vec<i32>,
    output: OutputEvent,
    stop_filter: StopTokenFilter,
    /// Request ids whose last sample ended since the last `take_ended_requests`.
    ended_requests: Vec<Arc<str>>,
    counters: SchedulerCounters,
    spec_stats: SpecStats,
    /// Finished outputs the suffix proposer looks up (method "suffix" only).
    suffix_cache: Option<SuffixCache>,
    /// Scratch for one sequence's proposed drafts.
    draft_buf: Vec<u32>,
    /// Blocks behind this window are freed while a sequence runs: every KV group is
    /// windowed (`kv_groups.rs`, `window.rs`); None keeps every block.
    window: Option<usize>,
    /// Windows of a hybrid model's extra block tables (table `t + 1` at index `t`,
    /// `tables.rs`); empty with one shared table.
    extra_windows: Vec<Option<usize>>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> SchedResult<Self> {
        config.validate()?;
        let mut pool = BlockPool::new(config.num_blocks, config.block_size, config.enable_prefix_caching);
        if config.enable_kv_events {
            pool.record_events();
        }
        Ok(Scheduler {
            pool,
            rows: RowAllocator::new(config.max_num_seqs),
            seqs: Vec::new(),
            free_indices: Vec::new(),
            index_of_seq: HashMap::new(),
            requests: HashMap::new(),
            waiting: WaitingQueue::default(),
            running: RunningList::default(),
            inflight: VecDeque::new(),
            next_seq_id: 0,
            next_arrival: 0,
            next_step_id: 0,
            freed_rows: Vec::new(),
            output: OutputEvent::default(),
            stop_filter: StopTokenFilter::default(),
            ended_requests: Vec::new(),
            counters: SchedulerCounters::default(),
            spec_stats: SpecStats { k: config.num_speculative_tokens, ..SpecStats::default() },
            suffix_cache: (config.speculative_method == SpecMethod::Suffix).then(|| {
                SuffixCache::new(config.prompt_lookup_min, config.prompt_lookup_max, SUFFIX_CACHE_TOKENS)
            }),
            draft_buf: Vec::with_capacity(MAX_SPECULATIVE_TOKENS),
            window: config.shared_window(),
            extra_windows: config.table_layout().map_or_else(Vec::new, |l| {
                debug_assert_eq!(l.windows[0], None, "table 0 is a full table");
                l.windows[1..].to_vec()
            }),
            config,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Adds a request; returns the id of its first sequence (the others follow
    /// consecutively).
    pub fn add_request(&mut self, spec: RequestSpec) -> SchedResult<SeqId> {
        let first = self.next_seq_id;
        self.add_request_as(spec, first)
    }

    /// Like [`add_request`](Self::add_request) with sequence ids chosen by the caller (the
    /// engine handle hands them out before the request reaches the scheduler thread). Ids
    /// must increase from one request to the next.
    pub fn add_request_as(&mut self, spec: RequestSpec, first_seq_id: SeqId) -> SchedResult<SeqId> {
        spec.validate(&self.config)?;
        if first_seq_id < self.next_seq_id {
            return Err(SchedError::InvalidRequest {
                request_id: spec.request_id,
                reason: format!("sequence id {first_seq_id} was already issued"),
            });
        }
        self.next_seq_id = first_seq_id;
        if self.requests.contains_key(spec.request_id.as_str()) {
            return Err(SchedError::DuplicateRequest(spec.request_id));
        }
        let request_id: Arc<str> = Arc::from(spec.request_id.as_str());
        for &t in spec.eos_token_ids.iter().chain(&spec.stop_token_ids) {
            self.stop_filter.insert(t);
        }
        let stop = Arc::new(StopCriteria {
            min_tokens: spec.min_tokens,
            eos_token_ids: spec.eos_token_ids,
            ignore_eos: spec.ignore_eos,
            stop_token_ids: spec.stop_token_ids,
        });
        let salt: Option<Arc<str>> = spec.cache_salt.as_deref().map(Arc::from);
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let first_id = self.next_seq_id;
        let mut group = RequestGroup { seq_indices: Vec::with_capacity(spec.n), live: spec.n };
        let mut first_seq_index = None;
        for index in 0..spec.n {
            let id = self.next_seq_id;
            self.next_seq_id += 1;
            let parked = index > 0;
            let state = if parked { SeqState::Parked } else { SeqState::Waiting };
            let priority = if self.config.policy == Policy::Priority { spec.priority } else { 0 };
            let mut seq = Sequence::new(
                id,
                request_id.clone(),
                index as u32,
                state,
                &spec.prompt,
                stop.clone(),
                spec.max_tokens as u32,
                priority,
                arrival,
                spec.pooling,
                salt.clone(),
            );
            seq.fork_source = first_seq_index;
            seq.attachment = spec.sample_attachments.get(index).cloned();
            seq.matcher = spec.constraint.as_ref().map(Matcher::start);
            seq.constrained = seq.matcher.is_some();
            seq.spec.off = spec.no_spec;
            if index == 0 && self.config.enable_prefix_caching {
                seq.update_hashes(self.config.block_size);
            }
            let seq_index = self.insert_seq(seq);
            if index == 0 {
                first_seq_index = Some(seq_index);
                let rank = self.rank_of(seq_index);
                self.waiting.insert(rank, seq_index);
            }
            group.seq_indices.push(seq_index);
        }
        self.requests.insert(request_id, group);
        self.counters.requests_added += 1;
        Ok(first_id)
    }

    /// Aborts every sample of `request_id`. Returns false when no such request is live
    /// (already finished, or never added): aborting races with finishing by nature.
    pub fn abort(&mut self, request_id: &str) -> bool {
        let Some(group) = self.requests.get(request_id) else {
            return false;
        };
        let seq_indices = group.seq_indices.clone();
        for seq_index in seq_indices {
            // A sample that already ended may have had its index reused by another request.
            if self
                .seq(seq_index)
                .is_some_and(|s| s.state != SeqState::Finished && &*s.request_id == request_id)
            {
                self.end_sequence(seq_index, FinishReason::Abort, None);
            }
        }
        true
    }

    /// Ends one sequence from outside (the output thread found a stop string). Returns
    /// false when it has already ended; an id this scheduler never issued is an error.
    pub fn finish(&mut self, seq_id: SeqId, reason: FinishReason) -> SchedResult<bool> {
        if seq_id >= self.next_seq_id {
            return Err(SchedError::Unknown { kind: "sequence", id: seq_id.to_string() });
        }
        match self.index_of_seq.get(&seq_id) {
            Some(&seq_index)
                if self.seqs[seq_index as usize].as_ref().unwrap().state != SeqState::Finished =>
            {
                // (Its output is not kept for suffix proposals: the scheduler does not
                // know where in its tokens the stop string ended.)
                self.close_sequence(seq_index, reason, None, false);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// True while any request is unfinished or any step is in flight.
    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty() || !self.inflight.is_empty()
    }

    pub fn num_inflight(&self) -> usize {
        self.inflight.len()
    }

    /// Whether a new plan may be made now (the pipeline has room).
    pub fn can_plan(&self) -> bool {
        self.inflight.len() < self.config.pipeline_depth
    }

    pub fn num_live_requests(&self) -> usize {
        self.requests.len()
    }

    pub fn snapshot(&self) -> SchedulerSnapshot {
        SchedulerSnapshot {
            num_running: self.running.len(),
            num_waiting: self.waiting.len()
                + self.live_seqs().filter(|s| s.state == SeqState::Parked).count(),
            num_preempted_waiting: self
                .waiting
                .seq_indices()
                .filter(|&s| self.seq(s).is_some_and(|q| q.num_preemptions > 0))
                .count(),
            num_inflight_steps: self.inflight.len(),
            kv: self.pool.usage(),
            kv_peak_used: self.pool.peak_used(),
            prefix: self.pool.prefix_stats(),
            counters: self.counters,
            spec: self.spec_stats,
        }
    }

    pub fn counters(&self) -> SchedulerCounters {
        self.counters
    }

    /// Request ids that ended since the last call (their ids may be reused now).
    pub fn take_ended_requests(&mut self) -> Vec<Arc<str>> {
        std::mem::take(&mut self.ended_requests)
    }

    /// Takes what happened since the last call (tokens accepted, sequences ended).
    pub fn take_output(&mut self, step_id: Option<u64>) -> OutputEvent {
        let mut ev = std::mem::take(&mut self.output);
        ev.step_id = step_id;
        ev.kv_events = self.pool.take_events();
        ev
    }

    /// Checks cross-structure invariants: block reference counts equal the number of
    /// sequences holding each block, no free block is owned, every cached entry is a full
    /// block with the hash of its content, queues agree with sequence states.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let mut owners = vec![0u32; self.pool.num_blocks()];
        for seq in self.live_seqs() {
            let freed = seq.num_window_freed as usize;
            if freed > seq.blocks.len() || seq.blocks[..freed].iter().any(|&b| b != NULL_BLOCK) {
                return Err(format!("sequence {}: its window-freed entries are not all null", seq.id));
            }
            if freed > 0 && self.window.is_none() {
                return Err(format!("sequence {} freed blocks without a shared window", seq.id));
            }
            if let Some(w) = self.window {
                let behind = crate::kv_groups::blocks_behind(seq.computed(), w, self.config.block_size);
                if seq.state == SeqState::Running && freed > behind {
                    return Err(format!("sequence {} freed a block its window still reads", seq.id));
                }
            }
            for &b in &seq.blocks[freed..] {
                if b == NULL_BLOCK {
                    return Err(format!("sequence {} holds a null block inside its window", seq.id));
                }
                owners[b as usize] += 1;
            }
            if seq.extra.len() != if seq.blocks.is_empty() { 0 } else { self.extra_windows.len() } {
                return Err(format!("sequence {} has {} extra tables", seq.id, seq.extra.len()));
            }
            for (t, (table, &w)) in seq.extra.iter().zip(&self.extra_windows).enumerate() {
                let freed = table.freed as usize;
                if table.blocks.len() != seq.blocks.len() {
                    return Err(format!("sequence {}: table {} is not as long as table 0", seq.id, t + 1));
                }
                if table.blocks[..freed].iter().any(|&b| b != NULL_BLOCK) {
                    return Err(format!(
                        "sequence {}: table {}'s freed entries are not all null",
                        seq.id,
                        t + 1
                    ));
                }
                let behind = w.map_or(0, |w| {
                    crate::kv_groups::blocks_behind(seq.computed(), w, self.config.block_size)
                });
                if (seq.state == SeqState::Running && freed > behind) || (w.is_none() && freed > 0) {
                    return Err(format!("sequence {}: table {} freed a block it still reads", seq.id, t + 1));
                }
                for &b in &table.blocks[freed..] {
                    if b == NULL_BLOCK {
                        return Err(format!(
                            "sequence {}: table {} holds a null inside its window",
                            seq.id,
                            t + 1
                        ));
                    }
                    owners[b as usize] += 1;
                }
                for (i, &b) in table.blocks.iter().enumerate().take(seq.num_registered as usize).skip(freed) {
                    if let Some(h) = self.pool.hash_of(b) {
                        if seq.hashes.get(i).map(|h| h.for_table(t + 1)) != Some(h) {
                            return Err(format!(
                                "block {b} of table {} cached with a hash not its own",
                                t + 1
                            ));
                        }
                    }
                }
            }
            if seq.state != SeqState::Running && seq.state != SeqState::Finished && !seq.blocks.is_empty() {
                return Err(format!("sequence {} holds blocks while {:?}", seq.id, seq.state));
            }
            if seq.blocks.len() < self.config.blocks_for(seq.computed()) {
                return Err(format!("sequence {} computes past its blocks", seq.id));
            }
            if seq.state == SeqState::Running && seq.blocks.len() != self.config.blocks_for(seq.computed()) {
                return Err(format!("running sequence {} holds blocks beyond what it computes", seq.id));
            }
            for (i, &b) in seq.blocks.iter().enumerate().take(seq.num_registered as usize).skip(freed) {
                if let Some(h) = self.pool.hash_of(b) {
                    if seq.hashes.get(i) != Some(&h) {
                        return Err(format!("block {b} cached with a hash its content does not have"));
                    }
                }
            }
        }
        for (b, &n) in owners.iter().enumerate() {
            let rc = self.pool.ref_count(b as u32);
            if rc != n {
                return Err(format!("block {b}: reference count {rc} but {n} owners"));
            }
        }
        for seq_index in self.running.seq_indices() {
            if self.seq(seq_index).map(|s| s.state) != Some(SeqState::Running) {
                return Err(format!("sequence index {seq_index} in the running list is not running"));
            }
        }
        for seq_index in self.waiting.seq_indices() {
            if self.seq(seq_index).map(|s| s.state) != Some(SeqState::Waiting) {
                return Err(format!("sequence index {seq_index} in the waiting queue is not waiting"));
            }
        }
        let rows_held = self.live_seqs().filter(|s| s.row().is_some()).count();
        if rows_held + self.rows.num_free() != self.rows.capacity() {
            return Err(format!("{rows_held} rows held + {} free != capacity", self.rows.num_free()));
        }
        if self.running.len() > self.config.max_num_seqs {
            return Err("more running sequences than max_num_seqs".into());
        }
        Ok(())
    }

    // ---- internals shared by schedule.rs and update.rs ----

    fn live_seqs(&self) -> impl Iterator<Item = &Sequence> {
        self.seqs.iter().flatten()
    }

    fn seq(&self, seq_index: SeqIndex) -> Option<&Sequence> {
        self.seqs[seq_index as usize].as_ref()
    }

    fn seq_mut(&mut self, seq_index: SeqIndex) -> &mut Sequence {
        self.seqs[seq_index as usize].as_mut().expect("live sequence")
    }

    fn rank_of(&self, seq_index: SeqIndex) -> Rank {
        let s = self.seq(seq_index).expect("live sequence");
        Rank { priority: s.priority, arrival: s.arrival, seq_id: s.id }
    }

    fn insert_seq(&mut self, seq: Sequence) -> SeqIndex {
        let id = seq.id;
        let seq_index = match self.free_indices.pop() {
            Some(seq_index) => {
                self.seqs[seq_index as usize] = Some(seq);
                seq_index
            }
            None => {
                self.seqs.push(Some(seq));
                (self.seqs.len() - 1) as SeqIndex
            }
        };
        self.index_of_seq.insert(id, seq_index);
        seq_index
    }

    fn release_row(&mut self, seq_index: SeqIndex) {
        let seq = self.seq_mut(seq_index);
        if let Some(row) = seq.row() {
            seq.row = NO_ROW;
            self.rows.give_back(row);
            self.freed_rows.push(row as i32);
        }
    }

    /// Ends a sequence: records why, takes it out of its queue and releases its row. Its
    /// blocks go back now, or when the last in-flight step referencing it reports.
    fn end_sequence(&mut self, seq_index: SeqIndex, reason: FinishReason, stop_token: Option<u32>) {
        let remember = matches!(reason, FinishReason::Stop | FinishReason::Length);
        self.close_sequence(seq_index, reason, stop_token, remember);
    }

    /// [`end_sequence`](Self::end_sequence); `remember`: its output is kept for suffix
    /// proposals (every token it holds is output it really produced).
    fn close_sequence(
        &mut self,
        seq_index: SeqIndex,
        reason: FinishReason,
        stop_token: Option<u32>,
        remember: bool,
    ) {
        let rank = self.rank_of(seq_index);
        let state = self.seq(seq_index).unwrap().state;
        match state {
            SeqState::Running => {
                self.running.remove(&rank);
            }
            SeqState::Waiting => {
                self.waiting.remove(&rank);
            }
            SeqState::Parked | SeqState::Finished => {}
        }
        self.release_row(seq_index);
        if remember {
            self.remember_output(seq_index);
        }
        let seq = self.seq_mut(seq_index);
        seq.state = SeqState::Finished;
        seq.matcher = None;
        let (id, req, first_of_group) = (seq.id, seq.request_id.clone(), seq.sample_index == 0);
        let ev = &mut self.output;
        let seq = self.seqs[seq_index as usize].as_ref().unwrap();
        ev.finished_seq_ids.push(id);
        ev.finish_reasons.push(reason as u8);
        ev.stop_token_ids.push(stop_token.map_or(-1, i64::from));
        ev.num_prompt_tokens.push(seq.num_prompt as i32);
        ev.num_cached_tokens.push(seq.num_cached_tokens as i32);
        ev.num_output_tokens.push(seq.num_output() as i32);
        ev.num_preemptions.push(seq.num_preemptions as i32);
        self.counters.sequences_finished += 1;
        if let Some(group) = self.requests.get_mut(&req) {
            group.live -= 1;
            if group.live == 0 {
                self.requests.remove(&req);
                self.ended_requests.push(req);
            }
        }
        if first_of_group {
            // Siblings still parked behind this sample proceed on their own.
            self.unpark_siblings(seq_index);
        }
        self.release_if_idle(seq_index);
    }

    /// Frees a finished sequence's blocks and slab entry once no in-flight step references it.
    fn release_if_idle(&mut self, seq_index: SeqIndex) {
        let seq = self.seq(seq_index).unwrap();
        if seq.state != SeqState::Finished || seq.inflight_steps > 0 {
            return;
        }
        if !seq.kv_failed {
            self.register_rest(seq_index);
        }
        let mut seq = self.seqs[seq_index as usize].take().unwrap();
        tables::release_tables(&mut self.pool, &mut seq);
        self.pool.release(&seq.blocks[seq.num_window_freed as usize..]);
        self.index_of_seq.remove(&seq.id);
        self.free_indices.push(seq_index);
    }

    /// Offers the prefix cache the full blocks of `seq` that planning did not: those holding
    /// generated tokens. They are registered only when the sequence stops running (it ends
    /// or is preempted), as before that only a request repeating text this sequence is still
    /// generating could hit them; this keeps hashing out of the steady decode step, where at
    /// thousands of sequences its cache misses cost more per sequence than at hundreds.
    /// A follow-up turn, or this sequence recomputed after preemption, finds them.
    fn register_rest(&mut self, seq_index: SeqIndex) {
        let bs = self.config.block_size;
        let (pool, seq) = (&mut self.pool, self.seqs[seq_index as usize].as_mut().expect("live sequence"));
        if !pool.caching_enabled() || seq.pooling {
            return;
        }
        let full = seq.computed().min(seq.num_tokens()) / bs;
        tables::register_tables(pool, seq, full, bs);
    }

    /// Preempts the running sequence at `index` by recompute: its blocks go back at once
    /// (cached full blocks stay reusable) and it rejoins the waiting queue by rank.
    ///
    /// Freeing at once is safe even when an in-flight step still writes into those blocks:
    /// the executor runs plans in order, so whoever receives a block in a later plan
    /// writes it after the victim's step did.
    fn preempt_at(&mut self, index: usize) {
        let (rank, seq_index) = self.running.remove_at(index);
        self.release_row(seq_index);
        self.register_rest(seq_index);
        let seq = self.seqs[seq_index as usize].as_mut().unwrap();
        seq.state = SeqState::Waiting;
        tables::release_tables(&mut self.pool, seq);
        let blocks = std::mem::take(&mut seq.blocks);
        let freed = std::mem::take(&mut seq.num_window_freed) as usize;
        seq.num_computed = 0;
        seq.num_registered = 0;
        seq.num_shared_blocks = 0;
        seq.num_preemptions += 1;
        self.pool.release(&blocks[freed..]);
        self.waiting.insert(rank, seq_index);
        self.counters.preemptions += 1;
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod mask_tests;

#[cfg(test)]
mod spec_tests;

#[cfg(test)]
mod window_tests;

#[cfg(test)]
mod tables_tests;
