//! A request as the caller describes it, and the scheduling state of each of its samples
//! (sequences).

use std::sync::Arc;

use crate::attachment::Attachment;
use crate::block_hash::{extend_block_hashes, BlockHash};
use crate::block_pool::BlockId;
use crate::config::SchedulerConfig;
use crate::constraint::{ConstraintHandle, Matcher};
use crate::error::{SchedError, SchedResult};
use crate::plan::FinishReason;
use crate::spec::SpecRecord;

/// Sequence id: one per sample, never reused within a scheduler.
pub type SeqId = u64;

/// Index of a live sequence in the scheduler's slab (reused after the sequence is gone;
/// not a [`SeqId`]).
pub type SeqIndex = u32;

/// A generation (or pooling) request as it enters the scheduler.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestSpec {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub min_tokens: usize,
    /// EOS ids (a checkpoint may declare several); ignored when `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
    /// Lower runs first under the `priority` policy.
    pub priority: i64,
    /// Prefill only: the executor pools the prompt's hidden states, nothing is sampled.
    pub pooling: bool,
    /// Parallel samples sharing the prompt's KV blocks.
    pub n: usize,
    /// Mixed into the first block hash so that tenants do not share cached prefixes.
    pub cache_salt: Option<String>,
    /// What the executor needs of each sample (its sampling or pooling parameters): empty,
    /// or one per sample. Handed over in the plan that (re)admits the sample.
    pub sample_attachments: Vec<Attachment>,
    /// A compiled grammar every sample's output must match (each sample gets its own
    /// matcher).
    pub constraint: Option<ConstraintHandle>,
    /// Never propose drafts for its samples: the executor would refuse them (its logits
    /// processors follow its output: `min_tokens`, `bad_words`, custom processors), so
    /// drafting would only cost it the pipeline overlap.
    pub no_spec: bool,
}

impl RequestSpec {
    /// Rejects requests that can never be served under `config`.
    pub fn validate(&self, config: &SchedulerConfig) -> SchedResult<()> {
        let err = |reason: String| SchedError::InvalidRequest { request_id: self.request_id.clone(), reason };
        if self.request_id.is_empty() {
            return Err(err("request_id must not be empty".into()));
        }
        if self.prompt.is_empty() {
            return Err(err("prompt is empty: at least one token is needed".into()));
        }
        if self.n == 0 {
            return Err(err("n must be at least 1".into()));
        }
        if !self.sample_attachments.is_empty() && self.sample_attachments.len() != self.n {
            return Err(err(format!(
                "{} sample attachments for n = {}: give none or one per sample",
                self.sample_attachments.len(),
                self.n
            )));
        }
        if self.pooling && self.constraint.is_some() {
            return Err(err("a pooling request samples nothing: it takes no output constraint".into()));
        }
        if self.n > config.max_num_seqs {
            return Err(err(format!("n = {} exceeds max_num_seqs = {}", self.n, config.max_num_seqs)));
        }
        let prompt_len = self.prompt.len();
        let total = if self.pooling {
            if self.n != 1 {
                return Err(err("pooling requests take n = 1".into()));
            }
            if prompt_len > config.max_num_batched_tokens {
                return Err(err(format!(
                    "pooling prompt of {prompt_len} tokens exceeds max_num_batched_tokens = {} \
                     (pooling prompts are computed in one step)",
                    config.max_num_batched_tokens
                )));
            }
            prompt_len
        } else {
            if self.max_tokens == 0 {
                return Err(err("max_tokens must be at least 1".into()));
            }
            if self.min_tokens > self.max_tokens {
                return Err(err(format!(
                    "min_tokens = {} exceeds max_tokens = {}",
                    self.min_tokens, self.max_tokens
                )));
            }
            prompt_len.saturating_add(self.max_tokens)
        };
        if total > config.max_model_len {
            return Err(err(format!(
                "prompt ({prompt_len} tokens) + max_tokens ({}) = {total} exceeds max_model_len = {}",
                if self.pooling { 0 } else { self.max_tokens },
                config.max_model_len
            )));
        }
        // Each table of a hybrid model may hold the whole length at once (a windowed one
        // only until its window passes, but admission does not count on that).
        let tables = config.num_tables();
        let blocks = config.blocks_for(total) * tables;
        if blocks > config.num_blocks {
            let per = if tables > 1 { format!(" ({tables} block tables)") } else { String::new() };
            return Err(err(format!(
                "needs {blocks} KV blocks of {} tokens{per} but the pool has only {}",
                config.block_size, config.num_blocks
            )));
        }
        Ok(())
    }
}

