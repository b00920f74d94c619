//! Applying a step's result: sampled tokens join their sequences, stop conditions end
//! them, and sequences that ended are freed once no in-flight step references them.

use crate::block_pool::BlockId;
use crate::constraint::Advance;
use crate::error::{SchedError, SchedResult};
use crate::plan::FinishReason;
use crate::request::{SeqIndex, SeqState};
use crate::spec::{SpecMethod, Verdict, EXECUTOR_LEARNING_STEPS};

use super::{InflightStep, Scheduler};

/// What the executor sends back for one step beyond its sampled tokens, when the step
/// had drafts or the executor proposes them (`docs/speculative_decoding.md`).
#[derive(Debug, Clone, Copy, Default)]
pub struct SpecResult<'a> {
    /// `[S]` drafts accepted per sampled sequence; None when the plan had no drafts.
    pub num_accepted: Option<&'a [i32]>,
    /// `[S]` counts and the flat tokens of drafts for each sampled sequence's next step
    /// (method "executor"; ignored for the others).
    pub next_drafts: Option<(&'a [i32], &'a [i64])>,
}

impl Scheduler {
    /// Applies the result of the oldest in-flight step: `sampled[k]` is the token sampled
    /// for the k-th entry of that plan's `logits_indices`. A malformed result is rejected
    /// before anything changes (the scheduler thread treats one as a fatal executor bug).
    pub fn apply_result(&mut self, step_id: u64, sampled: &[i64]) -> SchedResult<()> {
        self.apply_spec_result(step_id, sampled, SpecResult::default())
    }

    /// [`apply_result`](Self::apply_result) for a step that may have had drafts: per
    /// sampled sequence, `sampled` holds its accepted drafts and then one more token. The
    /// tokens join their sequence one at a time, each checked for a stop; what follows a
    /// stop is dropped.
    pub fn apply_spec_result(
        &mut self,
        step_id: u64,
        sampled: &[i64],
        spec: SpecResult<'_>,
    ) -> SchedResult<()> {
        let step = self.check_result(step_id, sampled, spec)?;
        self.output.seq_ids.reserve(sampled.len());
        self.output.token_ids.reserve(sampled.len());
        let with_drafts = !step.draft_counts.is_empty();
        // Drafts from the executor hold for one step: every result replaces them.
        let executor_drafts = self.config.speculative_method == SpecMethod::Executor;
        if !with_drafts && !executor_drafts {
            self.apply_plain(&step, sampled);
            return Ok(());
        }
        let next_drafts = spec.next_drafts.filter(|_| executor_drafts);
        let mut next_draft_at = 0;
        // One pass over the step's sequences; `sampled` follows them in order.
        let mut next_sample = 0;
        let mut next_token = 0;
        let mut draft_at = 0;
        for &seq_index in &step.scheduled {
            let samples_here = step.sampled.get(next_sample) == Some(&seq_index);
            let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
            seq.inflight_steps -= 1;
            if samples_here {
                let k = next_sample;
                next_sample += 1;
                seq.pending_samples -= 1;
                let d = step.draft_counts.get(k).map_or(0, |&d| d as usize);
                let a = spec.num_accepted.map_or(0, |acc| acc[k] as usize);
                let first = next_token;
                next_token += a + 1;
                draft_at += d;
                if executor_drafts {
                    seq.next_drafts.clear();
                }
                if let Some((counts, tokens)) = next_drafts {
                    let c = counts[k] as usize;
                    seq.next_drafts
                        .extend(tokens[next_draft_at..next_draft_at + c].iter().map(|&t| t as u32));
                    next_draft_at += c;
                }
                if d > 0 {
                    self.record_drafts(seq_index, d, a);
                }
                let seq = self.seq(seq_index).expect("live sequence");
                if seq.state == SeqState::Finished {
                    // Planned before its sequence was seen to finish: the tokens are dropped.
                    self.counters.discarded_tokens += (a + 1) as u64;
                } else {
                    if d > 0 && seq.state == SeqState::Running {
                        self.rewind(seq_index, d, a);
                    }
                    let ended =
                        self.append_tokens(seq_index, &sampled[first..first + a + 1], first, with_drafts);
                    if ended {
                        continue; // end_sequence released what was left to release
                    }
                }
            } else if seq.pooling && seq.state != SeqState::Finished {
                self.end_sequence(seq_index, FinishReason::Pooled, None);
                continue;
            }
            let seq = self.seq(seq_index).expect("live sequence");
            if seq.state == SeqState::Finished && seq.inflight_steps == 0 {
                self.release_if_idle(seq_index);
            }
        }
        debug_assert_eq!(draft_at, step.drafts.len());
        Ok(())
    }

