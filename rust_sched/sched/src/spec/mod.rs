//! Speculative decoding, the scheduler's half: which method proposes drafts, the
//! proposers that need no model (n-gram prompt lookup, suffix), and the adaptive rule
//! that stops proposing for a sequence whose drafts are rarely accepted.
//! `docs/speculative_decoding.md` describes how drafts are planned, reserved and rewound.

pub mod ngram;
pub mod suffix;

use crate::error::{SchedError, SchedResult};

/// Where drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecMethod {
    /// No speculation.
    None,
    /// N-gram prompt lookup in the sequence's own tokens (`ngram.rs`).
    Ngram,
    /// The sequence's own tokens and recently finished outputs (`suffix.rs`).
    Suffix,
    /// The executor proposes them with each step's result (a draft model, EAGLE-3).
    Executor,
}

impl SpecMethod {
    pub fn parse(name: &str) -> SchedResult<Self> {
        Ok(match name {
            "none" => SpecMethod::None,
            "ngram" => SpecMethod::Ngram,
            "suffix" => SpecMethod::Suffix,
            "executor" => SpecMethod::Executor,
            other => {
                return Err(SchedError::InvalidConfig(format!(
                    "speculative_method must be 'none', 'ngram', 'suffix' or 'executor', got {other:?}"
                )))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            SpecMethod::None => "none",
            SpecMethod::Ngram => "ngram",
            SpecMethod::Suffix => "suffix",
            SpecMethod::Executor => "executor",
        }
    }
}

/// Most drafts per sequence and step the scheduler accepts as `num_speculative_tokens`.
pub const MAX_SPECULATIVE_TOKENS: usize = 32;

/// Drafts a sequence must have had verified before the adaptive rule judges it by its rate.
pub const ADAPTIVE_WARMUP_DRAFTS: u32 = 16;

/// Verified steps in a row that kept no draft after which a sequence stops proposing for
/// good, whatever its rate (its drafts keep failing: each such step cost a verification
/// and, at pipeline depth 2, a step without the overlap).
pub const MAX_FAILED_STEPS: u8 = 4;

/// For drafts the executor proposes (a draft model, an EAGLE-3 head): a sequence whose
/// first this many verified steps keep nothing stops proposing for good, and it does not
/// back off between them. Each such step costs model forwards (the proposals, and the
/// proposer keeping its cache up for as long as the sequence may draft) and, at pipeline
/// depth 2, a step without the overlap, far more than a prompt lookup; a proposer that
/// keeps nothing of its first two tries is almost surely wrong for this sequence
/// (a useful head or draft keeps its first draft most of the time), and backing off
/// between the tries would only stretch the time its cache is kept up for nothing.
pub const EXECUTOR_LEARNING_STEPS: u8 = 2;

/// Drafts the executor proposes per try while a sequence is in its learning phase (never
/// kept a draft, see [`EXECUTOR_LEARNING_STEPS`]): one, so a fruitless try costs one
/// proposer forward and a verification of 2 tokens, not `k` forwards and `k + 1` tokens.
/// See [`SpecRecord::executor_drafts`] for what follows.
pub const EXECUTOR_LEARNING_DRAFTS: usize = 1;

/// For the scheduler's own proposers (n-gram, suffix): a sequence the adaptive rule turns
/// off is paused instead, for this many steps after its first turn-off, doubling with each
/// later one up to [`MAX_PAUSE`]; then it probes: it proposes again with a fresh record,
/// and a probe's verified step that keeps nothing pauses it again. Their lookups cost
/// microseconds and keep no cache, so a sequence whose output turns to repeating its
/// context later (an agent loop re-emitting a file it read) gets its drafts back, where
/// a sequence turned off for good would not. An executor proposer's sequence stays off
/// (its draft model or head would have to keep its cache up the whole time).
pub const PAUSE_STEPS: u16 = 256;
const MAX_PAUSE: u16 = 4096;

pub fn pause_steps(pauses: u8) -> u16 {
    let shift = u32::from(pauses.saturating_sub(1)).min(4);
    (PAUSE_STEPS << shift).min(MAX_PAUSE)
}

/// A sequence's running record of its drafts, for the adaptive rule.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpecRecord {
    /// Drafts verified and accepted, and drafted steps (exponentially weighted counts:
    /// see `record`).
    pub drafted: f32,
    pub accepted: f32,
    pub steps: f32,
    /// Drafts verified in all (not weighted), for the warm-up.
    pub seen: u32,
    /// No drafts for this sequence: the adaptive rule turned speculation off, or its
    /// request came with `no_spec`.
    pub off: bool,
    /// Proposals in a row that found nothing or kept nothing (reset by an accepted
    /// draft): each one doubles the back-off below.
    pub failures: u8,
    /// Verified steps in a row that kept no draft (see [`MAX_FAILED_STEPS`]).
    pub failed_steps: u8,
    /// Whether any of its drafts was ever rejected (see [`SpecRecord::executor_drafts`]).
    pub lost_any: bool,
    /// Steps left before the sequence looks for drafts again: it decodes plainly (behind
    /// placeholders at depth 2, keeping the overlap) meanwhile (see [`backoff_steps`],
    /// and [`pause_steps`] after a pause).
    pub retry_in: u16,
    /// Times it was paused ([`SpecRecord::pause`]).
    pub pauses: u8,
    /// Paused before and has kept no draft since: a verified step that keeps nothing
    /// pauses it again (`Verdict::OffFailing`, which the scheduler turns into a pause).
    pub probing: bool,
    /// An executor proposer's sequence: whether its last planned step asked the executor
    /// for drafts (`StepPlan::propose_indices`). One not asked finds none without that
    /// counting as an empty proposal (no back-off).
    pub drafts_asked: bool,
}

/// After a proposal that found no draft or whose drafts were all rejected, the sequence
/// decodes this many steps plainly before it looks again: 4 after the first failure,
/// doubling with each failure in a row, at most 64.
pub const RETRY_AFTER_EMPTY: u8 = 4;
const MAX_BACKOFF: u8 = 64;

pub fn backoff_steps(failures: u8) -> u8 {
    let shift = u32::from(failures.saturating_sub(1)).min(4);
    (RETRY_AFTER_EMPTY << shift).min(MAX_BACKOFF)
}

/// Weight kept of the past at each verified step: the rate follows the last ~10 steps.
const DECAY: f32 = 0.9;

/// What the adaptive rule decided after a verified step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Go on proposing.
    Keep,
    /// Nothing was kept: decode plainly for a while before proposing again.
    BackOff,
    /// Turned off for good: the rate fell below the minimum after the warm-up.
    OffLowRate,
    /// Turned off for good: [`MAX_FAILED_STEPS`] steps in a row kept nothing.
    OffFailing,
    /// Turned off for good: its first `learning_steps` verified steps kept nothing
    /// ([`EXECUTOR_LEARNING_STEPS`]).
    OffLearning,
}