/// Stop conditions shared by the samples of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct StopCriteria {
    pub min_tokens: usize,
    pub eos_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqState {
    /// Parked until its first sibling's prompt is scheduled (n > 1).
    Parked,
    Waiting,
    Running,
    /// Ended; it keeps its [`SeqIndex`] only while an in-flight step still references it.
    Finished,
}

/// Scheduling state of one sample.
///
/// A decode step reads and writes only the first 128 bytes (`repr(C, align(128))`,
/// counters as `u32`): the counters planning reads (the first 48 bytes), then the token
/// vector's header and the newest tokens, staged there and moved into `tokens` a few at
/// a time. The two cache lines form one aligned pair, which the CPU fetches together;
/// writing each token straight into `tokens` missed the cache on a line of its own per
/// sequence and step. The block table and the rest live behind them.
#[derive(Debug, Clone)]
#[repr(C, align(128))]
pub struct Sequence {
    // ---- hot: read by planning ----
    /// Tokens known so far: the prompt and every accepted output token (`tokens`, then
    /// the staged ones).
    pub num_tokens: u32,
    /// Tokens whose KV is written or being written by a planned step. While the sequence
    /// runs, it holds exactly `blocks_for(num_computed)` blocks.
    pub num_computed: u32,
    pub num_prompt: u32,
    /// Copy of `stop.max_tokens`, read every step.
    pub max_tokens: u32,
    /// Leading entries of `blocks` already offered to the prefix cache.
    pub num_registered: u32,
    /// Planned steps that will sample a token for this sequence and have not reported.
    pub pending_samples: u8,
    /// Planned steps that reference this sequence and have not reported.
    pub inflight_steps: u8,
    pub state: SeqState,
    pub pooling: bool,
    /// Persistent-batch row, [`NO_ROW`] while not running.
    pub row: u32,
    /// Copies of the last known token and of `blocks.last()`: a decode reads these
    /// instead of the two vectors' heap memory.
    pub last_token: u32,
    pub tail_block: BlockId,
    /// It has a matcher: each of its samples needs a grammar mask.
    pub constrained: bool,
    pub id: SeqId,
    // ---- hot: written by every accepted token ----
    /// The known tokens but the staged ones.
    tokens: Vec<u32>,
    /// The newest `num_tokens - tokens.len()` tokens.
    staged: [u32; STAGED_TOKENS],
    // ---- cold ----
    pub blocks: Vec<BlockId>,
    /// Leading entries of `blocks` reused rather than computed (prefix-cache hits, or a
    /// sibling's prompt blocks) at the latest admission.
    pub num_shared_blocks: u32,
    /// Leading entries of `blocks` handed back because every layer's window has passed
    /// them: each is [`NULL_BLOCK`](crate::block_pool::NULL_BLOCK) (`kv_groups.rs`).
    pub num_window_freed: u32,
    /// A hybrid model's other block tables (`scheduler/tables.rs`), table `t + 1` at
    /// index `t`; empty with one shared table.
    pub extra: Vec<GroupTable>,
    /// Sample index within its request (0..n).
    pub sample_index: u32,
    pub request_id: Arc<str>,
    /// Hashes of the full blocks of `tokens`.
    pub hashes: Vec<BlockHash>,
    pub stop: Arc<StopCriteria>,
    pub priority: i64,
    pub arrival: u64,
    pub cache_salt: Option<Arc<str>>,
    pub num_preemptions: u32,
    /// Prompt tokens not computed at first admission (prefix hit or shared with sibling).
    pub num_cached_tokens: usize,
    pub admitted_once: bool,
    /// A step that computed part of this sequence failed: its blocks are never offered
    /// to the prefix cache again.
    pub kv_failed: bool,
    /// The sibling whose prompt blocks this parked sample will share.
    pub fork_source: Option<SeqIndex>,
    /// The request's data for this sample, handed to the executor with each admission.
    pub attachment: Option<Attachment>,
    /// Its grammar matcher, advanced by every accepted token (kept across preemption,
    /// dropped when the sequence ends).
    pub matcher: Option<Matcher>,
    /// Its drafts so far, for the adaptive rule (`spec/mod.rs`).
    pub spec: SpecRecord,
    /// Drafts the executor proposed with the latest result (method "executor"), for the
    /// next step; replaced by every result.
    pub next_drafts: Vec<u32>,
}

