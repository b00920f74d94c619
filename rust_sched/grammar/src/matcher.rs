//! A compiled grammar and its per-sequence matchers, as the scheduler's
//! [`Constraint`] / [`ConstraintState`].

use std::sync::Mutex;

use llguidance::api::StopReason;
use llguidance::{Matcher, TokenParser};
use pyengine_sched::constraint::{Advance, Constraint, ConstraintState};

/// A grammar compiled against the engine's vocabulary: a parser at the start of the
/// output, cloned for each new sequence (clones share the lexer's caches).
pub struct CompiledGrammar {
    parser: Mutex<TokenParser>,
    mask_words: usize,
}

impl CompiledGrammar {
    pub(crate) fn new(parser: TokenParser, mask_words: usize) -> CompiledGrammar {
        CompiledGrammar { parser: Mutex::new(parser), mask_words }
    }

    /// A matcher at the start of the output.
    pub fn matcher(&self) -> GrammarMatcher {
        let parser = self.parser.lock().unwrap_or_else(|e| e.into_inner()).clone();
        GrammarMatcher { inner: Matcher::new(Ok(parser)) }
    }
}

impl Constraint for CompiledGrammar {
    fn start(&self) -> Box<dyn ConstraintState> {
        Box::new(self.matcher())
    }

    fn mask_words(&self) -> usize {
        self.mask_words
    }
}

/// One sequence's llguidance matcher.
#[derive(Clone)]
pub struct GrammarMatcher {
    inner: Matcher,
}

impl GrammarMatcher {
    /// llguidance's error, if the matcher failed.
    pub fn error(&self) -> Option<String> {
        self.inner.get_error()
    }
}

impl ConstraintState for GrammarMatcher {
    fn advance(&mut self, token: u32) -> Result<Advance, String> {
        self.inner.consume_token(token).map_err(|e| e.to_string())?;
        if !self.inner.is_stopped() {
            return Ok(Advance::Continue);
        }
        match self.inner.stop_reason() {
            StopReason::EndOfSentence => Ok(Advance::Complete { eos: true }),
            StopReason::NoExtension => Ok(Advance::Complete { eos: false }),
            other => Err(self.inner.get_error().unwrap_or_else(|| format!("the grammar stopped: {other:?}"))),
        }
    }

    fn fill_mask(&mut self, mask: &mut [u32]) -> bool {
        match self.inner.compute_mask() {
            Ok(allowed) => {
                let bits = allowed.as_slice();
                let n = bits.len().min(mask.len());
                mask[..n].copy_from_slice(&bits[..n]);
                mask[..n].iter().any(|&w| w != 0)
            }
            Err(_) => false,
        }
    }

    fn fork(&self) -> Box<dyn ConstraintState> {
        Box::new(self.clone())
    }
}