    /// The loop of a step without drafts: one token per sampled sequence (the steady
    /// decode step's path, kept free of the speculative bookkeeping).
    fn apply_plain(&mut self, step: &InflightStep, sampled: &[i64]) {
        let mut next_sample = 0;
        for &seq_index in &step.scheduled {
            let samples_here = step.sampled.get(next_sample) == Some(&seq_index);
            let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
            seq.inflight_steps -= 1;
            if samples_here {
                let token = sampled[next_sample] as u32;
                next_sample += 1;
                seq.pending_samples -= 1;
                if seq.state == SeqState::Finished {
                    // Planned before its sequence was seen to finish: the extra token is dropped.
                    self.counters.discarded_tokens += 1;
                } else if self.push_sampled(seq_index, token, None, 0) {
                    continue; // end_sequence released what was left to release
                }
            } else if seq.pooling && seq.state != SeqState::Finished {
                self.end_sequence(seq_index, FinishReason::Pooled, None);
                continue;
            }
            let seq = self.seq(seq_index).expect("live sequence");
            if seq.state == SeqState::Finished && seq.inflight_steps == 0 {
                self.release_if_idle(seq_index);
            }
        }
    }

    /// Counts a verified sequence-step and applies the adaptive rule.
    fn record_drafts(&mut self, seq_index: SeqIndex, d: usize, a: usize) {
        let stats = &mut self.spec_stats;
        stats.drafts += 1;
        stats.draft_tokens += d as u64;
        stats.accepted_tokens += a as u64;
        for count in &mut stats.accepted_per_position[..a] {
            *count += 1;
        }
        let min_rate = self.config.spec_min_acceptance;
        let executor = self.config.speculative_method == SpecMethod::Executor;
        let learning = if executor { EXECUTOR_LEARNING_STEPS } else { 0 };
        let verdict = self.seq_mut(seq_index).spec.record(d, a, min_rate, learning);
        if !executor && matches!(verdict, Verdict::OffLowRate | Verdict::OffFailing) {
            // The scheduler's own lookups: a pause, then a probe (`spec::PAUSE_STEPS`).
            self.seq_mut(seq_index).spec.pause();
            self.spec_stats.pauses += 1;
        }
        match verdict {
            Verdict::Keep => {}
            Verdict::BackOff => self.spec_stats.backoffs += 1,
            Verdict::OffLowRate => {
                self.spec_stats.disabled_sequences += 1;
                self.spec_stats.disabled_low_rate += 1;
            }
            Verdict::OffFailing => {
                self.spec_stats.disabled_sequences += 1;
                self.spec_stats.disabled_failing += 1;
            }
            Verdict::OffLearning => {
                self.spec_stats.disabled_sequences += 1;
                self.spec_stats.disabled_learning += 1;
            }
        }
    }

    /// Appends one sequence's tokens of a step in order, each checked for a stop; the
    /// tokens after a stop are dropped. `first` is the first token's index in the step's
    /// `sampled` (recorded in the event when the step had drafts). Returns whether the
    /// sequence ended.
    fn append_tokens(
        &mut self,
        seq_index: SeqIndex,
        tokens: &[i64],
        first: usize,
        record_indices: bool,
    ) -> bool {
        for (j, &token) in tokens.iter().enumerate() {
            let dropped = (tokens.len() - 1 - j) as u64;
            let index = record_indices.then_some((first + j) as i32);
            if self.push_sampled(seq_index, token as u32, index, dropped) {
                return true;
            }
        }
        false
    }

