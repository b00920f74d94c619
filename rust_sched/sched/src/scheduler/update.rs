//! Applying a step's result: sampled tokens join their sequences, stop conditions end
//! them, and sequences that ended are freed once no in-flight step references them.

use crate::block_pool::BlockId;
use crate::constraint::Advance;
use crate::error::{SchedError, SchedResult};
use crate::plan::FinishReason;
use crate::request::{SeqIndex, SeqState};

use super::{InflightStep, Scheduler};

impl Scheduler {
    /// Applies the result of the oldest in-flight step: `sampled[k]` is the token sampled
    /// for the k-th entry of that plan's `logits_indices`. A malformed result is rejected
    /// before anything changes (the scheduler thread treats one as a fatal executor bug).
    pub fn apply_result(&mut self, step_id: u64, sampled: &[i64]) -> SchedResult<()> {
        let step = self.check_result(step_id, Some(sampled))?;
        self.output.seq_ids.reserve(step.sampled.len());
        self.output.token_ids.reserve(step.sampled.len());
        // One pass over the step's sequences; `sampled` follows them in order.
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
                } else {
                    let mut complete = None;
                    // (`constrained` is in the hot bytes: unconstrained sequences never read
                    // the matcher's.)
                    let matcher = if seq.constrained { seq.matcher.as_mut() } else { None };
                    if let Some(matcher) = matcher {
                        match matcher.state.advance(token) {
                            Ok(Advance::Continue) => {}
                            Ok(Advance::Complete { eos }) => complete = Some(eos),
                            Err(_) => {
                                // Not allowed by its grammar (its mask was not applied): the
                                // token is never emitted.
                                self.counters.dead_ends += 1;
                                self.counters.discarded_tokens += 1;
                                self.end_sequence(seq_index, FinishReason::DeadEnd, None);
                                continue;
                            }
                        }
                    }
                    let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
                    seq.push_token(token);
                    self.output.seq_ids.push(seq.id);
                    self.output.token_ids.push(i64::from(token));
                    self.counters.generated_tokens += 1;
                    if let Some(eos) = complete {
                        // The grammar is complete: "stop", even at max_tokens. Ended by an
                        // end-of-sequence token, that token is the stop token (not text).
                        self.end_sequence(seq_index, FinishReason::Stop, eos.then_some(token));
                        continue;
                    }
                    let maybe_stop = self.stop_filter.may_contain(token);
                    if let Some((reason, stop_token)) = seq.check_stop(token, maybe_stop, &self.config) {
                        self.end_sequence(seq_index, reason, stop_token);
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
        Ok(())
    }

    /// The executor could not run `step_id`: every sequence in it ends with reason
    /// `error` (sequences in it that had already ended are untouched). The blocks it was to
    /// write lose their prefix-cache identity, and every sequence that reused one of them
    /// (a prefix-cache hit or a forked sibling admitted by a later plan) ends with `error`
    /// too: that KV was never written.
    pub fn fail_step(&mut self, step_id: u64) -> SchedResult<()> {
        let step = self.check_result(step_id, None)?;
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
                        && s.blocks[..s.num_shared_blocks as usize].iter().any(|b| unwritten.contains(b))
                })
            })
            .collect();
        for seq_index in readers {
            self.seq_mut(seq_index).kv_failed = true;
            self.end_sequence(seq_index, FinishReason::Error, None);
        }
        Ok(())
    }

    /// Pops the oldest in-flight step if `step_id` and the sample count match it.
    fn check_result(&mut self, step_id: u64, sampled: Option<&[i64]>) -> SchedResult<InflightStep> {
        let Some(front) = self.inflight.front() else {
            return Err(SchedError::BadStepResult(format!("no step is in flight (got step {step_id})")));
        };
        if front.step_id != step_id {
            return Err(SchedError::BadStepResult(format!(
                "results must come in plan order: expected step {}, got {step_id}",
                front.step_id
            )));
        }
        if let Some(sampled) = sampled {
            if sampled.len() != front.sampled.len() {
                return Err(SchedError::BadStepResult(format!(
                    "step {step_id} sampled {} sequences but {} tokens came back",
                    front.sampled.len(),
                    sampled.len()
                )));
            }
            if let Some(bad) = sampled.iter().find(|&&t| !(0..=u32::MAX as i64).contains(&t)) {
                return Err(SchedError::BadStepResult(format!(
                    "step {step_id}: sampled token id {bad} is out of range"
                )));
            }
        }
        self.counters.steps_applied += 1;
        Ok(self.inflight.pop_front().unwrap())
    }
}
