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

/// A stand-in target model for speculative decoding: the next token is a function of
/// the input token and its position only ([`markov_token`]), so drafts can be verified
/// greedily as a real executor would, and a run with speculation must produce exactly
/// the tokens of a run without.
#[derive(Debug, Default)]
pub struct MarkovExecutor {
    pub vocab: u32,
    last_sampled: HashMap<i32, i64>,
}

/// The greedy "model" of [`MarkovExecutor`]: mostly a fixed permutation of a small
/// vocabulary (so outputs repeat and prompt lookup finds them), shifted every seventh
/// position (so some drafts are rejected).
pub fn markov_token(input: u32, position: usize, vocab: u32) -> u32 {
    let next = (input.wrapping_mul(5).wrapping_add(3)) % vocab;
    if position % 7 == 0 {
        (next + 1) % vocab
    } else {
        next
    }
}

/// One step's result as [`MarkovExecutor`] returns it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifiedStep {
    pub sampled: Vec<i64>,
    /// `[S]`, None when the plan had no drafts.
    pub num_accepted: Option<Vec<i32>>,
}

impl MarkovExecutor {
    pub fn new(vocab: u32) -> Self {
        MarkovExecutor { vocab, ..Default::default() }
    }

    /// Runs `plan`: each entry's target token, then per sequence the drafts accepted
    /// greedily (while each equals the target before it) and the next target token.
    pub fn run(&mut self, plan: &StepPlan) -> VerifiedStep {
        for &row in &plan.new_rows {
            self.last_sampled.remove(&row);
        }
        let input = |t: usize, last: &HashMap<i32, i64>, row: i32| -> u32 {
            let id = plan.input_ids[t];
            if id == PLACEHOLDER_TOKEN {
                last[&row] as u32
            } else {
                id as u32
            }
        };
        let targets: Vec<u32> = plan
            .logits_indices
            .iter()
            .zip(&plan.sample_rows)
            .map(|(&idx, &row)| {
                let idx = idx as usize;
                markov_token(
                    input(idx, &self.last_sampled, row),
                    plan.positions[idx] as usize + 1,
                    self.vocab,
                )
            })
            .collect();
        let mut out = VerifiedStep::default();
        let with_drafts = !plan.num_draft_tokens.is_empty();
        let mut accepted = Vec::new();
        let (mut entry, mut draft_at) = (0, 0);
        let mut new_last = HashMap::new();
        let num_seqs = if with_drafts { plan.num_draft_tokens.len() } else { targets.len() };
        for k in 0..num_seqs {
            let d = if with_drafts { plan.num_draft_tokens[k] as usize } else { 0 };
            let drafts = &plan.draft_token_ids[draft_at..draft_at + d];
            let mut a = 0;
            while a < d && drafts[a] == i64::from(targets[entry + a]) {
                out.sampled.push(drafts[a]);
                a += 1;
            }
            let token = i64::from(targets[entry + a]);
            out.sampled.push(token);
            new_last.insert(plan.sample_rows[entry], token);
            accepted.push(a as i32);
            entry += d + 1;
            draft_at += d;
        }
        self.last_sampled = new_last;
        if with_drafts {
            out.num_accepted = Some(accepted);
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