    /// One sampled token joins its sequence: the grammar's matcher advances, the token is
    /// pushed and emitted (with `sample_index`, its element of the step's `sampled`, when
    /// the step had drafts), then every stop check. Returns whether the sequence ended;
    /// `dropped` tokens of the step after this one are then counted discarded. Both
    /// result loops (without drafts and with) share it; inlined, the plain loop's
    /// constant arguments fold away.
    #[inline(always)]
    fn push_sampled(
        &mut self,
        seq_index: SeqIndex,
        token: u32,
        sample_index: Option<i32>,
        dropped: u64,
    ) -> bool {
        let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
        let mut complete = None;
        // (`constrained` is in the hot bytes: unconstrained sequences never read the
        // matcher's.)
        let matcher = if seq.constrained { seq.matcher.as_mut() } else { None };
        if let Some(matcher) = matcher {
            match matcher.state.advance(token) {
                Ok(Advance::Continue) => {}
                Ok(Advance::Complete { eos }) => complete = Some(eos),
                Err(_) => {
                    // Not allowed by its grammar (its mask was not applied): the token is
                    // never emitted.
                    self.counters.dead_ends += 1;
                    self.counters.discarded_tokens += 1 + dropped;
                    self.end_sequence(seq_index, FinishReason::DeadEnd, None);
                    return true;
                }
            }
        }
        let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
        seq.push_token(token);
        self.output.seq_ids.push(seq.id);
        self.output.token_ids.push(i64::from(token));
        if let Some(index) = sample_index {
            self.output.sample_indices.push(index);
        }
        self.counters.generated_tokens += 1;
        if let Some(eos) = complete {
            // The grammar is complete: "stop", even at max_tokens. Ended by an
            // end-of-sequence token, that token is the stop token (not text).
            self.counters.discarded_tokens += dropped;
            self.end_sequence(seq_index, FinishReason::Stop, eos.then_some(token));
            return true;
        }
        let maybe_stop = self.stop_filter.may_contain(token);
        if let Some((reason, stop_token)) = seq.check_stop(token, maybe_stop, &self.config) {
            self.counters.discarded_tokens += dropped;
            self.end_sequence(seq_index, reason, stop_token);
            return true;
        }
        false
    }

    /// The executor could not run `step_id`: every sequence in it ends with reason
    /// `error` (sequences in it that had already ended are untouched). The blocks it was to
    /// write lose their prefix-cache identity, and every sequence that reused one of them
    /// (a prefix-cache hit or a forked sibling admitted by a later plan) ends with `error`
    /// too: that KV was never written.
    pub fn fail_step(&mut self, step_id: u64) -> SchedResult<()> {
        self.check_front(step_id)?;
        self.counters.steps_applied += 1;
        let step = self.inflight.pop_front().unwrap();
        let unwritten: std::collections::HashSet<BlockId> = step.written.iter().copied().collect();
        for &block in &unwritten {
            self.pool.forget(block);
        }
        for &seq_index in &step.sampled {
            self.seq_mut(seq_index).pending_samples -= 1;
        }
        for &seq_index in &step.scheduled {
            let seq = self.seq_mut(seq_index);
            seq.inflight_steps -= 1;
            seq.kv_failed = true;
            if seq.state == SeqState::Finished {
                self.release_if_idle(seq_index);
            } else {
                self.end_sequence(seq_index, FinishReason::Error, None);
            }
        }
        let readers: Vec<SeqIndex> = (0..self.seqs.len() as SeqIndex)
            .filter(|&seq_index| {
                self.seq(seq_index).is_some_and(|s| {
                    s.state != SeqState::Finished
                        && std::iter::once(&s.blocks)
                            .chain(s.extra.iter().map(|t| &t.blocks))
                            .any(|b| b[..s.num_shared_blocks as usize].iter().any(|b| unwritten.contains(b)))
                })
            })
            .collect();
        for seq_index in readers {
            self.seq_mut(seq_index).kv_failed = true;
            self.end_sequence(seq_index, FinishReason::Error, None);
        }
        Ok(())
    }