impl SpecRecord {
    /// Records one verified step (`d` drafts, `a` accepted) and applies the rule. A
    /// `min_rate` of 0 turns nothing off and never backs off after rejected drafts.
    /// `learning_steps` (0: none; [`EXECUTOR_LEARNING_STEPS`] for the executor's
    /// proposers): until a draft is first kept, a step that keeps nothing does not back
    /// off, and the `learning_steps`-th such step turns the sequence off.
    pub fn record(&mut self, d: usize, a: usize, min_rate: f64, learning_steps: u8) -> Verdict {
        if d == 0 || self.off {
            return Verdict::Keep;
        }
        self.drafted = self.drafted * DECAY + d as f32;
        self.accepted = self.accepted * DECAY + a as f32;
        self.steps = self.steps * DECAY + 1.0;
        self.seen = self.seen.saturating_add(d as u32);
        if min_rate <= 0.0 {
            return Verdict::Keep;
        }
        if a > 0 {
            self.failures = 0;
            self.failed_steps = 0;
            self.lost_any |= a < d;
            self.probing = false;
        } else if self.probing {
            self.off = true;
            return Verdict::OffFailing;
        } else {
            self.lost_any = true;
            self.failures = self.failures.saturating_add(1);
            self.failed_steps = self.failed_steps.saturating_add(1);
            if learning_steps > 0 && !self.kept_any() {
                if self.failed_steps >= learning_steps {
                    self.off = true;
                    return Verdict::OffLearning;
                }
                return Verdict::Keep;
            }
        }
        if self.seen >= ADAPTIVE_WARMUP_DRAFTS && f64::from(self.accepted / self.drafted) < min_rate {
            self.off = true;
            return Verdict::OffLowRate;
        }
        if self.failed_steps >= MAX_FAILED_STEPS {
            self.off = true;
            return Verdict::OffFailing;
        }
        if a == 0 {
            self.retry_in = backoff_steps(self.failures).into();
            return Verdict::BackOff;
        }
        Verdict::Keep
    }

    /// Instead of off for good (a scheduler proposer's sequence, see [`PAUSE_STEPS`]): a
    /// fresh record that waits [`pause_steps`] steps, then probes.
    pub fn pause(&mut self) {
        let pauses = self.pauses.saturating_add(1);
        *self = SpecRecord { pauses, retry_in: pause_steps(pauses), probing: true, ..SpecRecord::default() };
    }

