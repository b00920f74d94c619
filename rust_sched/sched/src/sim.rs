//! A stand-in executor and workloads, for tests, benches and the scheduler simulation:
//! "sampled" tokens are a hash of the sequence id and position, so every run of the same
//! workload yields the same token streams whatever the batching, depth or preemptions.

use std::collections::HashMap;

use crate::plan::{StepPlan, PLACEHOLDER_TOKEN};
use crate::request::{RequestSpec, SeqId};

/// The token a sequence "samples" at `position` (the position of the new token).
pub fn fake_token(seq_id: SeqId, position: usize, vocab: u32) -> u32 {
    let mut x =
        seq_id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (position as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x % u64::from(vocab)) as u32
}

/// Follows plans like an executor would: a row table, the previous sample per row, and
/// deterministic "sampling". It also checks what an executor relies on: placeholders only
/// where the row sampled in the previous plan.
#[derive(Debug, Default)]
pub struct FakeExecutor {
    pub vocab: u32,
    row_seq: HashMap<i32, SeqId>,
    last_sampled: HashMap<i32, i64>,
}

impl FakeExecutor {
    pub fn new(vocab: u32) -> Self {
        FakeExecutor { vocab, ..Default::default() }
    }

    /// Returns the sampled tokens for `plan`, in `logits_indices` order.
    pub fn run(&mut self, plan: &StepPlan) -> Vec<i64> {
        for (&row, &seq) in plan.new_rows.iter().zip(&plan.new_seq_ids) {
            self.row_seq.insert(row, seq);
            self.last_sampled.remove(&row);
        }
        for (i, &row) in plan.rows.iter().enumerate() {
            let first = plan.query_start_loc[i] as usize;
            let last = plan.query_start_loc[i + 1] as usize;
            for t in first..last {
                if plan.input_ids[t] == PLACEHOLDER_TOKEN {
                    assert_eq!(t, first, "a placeholder must be a sequence's first token");
                    assert!(self.last_sampled.contains_key(&row), "placeholder without a previous sample");
                }
            }
        }
        let mut out = Vec::with_capacity(plan.logits_indices.len());
        for (&idx, &row) in plan.logits_indices.iter().zip(&plan.sample_rows) {
            let seq = self.row_seq[&row];
            let pos = plan.positions[idx as usize] as usize + 1;
            out.push(i64::from(fake_token(seq, pos, self.vocab)));
        }
        self.last_sampled.clear();
        for (&row, &tok) in plan.sample_rows.iter().zip(&out) {
            self.last_sampled.insert(row, tok);
        }
        out
    }
}

/// `n` requests of `prompt_len` tokens that never stop early (`ignore_eos`).
pub fn uniform_requests(n: usize, prompt_len: usize, max_tokens: usize, vocab: u32) -> Vec<RequestSpec> {
    (0..n)
        .map(|i| RequestSpec {
            request_id: format!("req-{i}"),
            prompt: (0..prompt_len).map(|p| fake_token(i as u64 + 1_000_000, p, vocab)).collect(),
            max_tokens,
            ignore_eos: true,
            n: 1,
            ..Default::default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn fake_token_matches_the_python_twin() {
        // pyengine.testing.fake_executor.fake_tokens([0, 5, 123], [10, 7, 3], 1000)
        let got: Vec<u32> =
            [(0, 10), (5, 7), (123, 3)].iter().map(|&(s, p)| super::fake_token(s, p, 1000)).collect();
        assert_eq!(got, vec![261, 620, 914]);
    }
}
