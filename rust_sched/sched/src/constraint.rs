//! Constrained decoding as the scheduler sees it: a request may carry a compiled
//! [`Constraint`] (a grammar); each of its samples gets its own [`ConstraintState`] (a
//! matcher), advanced by every token the sequence accepts and asked, before each of its
//! samples, which tokens are allowed (a packed bitmask the executor applies to the logits).
//!
//! The scheduler only calls these traits; `rust_sched/grammar` implements them with
//! llguidance, so this crate builds, tests and benches without a grammar engine, and tests
//! drive it with small hand-written constraints.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

/// A compiled constraint, shared (read-only) by every sample of every request using it.
pub trait Constraint: Send + Sync {
    /// A matcher at the start of the output.
    fn start(&self) -> Box<dyn ConstraintState>;
    /// Words of 32 bits in this constraint's masks (`ceil(vocab_size / 32)`).
    fn mask_words(&self) -> usize;
}

/// What a matcher says after accepting a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advance {
    /// More output may follow.
    Continue,
    /// The constraint is complete and nothing may follow: the sequence ends with "stop".
    /// `eos` when the accepted token was an end-of-sequence token (not part of the text).
    Complete { eos: bool },
}

/// One sequence's position in its constraint.
pub trait ConstraintState: Send {
    /// Accepts `token`; Err (with the reason) when the constraint does not allow it.
    fn advance(&mut self, token: u32) -> Result<Advance, String>;
    /// Writes the allowed tokens of the next position into `mask` (bit `t % 32` of word
    /// `t / 32`; `mask` is zeroed and `mask_words` long). Returns false when no token is
    /// allowed (a dead end) or the matcher failed.
    fn fill_mask(&mut self, mask: &mut [u32]) -> bool;
    /// An independent copy at the same position.
    fn fork(&self) -> Box<dyn ConstraintState>;
}

/// A request's compiled constraint (cheap to clone; equal when it is the same one).
#[derive(Clone)]
pub struct ConstraintHandle(pub Arc<dyn Constraint>);

impl fmt::Debug for ConstraintHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConstraintHandle({} mask words)", self.0.mask_words())
    }
}

impl PartialEq for ConstraintHandle {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A sequence's matcher (cloning forks it).
pub struct Matcher {
    pub state: Box<dyn ConstraintState>,
    pub mask_words: usize,
}

impl Matcher {
    pub fn start(constraint: &ConstraintHandle) -> Matcher {
        Matcher { state: constraint.0.start(), mask_words: constraint.0.mask_words() }
    }
}

impl Clone for Matcher {
    fn clone(&self) -> Self {
        Matcher { state: self.state.fork(), mask_words: self.mask_words }
    }
}

impl fmt::Debug for Matcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Matcher(..)")
    }
}

/// The allowed tokens of one step's constrained samples: `rows` rows of `words` words,
/// row `i` for the plan's `mask_sample_indices[i]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GrammarMask {
    pub rows: usize,
    pub words: usize,
    /// `[rows * words]`, row-major.
    pub bits: Vec<u32>,
    /// Time the scheduler thread spent computing it.
    pub compute: Duration,
}

/// The executor's end of one step's mask: the scheduler thread sends the mask once the
/// step's constrained sequences know their previous tokens (when the result of the step
/// before is applied), while this step's forward pass runs.
#[derive(Clone, Debug)]
pub struct MaskTicket {
    rx: Receiver<GrammarMask>,
}

/// Why a mask did not come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskWait {
    /// Not yet (the timeout passed).
    Pending,
    /// The scheduler dropped the step without a mask (it stopped, or the step was failed).
    Gone,
}

impl MaskTicket {
    /// A ticket and the sender the scheduler keeps with the in-flight step.
    pub fn new() -> (Sender<GrammarMask>, MaskTicket) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        (tx, MaskTicket { rx })
    }

    /// Waits at most `timeout` for the mask.
    pub fn take(&self, timeout: Duration) -> Result<GrammarMask, MaskWait> {
        self.rx.recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => MaskWait::Pending,
            RecvTimeoutError::Disconnected => MaskWait::Gone,
        })
    }
}

/// Tickets are equal when they wait on the same step's mask.
impl PartialEq for MaskTicket {
    fn eq(&self, other: &Self) -> bool {
        self.rx.same_channel(&other.rx)
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! Hand-written constraints for the scheduler's tests.

    use super::*;

    /// Allows exactly the tokens of `script`, in order; complete after the last one.
    /// A `script` entry of `None` is a dead end (no token allowed).
    pub struct Script(pub Vec<Option<u32>>, pub usize);

    struct ScriptState {
        script: Arc<Vec<Option<u32>>>,
        pos: usize,
    }

    impl Constraint for Script {
        fn start(&self) -> Box<dyn ConstraintState> {
            Box::new(ScriptState { script: Arc::new(self.0.clone()), pos: 0 })
        }
        fn mask_words(&self) -> usize {
            self.1
        }
    }

    impl ConstraintState for ScriptState {
        fn advance(&mut self, token: u32) -> Result<Advance, String> {
            match self.script.get(self.pos) {
                Some(Some(t)) if *t == token => {
                    self.pos += 1;
                    Ok(if self.pos == self.script.len() {
                        Advance::Complete { eos: false }
                    } else {
                        Advance::Continue
                    })
                }
                _ => Err(format!("token {token} not allowed at {}", self.pos)),
            }
        }
        fn fill_mask(&mut self, mask: &mut [u32]) -> bool {
            match self.script.get(self.pos) {
                Some(Some(t)) => {
                    mask[*t as usize / 32] |= 1 << (t % 32);
                    true
                }
                _ => false,
            }
        }
        fn fork(&self) -> Box<dyn ConstraintState> {
            Box::new(ScriptState { script: self.script.clone(), pos: self.pos })
        }
    }
}