    /// Whether any of its drafts was ever accepted (see [`EXECUTOR_LEARNING_STEPS`]): the
    /// weighted count is 0 exactly until one is, and cannot decay back to 0 (a sequence is
    /// turned off after [`MAX_FAILED_STEPS`] steps in a row without one, long before 0.9^n
    /// underflows).
    pub fn kept_any(&self) -> bool {
        self.accepted > 0.0
    }

    /// A lookup found nothing: back off before looking again (by [`RETRY_AFTER_EMPTY`]
    /// steps, not growing, when the adaptive rule is off: `min_rate` 0).
    pub fn record_empty(&mut self, min_rate: f64) {
        if min_rate <= 0.0 {
            self.retry_in = RETRY_AFTER_EMPTY.into();
            return;
        }
        self.failures = self.failures.saturating_add(1);
        self.retry_in = backoff_steps(self.failures).into();
    }

    /// Whether a verified step that keeps nothing now turns the sequence off (its last
    /// try of `learning_steps`, see [`EXECUTOR_LEARNING_STEPS`]): drafts proposed after
    /// that step would most likely be dropped with the sequence.
    pub fn on_last_learning_try(&self, learning_steps: u8) -> bool {
        learning_steps > 0 && !self.kept_any() && self.failed_steps.saturating_add(1) >= learning_steps
    }

    /// Drafts worth proposing next for an executor proposer's sequence, at most `k`:
    /// [`EXECUTOR_LEARNING_DRAFTS`] until it first keeps a draft, then `k` for as long as
    /// it has kept every draft it verified (its one-draft tries say only that it keeps at
    /// least one: counted by [`Self::useful_drafts`] they would start it at 2 and ramp it
    /// up a step at a time), then [`Self::useful_drafts`].
    pub fn executor_drafts(&self, k: usize) -> usize {
        if !self.kept_any() {
            EXECUTOR_LEARNING_DRAFTS.min(k)
        } else if !self.lost_any {
            k
        } else {
            self.useful_drafts(k)
        }
    }

