//! What leaves the scheduler: one [`StepPlan`] per step for the executor and one
//! [`OutputEvent`] per applied result for the output thread. Flat vectors only, so the
//! bindings move them into numpy arrays without copying. `docs/contract.md` explains how
//! the fields fit together.

use crate::attachment::Attachment;
use crate::constraint::MaskTicket;
use crate::kv_events::KvEventLog;

/// Input token id meaning "the token this row sampled in the previous step"; the executor
/// fills it from the sampled-token tensor it still holds on the device.
pub const PLACEHOLDER_TOKEN: i64 = -1;

/// One step for the executor. `R` scheduled sequences, `T` tokens, `S` sampled sequences.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    /// Increases by one per plan; results are submitted in this order.
    pub step_id: u64,
    /// `[R]` persistent-batch row of each scheduled sequence.
    pub rows: Vec<i32>,
    /// `[R]` tokens computed for each sequence in this step (1 for a decode).
    pub num_scheduled_tokens: Vec<i32>,
    /// `[R+1]` prefix sum of `num_scheduled_tokens`, starting at 0.
    pub query_start_loc: Vec<i32>,
    /// `[R]` context length after this step (tokens before it + scheduled).
    pub seq_lens: Vec<i32>,
    /// `[T]` input token ids; [`PLACEHOLDER_TOKEN`] = previous sample of this row.
    pub input_ids: Vec<i64>,
    /// `[T]` position of each token in its sequence.
    pub positions: Vec<i64>,
    /// `[T]` KV slot of each token: `block_id * block_size + position % block_size`.
    pub slot_mapping: Vec<i64>,
    /// `[T * (G - 1)]` with `G` per-group tables: each token's KV slot in tables 1.. (token
    /// by token, `G - 1` per token; `slot_mapping` is table 0's); empty with one table.
    pub group_slot_mapping: Vec<i64>,
    /// `[E]` indices into the `T` tokens whose logits are sampled: one per entry (a
    /// sampled sequence with `d` drafts has `1 + d` consecutive entries, in position
    /// order; without drafts `E = S`).
    pub logits_indices: Vec<i64>,
    /// `[E]` row of each entry's sequence, in `logits_indices` order.
    pub sample_rows: Vec<i32>,
    /// `[S]` drafts of each sampled sequence, in sample order; empty when no sequence of
    /// the step has drafts.
    pub num_draft_tokens: Vec<i32>,
    /// `[D]` the drafts, flat, sequence by sequence (they are also in `input_ids`, after
    /// each such sequence's last committed token).
    pub draft_token_ids: Vec<i64>,
    /// `[Q]` indices into the `S` sampled sequences (sample order) whose next step's drafts
    /// the executor proposes (method "executor" only, else empty): those that may draft
    /// and have room for one. The executor's proposer runs for these alone.
    pub propose_indices: Vec<i32>,
    /// `[Q]` at most this many drafts for each of those sequences: what the scheduler can
    /// take in its next step (its room and, with the adaptive rule, the drafts it keeps
    /// lately, one more when this step carries drafts of its own).
    pub propose_counts: Vec<i32>,
    /// `[V]` indices into `rows` of the sequences that may still draft (method "executor"
    /// only, else empty): not turned off by the adaptive rule, constrained, pooling or
    /// `no_spec`. The others never draft again: a proposer with a cache of its own (an
    /// EAGLE-3 head) need not keep theirs.
    pub may_draft_indices: Vec<i32>,
    /// `[P]` indices into `rows` of pooling sequences whose whole prompt is in this step.
    pub pool_indices: Vec<i32>,
    /// `[B]` block-table writes: `block_table[rows[i], cols[i]] = ids[i]`.
    pub block_table_rows: Vec<i32>,
    pub block_table_cols: Vec<i32>,
    pub block_table_ids: Vec<i32>,
    /// `[B]` with per-group tables (a hybrid model, `kv_groups::TableLayout`): the table
    /// each write is for; empty with one shared table.
    pub block_table_groups: Vec<i32>,
    /// `[K]` rows of sequences that enter (or re-enter, after preemption) the batch.
    pub new_rows: Vec<i32>,
    /// `[K]` their sequence ids.
    pub new_seq_ids: Vec<u64>,
    /// `[K]` their prompt lengths.
    pub new_num_prompt_tokens: Vec<i32>,
    /// `[K+1]` offsets into `new_token_ids` (empty when K = 0; the bindings then hand
    /// Python `[0]`).
    pub new_token_offsets: Vec<i64>,
    /// All known tokens of each new sequence: its prompt, then (when resumed) its outputs.
    pub new_token_ids: Vec<i64>,
    /// `[K]` the request's attachment for each new sequence (its sampling or pooling
    /// parameters), None where the request gave none.
    pub new_attachments: Vec<Option<Attachment>>,
    /// `[F]` rows released since the previous plan.
    pub freed_rows: Vec<i32>,
    /// `[M]` indices into the `E` entries whose logits a grammar constrains, in order.
    pub mask_sample_indices: Vec<i32>,
    /// Where the executor takes this step's mask (`[M, words]` bits) just before sampling;
    /// None when `M` is 0.
    pub grammar_mask: Option<MaskTicket>,
}