    /// Pops the oldest in-flight step if `step_id` and the sample counts match it.
    fn check_result(
        &mut self,
        step_id: u64,
        sampled: &[i64],
        spec: SpecResult<'_>,
    ) -> SchedResult<InflightStep> {
        let front = self.check_front(step_id)?;
        let bad = |m: String| Err(SchedError::BadStepResult(format!("step {step_id}: {m}")));
        let num_seqs = front.sampled.len();
        let accepted_total = match spec.num_accepted {
            None if !front.draft_counts.is_empty() => {
                return bad("the plan had drafts but the result gives no num_accepted".into())
            }
            None => 0,
            Some(acc) => {
                if acc.len() != num_seqs {
                    return bad(format!(
                        "num_accepted has {} entries for {num_seqs} sampled sequences",
                        acc.len()
                    ));
                }
                let mut total = 0;
                for (k, &a) in acc.iter().enumerate() {
                    let d = front.draft_counts.get(k).map_or(0, |&d| d as i64);
                    if !(0..=d).contains(&i64::from(a)) {
                        return bad(format!("sequence {k} accepted {a} of its {d} drafts"));
                    }
                    total += a as usize;
                }
                total
            }
        };
        if sampled.len() != num_seqs + accepted_total {
            return bad(format!(
                "{num_seqs} sequences sampled with {accepted_total} drafts accepted, but {} tokens came back",
                sampled.len()
            ));
        }
        if let Some(bad_id) = sampled.iter().find(|&&t| !(0..=u32::MAX as i64).contains(&t)) {
            return bad(format!("sampled token id {bad_id} is out of range"));
        }
        if let Some(acc) = spec.num_accepted {
            // The accepted drafts come back as planned.
            let (mut at, mut draft_at) = (0, 0);
            for (k, &a) in acc.iter().enumerate() {
                let d = front.draft_counts.get(k).map_or(0, |&d| d as usize);
                let a = a as usize;
                let planned = &front.drafts[draft_at..draft_at + a];
                if sampled[at..at + a].iter().zip(planned).any(|(&t, &p)| t != i64::from(p)) {
                    return bad(format!(
                        "sequence {k}'s accepted tokens are not the drafts it was planned with"
                    ));
                }
                at += a + 1;
                draft_at += d;
            }
        }
        if let Some((counts, tokens)) = spec.next_drafts {
            if counts.len() != num_seqs {
                return bad(format!(
                    "next_drafts has {} counts for {num_seqs} sampled sequences",
                    counts.len()
                ));
            }
            if counts.iter().any(|&c| c < 0)
                || counts.iter().map(|&c| c as usize).sum::<usize>() != tokens.len()
            {
                return bad(format!("next_drafts' counts do not add up to its {} tokens", tokens.len()));
            }
            if let Some(t) = tokens.iter().find(|&&t| !(0..=u32::MAX as i64).contains(&t)) {
                return bad(format!("draft token id {t} is out of range"));
            }
        }
        self.counters.steps_applied += 1;
        Ok(self.inflight.pop_front().unwrap())
    }

    /// The oldest in-flight step, if it is `step_id`.
    fn check_front(&self, step_id: u64) -> SchedResult<&InflightStep> {
        let Some(front) = self.inflight.front() else {
            return Err(SchedError::BadStepResult(format!("no step is in flight (got step {step_id})")));
        };
        if front.step_id != step_id {
            return Err(SchedError::BadStepResult(format!(
                "results must come in plan order: expected step {}, got {step_id}",
                front.step_id
            )));
        }
        Ok(front)
    }
}