/// One of a hybrid model's extra block tables for one sequence: as long as the first
/// table (`blocks`); its leading `freed` entries are null, handed back behind its window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupTable {
    pub blocks: Vec<BlockId>,
    pub freed: u32,
}

/// `Sequence::row` of a sequence that holds no row.
pub const NO_ROW: u32 = u32::MAX;

/// Accepted tokens a sequence keeps in its hot bytes before moving them to `tokens`: as
/// many as fill the 128 (checked below).
const STAGED_TOKENS: usize = 14;

const _: () = assert!(std::mem::offset_of!(Sequence, blocks) == 128, "the hot part must fill 128 bytes");

/// A cheap, conservative test of "could this token stop some sequence": one bit per token
/// id modulo 4096, set for every EOS and stop token id ever registered. A miss lets the
/// per-token stop check skip the sequence's stop lists; a hit falls through to them.
#[derive(Debug, Clone)]
pub struct StopTokenFilter {
    bits: Box<[u64; 64]>,
}

impl Default for StopTokenFilter {
    fn default() -> Self {
        StopTokenFilter { bits: Box::new([0; 64]) }
    }
}

impl StopTokenFilter {
    pub fn insert(&mut self, token: u32) {
        let b = (token & 4095) as usize;
        self.bits[b / 64] |= 1 << (b % 64);
    }

    pub fn may_contain(&self, token: u32) -> bool {
        let b = (token & 4095) as usize;
        self.bits[b / 64] & (1 << (b % 64)) != 0
    }
}

