//! Grammar masks: the allowed tokens of a step's constrained samples.
//!
//! A step's mask depends on every token its constrained sequences accepted before it. At
//! pipeline depth 2 step N+1 is planned before step N's tokens are known, so its mask is
//! computed once step N's result is applied, while step N+1's forward pass runs: that is,
//! when step N+1 becomes the oldest step in flight. At depth 1 the same rule computes it
//! right after the plan is sent. The executor takes it just before sampling
//! ([`crate::constraint::MaskTicket`]).

use std::time::Instant;

use crate::constraint::GrammarMask;
use crate::plan::FinishReason;
use crate::request::SeqState;

use super::Scheduler;

impl Scheduler {
    /// Computes and sends the mask of the oldest in-flight step, if it has constrained
    /// samples and its mask is not sent yet. A sequence whose grammar allows no token ends
    /// here with [`FinishReason::DeadEnd`]; its row allows every token, and the token it
    /// samples is discarded like any token sampled after its sequence ended (so is the row
    /// of a sequence that already ended). Returns whether a mask was sent.
    pub fn send_front_mask(&mut self) -> bool {
        let Some(front) = self.inflight.front_mut() else {
            return false;
        };
        let Some(tx) = front.mask_tx.take() else {
            return false;
        };
        let masked = std::mem::take(&mut front.masked);
        let words = front.mask_words.max(1);
        let started = Instant::now();
        let mut bits = vec![0u32; masked.len() * words];
        for (row, &seq_index) in masked.iter().enumerate() {
            let out = &mut bits[row * words..(row + 1) * words];
            let seq =
                self.seqs[seq_index as usize].as_mut().expect("sequence referenced by an in-flight step");
            let allowed = match (seq.state, seq.matcher.as_mut()) {
                (SeqState::Finished, _) | (_, None) => None,
                (_, Some(matcher)) => Some(matcher.state.fill_mask(&mut out[..matcher.mask_words])),
            };
            match allowed {
                Some(true) => {}
                Some(false) => {
                    out.fill(u32::MAX);
                    self.counters.dead_ends += 1;
                    self.end_sequence(seq_index, FinishReason::DeadEnd, None);
                }
                None => out.fill(u32::MAX),
            }
        }
        let compute = started.elapsed();
        self.counters.mask_steps += 1;
        self.counters.masks_computed += masked.len() as u64;
        self.counters.mask_ns += compute.as_nanos() as u64;
        // The executor may have dropped the plan (a failed step): nobody waits then.
        let _ = tx.send(GrammarMask { rows: masked.len(), words, bits, compute });
        true
    }
}
