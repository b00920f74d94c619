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

/// Drafts a sequence must have had verified before the adaptive rule judges it.
pub const ADAPTIVE_WARMUP_DRAFTS: u32 = 16;

/// A sequence's running record of its drafts, for the adaptive rule.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpecRecord {
    /// Drafts verified and accepted (an exponentially weighted count: see `record`).
    pub drafted: f32,
    pub accepted: f32,
    /// Drafts verified in all (not weighted), for the warm-up.
    pub seen: u32,
    /// No drafts for this sequence: the adaptive rule turned speculation off, or its
    /// request came with `no_spec`.
    pub off: bool,
    /// Placeholder steps left before the sequence waits for its result again to look for
    /// drafts (set when a proposal found none: see [`RETRY_AFTER_EMPTY`]).
    pub retry_in: u8,
}

/// After a proposal that found no draft, the sequence decodes this many steps behind
/// placeholders (keeping the pipeline overlap at depth 2) before it waits for a result to
/// look again.
pub const RETRY_AFTER_EMPTY: u8 = 4;

/// Weight kept of the past at each verified step: the rate follows the last ~10 steps.
const DECAY: f32 = 0.9;

impl SpecRecord {
    /// Records one verified step (`d` drafts, `a` accepted); returns true when the rule
    /// turns speculation off for the sequence now (the rate fell below `min_rate` after the
    /// warm-up).
    pub fn record(&mut self, d: usize, a: usize, min_rate: f64) -> bool {
        if d == 0 || self.off {
            return false;
        }
        self.drafted = self.drafted * DECAY + d as f32;
        self.accepted = self.accepted * DECAY + a as f32;
        self.seen = self.seen.saturating_add(d as u32);
        if self.seen >= ADAPTIVE_WARMUP_DRAFTS && f64::from(self.accepted / self.drafted) < min_rate {
            self.off = true;
            return true;
        }
        false
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
        for _ in 0..3 {
            assert!(!r.record(4, 0, 0.2), "still warming up");
        }
        assert!(r.record(4, 0, 0.2));
        assert!(r.off);
        assert!(!r.record(4, 4, 0.2), "off stays off");
        let mut good = SpecRecord::default();
        for _ in 0..100 {
            assert!(!good.record(4, 2, 0.2));
        }
        assert!(!good.off);
        // A rate of 0 turns nothing off.
        let mut any = SpecRecord::default();
        for _ in 0..100 {
            assert!(!any.record(4, 0, 0.0));
        }
    }
}