    /// Drafts worth proposing next, at most `k`: one more than the accepted drafts per
    /// drafted step lately (rounded up), so a sequence that keeps only the first draft or
    /// two verifies two or three entries, not `k + 1`; a step that keeps all its drafts
    /// lets the next one propose one more.
    pub fn useful_drafts(&self, k: usize) -> usize {
        if self.steps <= 0.0 {
            return k;
        }
        // (less a hair, so that a steady 1 accepted a step reads as 1, not 1.0000001)
        let per_step = (self.accepted / self.steps - 1e-3).ceil().max(0.0) as usize;
        (per_step + 1).clamp(1, k.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_parse_by_name() {
        for m in [SpecMethod::None, SpecMethod::Ngram, SpecMethod::Suffix, SpecMethod::Executor] {
            assert_eq!(SpecMethod::parse(m.name()).unwrap(), m);
        }
        assert!(SpecMethod::parse("eagle").is_err());
    }

    #[test]
    fn adaptive_rule_waits_for_the_warmup_then_turns_off_a_poor_sequence() {
        let mut r = SpecRecord::default();
        r.record(4, 1, 0.2, 0);
        r.record(4, 1, 0.2, 0);
        r.record(4, 0, 0.2, 0);
        assert!(!r.off, "still warming up (12 drafts)");
        assert_eq!(r.record(4, 0, 0.2, 0), Verdict::OffLowRate, "2 of 16 kept");
        assert!(r.off);
        assert_eq!(r.record(4, 4, 0.2, 0), Verdict::Keep, "off stays off");
        assert!(r.off);
        let mut good = SpecRecord::default();
        for _ in 0..100 {
            assert_eq!(good.record(4, 2, 0.2, 0), Verdict::Keep);
        }
        assert!(!good.off);
        // A rate of 0 turns nothing off and never backs off.
        let mut any = SpecRecord::default();
        for _ in 0..100 {
            assert_eq!(any.record(4, 0, 0.0, 0), Verdict::Keep);
        }
        assert_eq!(any.retry_in, 0);
    }

    #[test]
    fn failing_drafts_back_off_longer_each_time_then_stop() {
        let mut r = SpecRecord::default();
        assert_eq!(r.record(1, 0, 0.05, 0), Verdict::BackOff);
        assert_eq!(r.retry_in, 4);
        r.record_empty(0.05);
        assert_eq!(r.retry_in, 8, "an empty lookup is a failure too");
        assert_eq!(r.record(1, 0, 0.05, 0), Verdict::BackOff);
        assert_eq!(r.retry_in, 16);
        assert_eq!(r.record(1, 1, 0.05, 0), Verdict::Keep, "an accepted draft resets the back-off");
        assert_eq!(r.failures, 0);
        for _ in 0..MAX_FAILED_STEPS - 1 {
            assert_eq!(r.record(1, 0, 0.05, 0), Verdict::BackOff);
        }
        assert_eq!(r.record(1, 0, 0.05, 0), Verdict::OffFailing, "before the warm-up of 16 drafts");
        assert_eq!(backoff_steps(200), 64);
    }

    #[test]
    fn a_paused_sequence_probes_after_a_doubling_wait_and_a_kept_draft_resumes_it() {
        let mut r = SpecRecord::default();
        for _ in 0..MAX_FAILED_STEPS - 1 {
            r.record(2, 0, 0.1, 0);
        }
        assert_eq!(r.record(2, 0, 0.1, 0), Verdict::OffFailing);
        r.pause();
        assert!(!r.off && r.probing);
        assert_eq!((r.retry_in, r.pauses, r.seen, r.failed_steps), (PAUSE_STEPS, 1, 0, 0), "a fresh record");
        // A probe that keeps nothing: off again at once, and the next pause is twice as long.
        assert_eq!(r.record(2, 0, 0.1, 0), Verdict::OffFailing);
        r.pause();
        assert_eq!(r.retry_in, 2 * PAUSE_STEPS);
        // A probe that keeps a draft: the ordinary rule again (back-offs, not a pause).
        assert_eq!(r.record(2, 1, 0.1, 0), Verdict::Keep);
        assert!(!r.probing);
        assert_eq!(r.record(2, 0, 0.1, 0), Verdict::BackOff);
        assert_eq!(r.pauses, 2);
        assert_eq!((pause_steps(3), pause_steps(5), pause_steps(200)), (4 * PAUSE_STEPS, 4096, 4096));
    }

    #[test]
    fn an_executor_proposer_that_never_kept_a_draft_stops_after_its_learning_steps() {
        let mut r = SpecRecord::default();
        let n = EXECUTOR_LEARNING_STEPS;
        for _ in 1..n {
            assert_eq!(r.record(4, 0, 0.1, n), Verdict::Keep, "no back-off while learning");
            assert_eq!(r.retry_in, 0);
        }
        assert_eq!(r.record(2, 0, 0.1, n), Verdict::OffLearning);
        assert!(r.off);
        // Once a draft was kept, the usual rule: back off, and off after MAX_FAILED_STEPS.
        let mut kept = SpecRecord::default();
        assert_eq!(kept.record(4, 0, 0.1, n), Verdict::Keep);
        assert_eq!(kept.record(4, 1, 0.1, n), Verdict::Keep);
        assert_eq!(kept.record(2, 0, 0.1, n), Verdict::BackOff);
        assert_eq!(kept.retry_in, 4);
        assert!(!kept.off);
        // The adaptive rule off (min_rate 0): nothing is turned off.
        let mut any = SpecRecord::default();
        for _ in 0..10 {
            assert_eq!(any.record(4, 0, 0.0, n), Verdict::Keep);
        }
        assert!(!any.off);
    }

    #[test]
    fn executor_drafts_are_one_while_learning_then_k_until_one_is_lost() {
        let n = EXECUTOR_LEARNING_STEPS;
        let mut r = SpecRecord::default();
        assert_eq!(r.executor_drafts(4), EXECUTOR_LEARNING_DRAFTS, "nothing kept yet");
        assert_eq!(EXECUTOR_LEARNING_DRAFTS, 1);
        r.record(1, 1, 0.1, n);
        assert_eq!(r.executor_drafts(4), 4, "every draft kept: k");
        r.record(4, 4, 0.1, n);
        assert_eq!(r.executor_drafts(4), 4);
        r.record(4, 1, 0.1, n);
        assert_eq!(r.executor_drafts(4), r.useful_drafts(4), "one lost: the adaptive rule");
        assert!(r.useful_drafts(4) < 4);
        // A first try that keeps nothing, then one that keeps: the adaptive rule at once.
        let mut late = SpecRecord::default();
        late.record(1, 0, 0.1, n);
        assert_eq!(late.executor_drafts(4), 1, "still learning");
        late.record(1, 1, 0.1, n);
        assert_eq!(late.executor_drafts(4), 2, "kept 1 of 2 steps: two");
    }

    #[test]
    fn useful_drafts_follow_what_is_accepted() {
        let mut r = SpecRecord::default();
        assert_eq!(r.useful_drafts(4), 4, "no record yet: k");
        for _ in 0..30 {
            r.record(4, 4, 0.1, 0);
        }
        assert_eq!(r.useful_drafts(4), 4);
        let mut poor = SpecRecord::default();
        for _ in 0..30 {
            poor.record(2, 1, 0.1, 0);
        }
        assert_eq!(poor.useful_drafts(4), 2, "keeps one a step: proposes two");
        poor.record(2, 2, 0.1, 0);
        assert_eq!(poor.useful_drafts(4), 3, "kept all: one more");
    }
}