impl Sequence {
    /// A sequence in its first state, knowing only its prompt (validated non-empty).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: SeqId,
        request_id: Arc<str>,
        sample_index: u32,
        state: SeqState,
        prompt: &[u32],
        stop: Arc<StopCriteria>,
        max_tokens: u32,
        priority: i64,
        arrival: u64,
        pooling: bool,
        cache_salt: Option<Arc<str>>,
    ) -> Sequence {
        Sequence {
            num_tokens: prompt.len() as u32,
            num_computed: 0,
            num_prompt: prompt.len() as u32,
            max_tokens,
            num_registered: 0,
            pending_samples: 0,
            inflight_steps: 0,
            state,
            pooling,
            row: NO_ROW,
            last_token: *prompt.last().expect("validated non-empty"),
            tail_block: 0,
            constrained: false,
            id,
            tokens: prompt.to_vec(),
            staged: [0; STAGED_TOKENS],
            blocks: Vec::new(),
            num_shared_blocks: 0,
            num_window_freed: 0,
            extra: Vec::new(),
            sample_index,
            request_id,
            hashes: Vec::new(),
            stop,
            priority,
            arrival,
            cache_salt,
            num_preemptions: 0,
            num_cached_tokens: 0,
            admitted_once: false,
            kv_failed: false,
            fork_source: None,
            attachment: None,
            matcher: None,
            spec: SpecRecord::default(),
            next_drafts: Vec::new(),
        }
    }

    /// Appends a sampled token.
    #[inline]
    pub fn push_token(&mut self, token: u32) {
        let mut staged = self.num_tokens as usize - self.tokens.len();
        if staged == STAGED_TOKENS {
            self.flush_staged();
            staged = 0;
        }
        self.staged[staged] = token;
        self.num_tokens += 1;
        self.last_token = token;
    }

    /// Moves the staged tokens into `tokens`.
    fn flush_staged(&mut self) {
        let staged = self.num_tokens as usize - self.tokens.len();
        self.tokens.extend_from_slice(&self.staged[..staged]);
    }

    /// The token ids of full block `i` and the hash of the block before it, for a block
    /// `update_hashes` has hashed (which moved its tokens in).
    pub fn hashed_block(&self, i: usize, block_size: usize) -> (&[u32], Option<BlockHash>) {
        (&self.tokens[i * block_size..(i + 1) * block_size], i.checked_sub(1).map(|p| self.hashes[p]))
    }

    /// Every known token, in order.
    pub fn known_tokens(&mut self) -> &[u32] {
        self.flush_staged();
        &self.tokens
    }

    /// Reserves room for `total` known tokens, so that appending never moves them.
    pub fn reserve_tokens(&mut self, total: usize) {
        self.tokens.reserve_exact(total.saturating_sub(self.tokens.len()));
    }

    pub fn num_tokens(&self) -> usize {
        self.num_tokens as usize
    }

    /// Token at `pos`, which must be known.
    #[inline]
    pub fn token_at(&self, pos: usize) -> u32 {
        if pos + 1 == self.num_tokens as usize {
            self.last_token
        } else if pos >= self.tokens.len() {
            self.staged[pos - self.tokens.len()]
        } else {
            self.tokens[pos]
        }
    }

    /// KV block holding `pos`, which must be allocated; `num_blocks` is how many blocks the
    /// sequence holds (passed in so that a decode does not read the block table).
    #[inline]
    pub fn block_at(&self, pos: usize, block_size: usize, num_blocks: usize) -> BlockId {
        let i = pos / block_size;
        if i + 1 == num_blocks {
            self.tail_block
        } else {
            self.blocks[i]
        }
    }

    pub fn num_output(&self) -> usize {
        (self.num_tokens - self.num_prompt) as usize
    }

    pub fn computed(&self) -> usize {
        self.num_computed as usize
    }

    pub fn prompt_len(&self) -> usize {
        self.num_prompt as usize
    }

    pub fn row(&self) -> Option<u32> {
        (self.row != NO_ROW).then_some(self.row)
    }

    /// Known tokens plus those being sampled by in-flight steps.
    pub fn num_tokens_with_pending(&self) -> usize {
        self.num_tokens as usize + self.pending_samples as usize
    }

    /// Tokens this sequence could compute in the next step, before budget caps: 0 while it
    /// waits for its pending sample or has nothing left it may produce.
    pub fn tokens_wanted(&self, config: &SchedulerConfig) -> usize {
        if self.pooling {
            return if self.num_computed == 0 { self.num_tokens as usize } else { 0 };
        }
        let total = self.num_tokens_with_pending();
        if self.num_output() + self.pending_samples as usize >= self.max_tokens as usize
            || total >= config.max_model_len
        {
            return 0;
        }
        total.saturating_sub(self.computed())
    }

    pub fn update_hashes(&mut self, block_size: usize) {
        self.flush_staged();
        extend_block_hashes(&mut self.hashes, &self.tokens, block_size, self.cache_salt.as_deref());
    }

    /// Whether `token` (just appended) ends the sequence, and why. `maybe_stop_token` is
    /// the [`StopTokenFilter`] verdict; when false the stop lists are not read.
    pub fn check_stop(
        &self,
        token: u32,
        maybe_stop_token: bool,
        config: &SchedulerConfig,
    ) -> Option<(FinishReason, Option<u32>)> {
        let out = self.num_output();
        if maybe_stop_token && out >= self.stop.min_tokens {
            if !self.stop.ignore_eos && self.stop.eos_token_ids.contains(&token) {
                return Some((FinishReason::Stop, Some(token)));
            }
            if self.stop.stop_token_ids.contains(&token) {
                return Some((FinishReason::Stop, Some(token)));
            }
        }
        if out >= self.max_tokens as usize || self.num_tokens as usize >= config.max_model_len {
            return Some((FinishReason::Length, None));
        }
        None
    }
}