impl StepPlan {
    pub fn num_seqs(&self) -> usize {
        self.rows.len()
    }

    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    /// Entries sampled (`E`: one per sampled sequence plus one per draft).
    pub fn num_samples(&self) -> usize {
        self.logits_indices.len()
    }

    /// Drafts in the step (`D`).
    pub fn num_drafts(&self) -> usize {
        self.draft_token_ids.len()
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FinishReason {
    /// EOS, a stop token id, or a stop string (via `finish`).
    Stop = 0,
    /// `max_tokens` or `max_model_len` reached.
    Length = 1,
    /// Aborted by the caller.
    Abort = 2,
    /// A pooling sequence whose prompt has been computed.
    Pooled = 3,
    /// The step that computed it failed in the executor.
    Error = 4,
    /// Its grammar allows no further token (nor the end): the sequence ends before
    /// sampling an invalid token.
    DeadEnd = 5,
}

/// Names of [`FinishReason`] by code, as exported to Python.
pub const FINISH_REASONS: [&str; 6] = ["stop", "length", "abort", "pooled", "error", "dead_end"];

impl FinishReason {
    pub fn name(self) -> &'static str {
        FINISH_REASONS[self as usize]
    }

    pub fn parse(name: &str) -> Option<FinishReason> {
        Some(match name {
            "stop" => FinishReason::Stop,
            "length" => FinishReason::Length,
            "abort" => FinishReason::Abort,
            "pooled" => FinishReason::Pooled,
            "error" => FinishReason::Error,
            "dead_end" => FinishReason::DeadEnd,
            _ => return None,
        })
    }
}

/// What the output thread learns from one applied step result (or from commands such as
/// abort and finish, with `step_id` None).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OutputEvent {
    pub step_id: Option<u64>,
    /// `[K]` sequences that accepted a token, and the tokens. A token sampled after its
    /// sequence had already finished is dropped here.
    pub seq_ids: Vec<u64>,
    pub token_ids: Vec<i64>,
    /// `[K]` which element of the step result's `sampled` each token is (accepted drafts
    /// and the token after them); empty when the step had no drafts (each sequence then
    /// has one element, found by its id as before).
    pub sample_indices: Vec<i32>,
    /// `[F]` sequences that ended, and per-sequence facts about them.
    pub finished_seq_ids: Vec<u64>,
    /// `[F]` codes into [`FINISH_REASONS`].
    pub finish_reasons: Vec<u8>,
    /// `[F]` the EOS or stop token id that ended the sequence, -1 when none did.
    pub stop_token_ids: Vec<i64>,
    pub num_prompt_tokens: Vec<i32>,
    /// Prompt tokens served from the prefix cache (or shared with a sibling sample) at the
    /// sequence's first admission.
    pub num_cached_tokens: Vec<i32>,
    pub num_output_tokens: Vec<i32>,
    pub num_preemptions: Vec<i32>,
    /// The executor's attachment to the step result this event applies (log-probabilities,
    /// pooled vectors, an error), None for command events or when it gave none.
    pub step_attachment: Option<Attachment>,
    /// Changes to the prefix cache since the previous event, when KV-cache events are on
    /// and there were any (`kv_events.rs`).
    pub kv_events: Option<KvEventLog>,
}

impl OutputEvent {
    pub fn is_empty(&self) -> bool {
        self.seq_ids.is_empty() && self.finished_seq_ids.is_empty() && self.kv_events.is_none()
    }
}
