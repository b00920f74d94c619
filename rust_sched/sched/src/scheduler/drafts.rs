//! Drafts at planning time: which sequences may speculate, their proposals (n-gram,
//! suffix, or the executor's), and the rewind after verification. The rules are in
//! `docs/speculative_decoding.md`.

use std::time::Instant;

use crate::request::SeqIndex;
use crate::spec::{ngram, suffix, SpecMethod, EXECUTOR_LEARNING_STEPS};

use super::Scheduler;

impl Scheduler {
    /// Whether the sequence may get drafts at all: speculation is on, it samples, no
    /// grammar constrains it (drafts are not checked against grammars: see the docs), its
    /// request was not marked `no_spec`, and the adaptive rule has not turned it off.
    pub(super) fn may_speculate(&self, seq_index: SeqIndex) -> bool {
        let seq = self.seq(seq_index).expect("live sequence");
        self.config.speculates() && !seq.pooling && !seq.constrained && !seq.spec.off
    }

    /// How many drafts the executor should propose for the sequence's next step, once the
    /// sample just planned is in (0: none, it is left out of `StepPlan::propose_indices`).
    /// None unless it may draft, has room for one and is not backing off (its next step
    /// would decode plainly and drop them: a draft model's or EAGLE-3 head's forwards
    /// spent for nothing); then its room and, with the adaptive rule, what it keeps lately
    /// (`SpecRecord::executor_drafts`: one draft until it first keeps one, k while it
    /// keeps them all, then `useful_drafts`), one more when this step carries drafts and
    /// it is past its learning phase (if it keeps them all, the next step proposes one
    /// more: the rule grows by one a step at most, as a step proposes no more than it
    /// finds useful); none after the step that carries its last learning try
    /// (`SpecRecord::on_last_learning_try`: that proposal is made in the same executor
    /// call, before the verdict that most often turns it off; one that keeps its draft
    /// then decodes one step without drafts before it is proposed for). With the adaptive rule off
    /// (`spec_min_acceptance` 0) at depth 1 the back-off is not counted down, so the
    /// executor proposes every step, as the scheduler then looks every step.
    pub(super) fn executor_drafts_wanted(&self, seq_index: SeqIndex, drafted_now: usize) -> usize {
        let adaptive = self.config.spec_min_acceptance > 0.0;
        let spec = self.seq(seq_index).expect("live sequence").spec;
        if (adaptive && spec.retry_in > 0) || !self.may_speculate(seq_index) {
            return 0;
        }
        let room = self.draft_room(seq_index);
        if !adaptive {
            return room;
        }
        if drafted_now > 0 && spec.on_last_learning_try(EXECUTOR_LEARNING_STEPS) {
            return 0;
        }
        let k = self.config.num_speculative_tokens;
        let useful = spec.executor_drafts(k);
        let useful = if drafted_now > 0 && spec.kept_any() { (useful + 1).min(k) } else { useful };
        useful.min(room)
    }

    /// Room for drafts left by the sequence's limits (max_tokens, max_model_len) once its
    /// pending samples are in: each verified step also adds one token of its own.
    fn draft_room(&self, seq_index: SeqIndex) -> usize {
        let seq = self.seq(seq_index).expect("live sequence");
        let with_pending = seq.num_tokens_with_pending();
        let by_tokens =
            (seq.max_tokens as usize).saturating_sub(seq.num_output() + seq.pending_samples as usize + 1);
        let by_len = self.config.max_model_len.saturating_sub(with_pending + 1);
        by_tokens.min(by_len).min(self.config.num_speculative_tokens)
    }

    /// A speculating sequence whose previous token is not known yet is not planned with
    /// a placeholder: it waits for that result, and is then planned with drafts. After a
    /// proposal that found none, or kept none, it decodes behind placeholders for a while
    /// first (`spec::backoff_steps`).
    pub(super) fn waits_for_result(&mut self, seq_index: SeqIndex) -> bool {
        let seq = self.seq(seq_index).expect("live sequence");
        if seq.pending_samples == 0 || !self.may_speculate(seq_index) || self.draft_room(seq_index) == 0 {
            return false;
        }
        let spec = &mut self.seq_mut(seq_index).spec;
        if spec.retry_in > 0 {
            spec.retry_in -= 1;
            return false;
        }
        true
    }

    /// Proposes at most `max_d` drafts for a decoding sequence into `draft_buf` (cleared
    /// first); returns how many.
    pub(super) fn propose(&mut self, seq_index: SeqIndex, max_d: usize) -> usize {
        self.draft_buf.clear();
        let seq = self.seq(seq_index).expect("live sequence");
        // Only a sequence whose next input is its last known token (no sample pending).
        if seq.pending_samples > 0 || seq.computed() + 1 != seq.num_tokens() || seq.num_output() == 0 {
            return 0;
        }
        // The adaptive rule (off with spec_min_acceptance = 0, which looks every step it
        // can) backs off after failed proposals here too (at depth 1; at depth 2
        // `waits_for_result` counts these steps down) and proposes only what is kept.
        let adaptive = self.config.spec_min_acceptance > 0.0;
        if adaptive && seq.spec.retry_in > 0 {
            self.seq_mut(seq_index).spec.retry_in -= 1;
            return 0;
        }
        let k_max = self.config.num_speculative_tokens;
        let useful = match (adaptive, self.config.speculative_method) {
            (false, _) => k_max,
            // (no more than the executor was asked for in the learning phase, should it send more)
            (true, SpecMethod::Executor) => seq.spec.executor_drafts(k_max),
            (true, _) => seq.spec.useful_drafts(k_max),
        };
        let k = max_d.min(self.draft_room(seq_index)).min(useful);
        // (an executor proposer's sequence not asked for drafts last step has none, and
        // that says nothing of its proposer: see `executor_drafts_wanted`)
        if k == 0 || (self.config.speculative_method == SpecMethod::Executor && !seq.spec.drafts_asked) {
            return 0;
        }
        let started = Instant::now();
        let (min_n, max_n) = (self.config.prompt_lookup_min, self.config.prompt_lookup_max);
        let min_rate = self.config.spec_min_acceptance;
        let mut buf = std::mem::take(&mut self.draft_buf);
        let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
        match self.config.speculative_method {
            SpecMethod::None => {}
            SpecMethod::Ngram => {
                ngram::propose(seq.known_tokens(), min_n, max_n, k, &mut buf);
            }
            SpecMethod::Suffix => {
                let cache = self.suffix_cache.as_ref().expect("a suffix cache with method suffix");
                suffix::propose(seq.known_tokens(), cache, min_n, max_n, k, &mut buf);
            }
            SpecMethod::Executor => {
                let take = k.min(seq.next_drafts.len());
                buf.extend_from_slice(&seq.next_drafts[..take]);
            }
        }
        self.spec_stats.proposals += 1;
        self.spec_stats.propose_ns += started.elapsed().as_nanos() as u64;
        let d = buf.len();
        if d == 0 {
            seq.spec.record_empty(min_rate);
            self.spec_stats.empty_proposals += 1;
        }
        self.draft_buf = buf;
        d
    }

    /// Keeps a finished sequence's output for the suffix proposer.
    pub(super) fn remember_output(&mut self, seq_index: SeqIndex) {
        let Some(cache) = self.suffix_cache.as_mut() else {
            return;
        };
        let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
        if seq.pooling {
            return;
        }
        let prompt = seq.prompt_len();
        let tokens = seq.known_tokens();
        cache.insert(&tokens[..prompt], &tokens[prompt..]);
    }

    /// After verification: a running sequence that computed `d` drafts of which `a` were
    /// accepted keeps the KV of its last committed token and the accepted drafts only;
    /// blocks held only for rejected positions go back to the pool (they were fresh: a
    /// block is offered to the prefix cache only once all its tokens are committed).
    pub(super) fn rewind(&mut self, seq_index: SeqIndex, d: usize, a: usize) {
        let bs = self.config.block_size;
        let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
        seq.num_computed -= (d - a) as u32;
        let keep = seq.computed().div_ceil(bs);
        if seq.blocks.len() > keep {
            let extra = seq.blocks.split_off(keep);
            seq.tail_block = *seq.blocks.last().expect("a running sequence holds a block");
            self.pool.release(&extra);
            for table in &mut seq.extra {
                let extra = table.blocks.split_off(keep);
                self.pool.release(&extra);
            }
        }
    }
}
