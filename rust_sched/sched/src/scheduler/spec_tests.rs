//! Speculative decoding in the scheduler: drafts planned, verified results applied,
//! blocks reserved and given back, the adaptive rule, the executor's drafts.

use std::sync::Arc;

use super::*;
use crate::constraint::ConstraintHandle;
use crate::sim::{MarkovExecutor, VerifiedStep};
use crate::spec::SpecMethod;

fn config(num_blocks: usize, k: usize, method: SpecMethod) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size: 4,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        pipeline_depth: 1,
        num_speculative_tokens: k,
        speculative_method: method,
        spec_min_acceptance: 0.0,
        ..SchedulerConfig::default()
    }
}

fn request(id: &str, prompt: Vec<u32>, max_tokens: usize) -> RequestSpec {
    RequestSpec { request_id: id.into(), prompt, max_tokens, ignore_eos: true, n: 1, ..Default::default() }
}

fn accept(s: &mut Scheduler, step: u64, sampled: &[i64], acc: &[i32]) -> SchedResult<()> {
    s.apply_spec_result(step, sampled, SpecResult { num_accepted: Some(acc), next_drafts: None })
}

/// Runs everything to the end with the Markov executor; returns each sequence's tokens.
fn run(s: &mut Scheduler, vocab: u32) -> HashMap<u64, Vec<i64>> {
    let mut exec = MarkovExecutor::new(vocab);
    let mut outputs: HashMap<u64, Vec<i64>> = HashMap::new();
    let mut pending: VecDeque<(u64, VerifiedStep)> = VecDeque::new();
    for _ in 0..100_000 {
        while let Some(plan) = s.schedule() {
            s.check_invariants().unwrap();
            assert!(plan.num_draft_tokens.is_empty() || plan.num_draft_tokens.len() < plan.num_samples());
            pending.push_back((plan.step_id, exec.run(&plan)));
        }
        let Some((step, result)) = pending.pop_front() else {
            assert!(!s.has_unfinished());
            return outputs;
        };
        let spec = SpecResult { num_accepted: result.num_accepted.as_deref(), next_drafts: None };
        s.apply_spec_result(step, &result.sampled, spec).unwrap();
        s.check_invariants().unwrap();
        let ev = s.take_output(Some(step));
        for (seq, tok) in ev.seq_ids.iter().zip(ev.token_ids) {
            outputs.entry(*seq).or_default().push(tok);
        }
    }
    panic!("did not finish");
}

#[test]
fn config_refuses_inconsistent_speculation() {
    let mut c = config(16, 3, SpecMethod::None);
    assert!(c.validate().is_err(), "k without a method");
    c = config(16, 0, SpecMethod::Ngram);
    assert!(c.validate().is_err(), "a method without k");
    c = config(16, 3, SpecMethod::Ngram);
    c.validate().unwrap();
    c.prompt_lookup_min = 4;
    assert!(c.validate().is_err(), "min above max");
    c = config(16, 99, SpecMethod::Ngram);
    assert!(c.validate().is_err());
    c = config(16, 3, SpecMethod::Ngram);
    c.spec_min_acceptance = 1.5;
    assert!(c.validate().is_err());
}

#[test]
fn ngram_drafts_are_planned_verified_and_rewound() {
    let mut s = Scheduler::new(config(32, 3, SpecMethod::Ngram)).unwrap();
    s.add_request(request("a", vec![1, 2, 3, 4, 5, 6, 1, 2], 20)).unwrap();
    let p0 = s.schedule().unwrap();
    assert!(p0.num_draft_tokens.is_empty(), "a prefill has no drafts");
    s.apply_result(p0.step_id, &[3]).unwrap();
    s.take_output(Some(p0.step_id));
    // Tokens: 1 2 3 4 5 6 1 2 3: "1 2 3" occurred at 0, followed by 4 5 6.
    let p1 = s.schedule().unwrap();
    assert_eq!(p1.num_draft_tokens, vec![3]);
    assert_eq!(p1.draft_token_ids, vec![4, 5, 6]);
    assert_eq!(p1.input_ids, vec![3, 4, 5, 6]);
    assert_eq!(p1.positions, vec![8, 9, 10, 11]);
    assert_eq!(p1.logits_indices, vec![0, 1, 2, 3]);
    assert_eq!(p1.sample_rows, vec![p1.rows[0]; 4]);
    assert_eq!(p1.seq_lens, vec![12]);
    // Positions 8..11 need a third block, reserved for the drafts.
    assert_eq!(s.seq(0).unwrap().blocks.len(), 3);
    s.check_invariants().unwrap();
    // One accepted (4), then the correction 9.
    accept(&mut s, p1.step_id, &[4, 9], &[1]).unwrap();
    s.check_invariants().unwrap();
    let seq = s.seq(0).unwrap();
    assert_eq!(seq.num_tokens(), 11);
    assert_eq!(seq.computed(), 10);
    assert_eq!(seq.blocks.len(), 3);
    let ev = s.take_output(Some(p1.step_id));
    assert_eq!(ev.token_ids, vec![4, 9]);
    assert_eq!(ev.seq_ids, vec![0, 0]);
    assert_eq!(ev.sample_indices, vec![0, 1]);
    let stats = s.snapshot().spec;
    assert_eq!((stats.drafts, stats.draft_tokens, stats.accepted_tokens), (1, 3, 1));
    assert_eq!(&stats.accepted_per_position[..3], &[1, 0, 0]);
    // The next plan starts from the correction token, at position 10.
    let p2 = s.schedule().unwrap();
    assert_eq!(p2.input_ids[0], 9);
    assert_eq!(p2.positions[0], 10);
}

#[test]
fn rejected_positions_give_their_blocks_back() {
    let mut s = Scheduler::new(config(32, 3, SpecMethod::Ngram)).unwrap();
    // 7 prompt tokens + 1 output = 8 tokens, computed 7: the next step's drafts reach
    // positions 8..10, a third block held only for them.
    s.add_request(request("a", vec![1, 2, 3, 9, 9, 1, 2], 20)).unwrap();
    let p0 = s.schedule().unwrap();
    s.apply_result(p0.step_id, &[3]).unwrap();
    let p1 = s.schedule().unwrap();
    assert_eq!(p1.draft_token_ids, vec![9, 9, 1]);
    assert_eq!(s.seq(0).unwrap().blocks.len(), 3);
    let used = s.pool().usage().used;
    accept(&mut s, p1.step_id, &[5], &[0]).unwrap();
    assert_eq!(s.seq(0).unwrap().blocks.len(), 2, "the block of rejected positions is released");
    assert_eq!(s.pool().usage().used, used - 1);
    s.check_invariants().unwrap();
}

#[test]
fn a_stop_among_accepted_drafts_drops_the_rest() {
    let mut s = Scheduler::new(config(32, 3, SpecMethod::Ngram)).unwrap();
    let mut r = request("a", vec![1, 2, 3, 4, 5, 6, 1, 2], 20);
    r.ignore_eos = false;
    r.eos_token_ids = vec![5];
    s.add_request(r).unwrap();
    let p0 = s.schedule().unwrap();
    s.apply_result(p0.step_id, &[3]).unwrap();
    s.take_output(Some(p0.step_id));
    let p1 = s.schedule().unwrap();
    assert_eq!(p1.draft_token_ids, vec![4, 5, 6]);
    accept(&mut s, p1.step_id, &[4, 5, 6, 7], &[3]).unwrap();
    let ev = s.take_output(Some(p1.step_id));
    assert_eq!(ev.token_ids, vec![4, 5], "tokens after the EOS are dropped");
    assert_eq!(ev.finished_seq_ids, vec![0]);
    assert_eq!(ev.stop_token_ids, vec![5]);
    assert_eq!(s.counters().discarded_tokens, 2);
    assert_eq!(s.pool().usage().used, 0);
    s.check_invariants().unwrap();
}

#[test]
fn max_tokens_bounds_the_drafts() {
    let mut s = Scheduler::new(config(32, 3, SpecMethod::Ngram)).unwrap();
    s.add_request(request("a", vec![1, 2, 3, 4, 5, 6, 1, 2], 3)).unwrap();
    let p0 = s.schedule().unwrap();
    s.apply_result(p0.step_id, &[3]).unwrap();
    let p1 = s.schedule().unwrap();
    // One output so far and max_tokens 3: one draft plus the token after it.
    assert_eq!(p1.draft_token_ids, vec![4]);
    accept(&mut s, p1.step_id, &[4, 5], &[1]).unwrap();
    let ev = s.take_output(Some(p1.step_id));
    assert_eq!(ev.finish_reasons, vec![FinishReason::Length as u8]);
    assert_eq!(s.pool().usage().used, 0);
}

#[test]
fn malformed_spec_results_are_refused_before_anything_changes() {
    let mut s = Scheduler::new(config(32, 3, SpecMethod::Ngram)).unwrap();
    s.add_request(request("a", vec![1, 2, 3, 4, 5, 6, 1, 2], 20)).unwrap();
    let p0 = s.schedule().unwrap();
    s.apply_result(p0.step_id, &[3]).unwrap();
    let p1 = s.schedule().unwrap();
    let id = p1.step_id;
    assert!(s.apply_result(id, &[4]).is_err(), "drafts need num_accepted");
    assert!(accept(&mut s, id, &[4, 5, 6, 7, 8], &[4]).is_err(), "more accepted than drafted");
    assert!(accept(&mut s, id, &[7, 9], &[1]).is_err(), "an accepted token that is not the draft");
    assert!(accept(&mut s, id, &[4, 5, 9], &[1]).is_err(), "a token count that does not add up");
    assert!(accept(&mut s, id, &[9], &[-1]).is_err());
    assert_eq!(s.num_inflight(), 1);
    accept(&mut s, id, &[9], &[0]).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn speculation_off_plans_exactly_as_before() {
    let mut plain = Scheduler::new(config(32, 0, SpecMethod::None)).unwrap();
    let mut spec = Scheduler::new(config(32, 3, SpecMethod::Ngram)).unwrap();
    for s in [&mut plain, &mut spec] {
        s.add_request(request("a", vec![1, 2, 3, 4, 5, 6, 7, 8], 20)).unwrap();
        let p0 = s.schedule().unwrap();
        s.apply_result(p0.step_id, &[11]).unwrap();
    }
    // No earlier "11": n-gram finds nothing, the plan is a plain decode.
    let a = plain.schedule().unwrap();
    let b = spec.schedule().unwrap();
    assert_eq!(a, b);
    assert!(b.num_draft_tokens.is_empty() && b.draft_token_ids.is_empty());
}

#[test]
fn greedy_outputs_equal_speculation_off_at_both_depths_with_preemption() {
    for depth in [1, 2] {
        for blocks in [12, 64] {
            let mut runs = Vec::new();
            for (k, method) in [(0, SpecMethod::None), (3, SpecMethod::Ngram), (4, SpecMethod::Suffix)] {
                let mut cfg = config(blocks, k, method);
                cfg.pipeline_depth = depth;
                cfg.max_num_batched_tokens = 16;
                let mut s = Scheduler::new(cfg).unwrap();
                for i in 0..6u32 {
                    let prompt: Vec<u32> = (0..5 + i).map(|p| (p * 3 + i) % 11).collect();
                    s.add_request(request(&format!("r{i}"), prompt, 12 + i as usize)).unwrap();
                }
                let out = run(&mut s, 11);
                assert_eq!(s.pool().usage().used, 0);
                if k > 0 {
                    assert!(s.snapshot().spec.accepted_tokens > 0, "the Markov model repeats itself");
                }
                runs.push(out);
            }
            assert_eq!(runs[0], runs[1], "ngram, depth {depth}, {blocks} blocks");
            assert_eq!(runs[0], runs[2], "suffix, depth {depth}, {blocks} blocks");
        }
    }
}

#[test]
fn greedy_outputs_equal_speculation_off_through_pauses_and_probes() {
    // A strict adaptive rule over long outputs: sequences are turned off, pause, probe and
    // resume many times; the outputs stay those of decoding without drafts.
    const VOCAB: u32 = 997;
    for depth in [1, 2] {
        let mut runs = Vec::new();
        for (k, method) in [(0, SpecMethod::None), (3, SpecMethod::Ngram)] {
            let mut cfg = config(1200, k, method);
            cfg.pipeline_depth = depth;
            cfg.max_model_len = 2048;
            cfg.spec_min_acceptance = if k > 0 { 0.95 } else { 0.0 };
            let mut s = Scheduler::new(cfg).unwrap();
            for i in 0..3u32 {
                let prompt: Vec<u32> = (0..5 + i).map(|p| (p * 7 + i) % VOCAB).collect();
                s.add_request(request(&format!("r{i}"), prompt, 1500)).unwrap();
            }
            let out = run(&mut s, VOCAB);
            assert_eq!(s.pool().usage().used, 0);
            if k > 0 {
                let stats = s.snapshot().spec;
                assert!(stats.pauses > 3, "{stats:?}");
            }
            runs.push(out);
        }
        assert_eq!(runs[0], runs[1], "depth {depth}");
    }
}

#[test]
fn short_blocks_drop_drafts_before_preempting() {
    // Two sequences of 8 tokens (2 blocks each) in a pool of 5: drafts for the first
    // would need a third block each; only one is free.
    let mut cfg = config(5, 3, SpecMethod::Ngram);
    cfg.enable_prefix_caching = false;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("a", vec![1, 2, 3, 4, 5, 6, 1], 8)).unwrap();
    s.add_request(request("b", vec![7, 8, 9, 7, 8, 9, 7], 8)).unwrap();
    let p0 = s.schedule().unwrap();
    s.apply_result(p0.step_id, &[2, 8]).unwrap();
    assert_eq!(s.pool().usage().free, 1);
    let p1 = s.schedule().unwrap();
    assert_eq!(p1.rows.len(), 2, "nobody was preempted");
    assert_eq!(s.counters().preemptions, 0);
    // The first gets the free block for its drafts (positions 8..10); the second, with no
    // block left, decodes in its own block without drafts.
    assert_eq!(p1.num_draft_tokens, vec![3, 0]);
    s.check_invariants().unwrap();
}

#[test]
fn a_speculating_sequence_waits_for_its_result_at_depth_two() {
    let mut cfg = config(32, 3, SpecMethod::Ngram);
    cfg.pipeline_depth = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("a", vec![1, 2, 3, 4, 5, 6, 1, 2], 20)).unwrap();
    let p0 = s.schedule().unwrap();
    assert!(s.schedule().is_none(), "no placeholder step for a speculating sequence");
    s.apply_result(p0.step_id, &[3]).unwrap();
    let p1 = s.schedule().unwrap();
    assert_eq!(p1.num_draft_tokens, vec![3]);
    assert!(!p1.input_ids.contains(&crate::plan::PLACEHOLDER_TOKEN));
    assert!(s.schedule().is_none());
}

#[test]
fn adaptive_rule_stops_drafting_for_a_sequence_that_never_accepts() {
    let mut cfg = config(64, 3, SpecMethod::Ngram);
    cfg.spec_min_acceptance = 0.5;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("a", vec![1; 8], 60)).unwrap();
    let p0 = s.schedule().unwrap();
    s.apply_result(p0.step_id, &[1]).unwrap();
    let mut drafted_steps = 0;
    for _ in 0..40 {
        let p = s.schedule().unwrap();
        if p.num_draft_tokens.is_empty() {
            s.apply_result(p.step_id, &[1]).unwrap();
        } else {
            drafted_steps += 1;
            // Always reject: the correction token is 1 again, so "1" keeps matching.
            accept(&mut s, p.step_id, &[1], &[0]).unwrap();
        }
        s.check_invariants().unwrap();
    }
    let stats = s.snapshot().spec;
    assert_eq!(stats.disabled_sequences, 1);
    // Each rejection backed off (4, 8, 16 plain steps), and the fourth in a row stopped
    // it before the rate's warm-up of 16 drafts.
    assert_eq!(stats.disabled_failing, 1);
    assert_eq!(stats.backoffs, u64::from(crate::spec::MAX_FAILED_STEPS) - 1);
    assert_eq!(drafted_steps, crate::spec::MAX_FAILED_STEPS as usize, "drafting stopped");
}

#[test]
fn an_ngram_sequence_turned_off_probes_again_after_its_pause() {
    let mut cfg = config(256, 3, SpecMethod::Ngram);
    cfg.spec_min_acceptance = 0.5;
    cfg.max_model_len = 1024;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("a", vec![1; 8], 900)).unwrap();
    let p0 = s.schedule().unwrap();
    s.apply_result(p0.step_id, &[1]).unwrap();
    // Every step drafts or decodes "1", so the lookup always finds a continuation; the
    // first MAX_FAILED_STEPS drafted steps keep nothing, then the probes decide.
    let failing = usize::from(crate::spec::MAX_FAILED_STEPS);
    let mut drafted_at = Vec::new();
    for step in 0..2_000 {
        let p = s.schedule().unwrap();
        if p.num_draft_tokens.is_empty() {
            s.apply_result(p.step_id, &[1]).unwrap();
        } else {
            drafted_at.push(step);
            // Reject all of the first pause's probe too; keep one draft of the second's.
            let keep = i32::from(drafted_at.len() == failing + 2);
            accept(&mut s, p.step_id, &[1, 1][..1 + keep as usize], &[keep]).unwrap();
        }
        s.check_invariants().unwrap();
        if drafted_at.len() == failing + 3 {
            break;
        }
    }
    let stats = s.snapshot().spec;
    assert_eq!((stats.disabled_failing, stats.pauses), (2, 2), "turned off, then its first probe failed");
    let (off, probe1, probe2) = (drafted_at[failing - 1], drafted_at[failing], drafted_at[failing + 1]);
    let pause = usize::from(crate::spec::PAUSE_STEPS);
    assert!(probe1 - off > pause && probe1 - off <= pause + 2, "first pause: {} steps", probe1 - off);
    assert!(probe2 - probe1 > 2 * pause && probe2 - probe1 <= 2 * pause + 2, "doubled: {}", probe2 - probe1);
    assert_eq!(drafted_at[failing + 2], probe2 + 1, "a kept draft: drafting at once again");
}

#[test]
fn executor_drafts_are_planned_for_the_next_step() {
    let mut s = Scheduler::new(config(32, 2, SpecMethod::Executor)).unwrap();
    s.add_request(request("a", vec![1, 2, 3], 20)).unwrap();
    let p0 = s.schedule().unwrap();
    let counts = [3i32];
    let tokens = [7i64, 8, 9];
    let spec = SpecResult { num_accepted: None, next_drafts: Some((&counts, &tokens)) };
    s.apply_spec_result(p0.step_id, &[6], spec).unwrap();
    let p1 = s.schedule().unwrap();
    assert_eq!(p1.draft_token_ids, vec![7, 8], "capped at k");
    assert_eq!(p1.input_ids, vec![6, 7, 8]);
    let bad = SpecResult { num_accepted: Some(&[0]), next_drafts: Some((&[2], &[1])) };
    assert!(s.apply_spec_result(p1.step_id, &[5], bad).is_err(), "counts that do not add up");
    accept(&mut s, p1.step_id, &[7, 8, 4], &[2]).unwrap();
    // No drafts came with that result: a plain decode.
    let p2 = s.schedule().unwrap();
    assert!(p2.num_draft_tokens.is_empty());
    assert_eq!(p2.input_ids, vec![4]);
}

#[test]
fn abort_and_failure_with_drafts_in_flight_leave_the_pool_full() {
    for fail in [false, true] {
        let mut s = Scheduler::new(config(32, 3, SpecMethod::Ngram)).unwrap();
        s.add_request(request("a", vec![1, 2, 3, 4, 5, 6, 1, 2], 20)).unwrap();
        let p0 = s.schedule().unwrap();
        s.apply_result(p0.step_id, &[3]).unwrap();
        let p1 = s.schedule().unwrap();
        assert_eq!(p1.num_draft_tokens, vec![3]);
        if fail {
            s.fail_step(p1.step_id).unwrap();
        } else {
            assert!(s.abort("a"));
            assert!(s.pool().usage().used > 0, "held until the step reports");
            accept(&mut s, p1.step_id, &[4, 5, 6, 1], &[3]).unwrap();
            assert_eq!(s.counters().discarded_tokens, 4);
        }
        assert_eq!(s.pool().usage().used, 0);
        assert_eq!(s.pool().usage().free, 32);
        s.check_invariants().unwrap();
    }
}

#[test]
fn constrained_and_pooling_sequences_get_no_drafts() {
    let mut s = Scheduler::new(config(32, 3, SpecMethod::Ngram)).unwrap();
    let mut p = request("p", vec![1, 2, 1, 2], 1);
    p.pooling = true;
    p.max_tokens = 0;
    s.add_request(p).unwrap();
    let p0 = s.schedule().unwrap();
    assert!(p0.num_draft_tokens.is_empty());
    s.apply_result(p0.step_id, &[]).unwrap();
    assert_eq!(s.pool().usage().used, 0);
    // The same repeating prompt twice, one of them constrained by a grammar that allows
    // exactly the repetition: prompt lookup would propose 4 5 6 for both.
    let script = [3, 4, 5, 6, 1, 2, 3].map(Some).to_vec();
    let grammar = ConstraintHandle(Arc::new(crate::constraint::testing::Script(script, 1)));
    let prompt = vec![1, 2, 3, 4, 5, 6, 1, 2];
    s.add_request(request("free", prompt.clone(), 20)).unwrap();
    s.add_request(RequestSpec { constraint: Some(grammar), ..request("g", prompt, 20) }).unwrap();
    let p1 = s.schedule().unwrap();
    s.apply_result(p1.step_id, &[3, 3]).unwrap();
    s.take_output(Some(p1.step_id));
    let p2 = s.schedule().unwrap();
    assert_eq!(p2.rows.len(), 2);
    assert_eq!(p2.num_draft_tokens, vec![3, 0], "the constrained sequence gets no drafts");
    assert_eq!(p2.draft_token_ids, vec![4, 5, 6]);
    assert_eq!(p2.mask_sample_indices, vec![4], "its one entry is masked");
    s.check_invariants().unwrap();
}

#[test]
fn suffix_proposals_come_from_a_finished_request() {
    let mut s = Scheduler::new(config(64, 3, SpecMethod::Suffix)).unwrap();
    s.add_request(request("first", vec![1, 2], 6)).unwrap();
    let out = run(&mut s, 1000);
    let first: Vec<u32> = out[&0].iter().map(|&t| t as u32).collect();
    // A second request whose prompt ends like the first one's output began.
    s.add_request(request("second", vec![50, 51, first[0], first[1]], 6)).unwrap();
    let p0 = s.schedule().unwrap();
    s.apply_result(p0.step_id, &[i64::from(first[2])]).unwrap();
    let p1 = s.schedule().unwrap();
    let want: Vec<i64> = first[3..6].iter().map(|&t| i64::from(t)).collect();
    assert_eq!(p1.draft_token_ids, want);
}

#[test]
fn a_sequence_without_matches_keeps_the_pipeline_overlap_between_lookups() {
    let mut cfg = config(64, 3, SpecMethod::Ngram);
    cfg.pipeline_depth = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("a", vec![1, 2, 3, 4], 40)).unwrap();
    let p0 = s.schedule().unwrap();
    assert!(s.schedule().is_none(), "waits for its first token to look for drafts");
    s.apply_result(p0.step_id, &[9]).unwrap();
    let p1 = s.schedule().unwrap();
    assert!(p1.num_draft_tokens.is_empty(), "no earlier 9: nothing proposed");
    // Nothing found: the next steps go behind placeholders, two in flight at once.
    let p2 = s.schedule().unwrap();
    assert_eq!(p2.input_ids, vec![crate::plan::PLACEHOLDER_TOKEN]);
    let mut inflight = VecDeque::from([p1.step_id, p2.step_id]);
    let mut waited = false;
    for token in 10..22 {
        let id = inflight.pop_front().unwrap();
        s.apply_result(id, &[token]).unwrap();
        match s.schedule() {
            Some(p) => inflight.push_back(p.step_id),
            None => waited = true,
        }
        if inflight.is_empty() {
            let p = s.schedule().unwrap();
            inflight.push_back(p.step_id);
        }
        s.check_invariants().unwrap();
    }
    assert!(waited, "it looks for drafts again after a few placeholder steps");
}

#[test]
fn drafts_never_take_a_block_a_later_sequence_needs_for_its_own_token() {
    // a and c (7 prompt tokens) decode position 7 in a block they hold; b (8 prompt
    // tokens) needs a third block for position 8. One block is free: it is b's, not a
    // place for a's drafts (which would have b preempt c).
    let mut cfg = config(7, 3, SpecMethod::Ngram);
    cfg.enable_prefix_caching = false;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("a", vec![1, 2, 3, 4, 5, 6, 1], 8)).unwrap();
    s.add_request(request("b", (10..18).collect(), 8)).unwrap();
    s.add_request(request("c", (20..27).collect(), 8)).unwrap();
    let p0 = s.schedule().unwrap();
    s.apply_result(p0.step_id, &[2, 18, 27]).unwrap();
    assert_eq!(s.pool().usage().free, 1);
    let p1 = s.schedule().unwrap();
    assert_eq!(s.counters().preemptions, 0, "drafts made b preempt c");
    assert_eq!(p1.rows.len(), 3);
    assert!(p1.num_draft_tokens.is_empty(), "no block is left for a's drafts");
    s.check_invariants().unwrap();
}

/// Decodes everything at depth 1 with every draft rejected, each sequence's tokens a
/// fixed function of its id and position (so speculation on and off see the same
/// tokens); returns the rows of every plan and the preemptions.
fn run_all_rejected(s: &mut Scheduler) -> (Vec<Vec<i32>>, u64) {
    let token = |id: u64, pos: usize| ((id as usize + pos % 3) % 4) as i64;
    let mut rows = Vec::new();
    for _ in 0..10_000 {
        let Some(plan) = s.schedule() else {
            assert!(!s.has_unfinished());
            return (rows, s.counters().preemptions);
        };
        s.check_invariants().unwrap();
        let step = s.inflight.back().unwrap();
        let sampled: Vec<i64> =
            step.sampled.iter().map(|&i| s.seq(i).map(|q| token(q.id, q.num_tokens())).unwrap()).collect();
        let acc = vec![0i32; sampled.len()];
        let with_drafts = !plan.num_draft_tokens.is_empty();
        let spec = SpecResult { num_accepted: with_drafts.then_some(&acc[..]), next_drafts: None };
        s.apply_spec_result(plan.step_id, &sampled, spec).unwrap();
        s.take_output(Some(plan.step_id));
        rows.push(plan.rows);
    }
    panic!("did not finish");
}

#[test]
fn speculation_never_causes_a_preemption_that_speculation_off_would_not() {
    // Tight pools where decoding without drafts never preempts: with drafts (all
    // rejected, so both runs see the same tokens) every step plans the same sequences.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = |m: u64| {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % m
    };
    let mut compared = 0;
    let mut drafted = 0;
    for _ in 0..300 {
        let num_seqs = 2 + next(4) as usize;
        let requests: Vec<(Vec<u32>, usize)> = (0..num_seqs)
            .map(|i| {
                let len = 2 + next(10) as usize;
                ((0..len).map(|p| ((i + p % 3) % 4) as u32).collect(), 2 + next(12) as usize)
            })
            .collect();
        let prompt_blocks: usize = requests.iter().map(|(p, _)| p.len().div_ceil(4)).sum();
        let num_blocks = prompt_blocks + next(4) as usize;
        if requests.iter().any(|(p, m)| (p.len() + m).div_ceil(4) > num_blocks) {
            continue; // refused: it could never fit
        }
        let mut runs = Vec::new();
        for (k, method) in [(0, SpecMethod::None), (3, SpecMethod::Ngram)] {
            let mut cfg = config(num_blocks, k, method);
            cfg.enable_prefix_caching = false;
            let mut s = Scheduler::new(cfg).unwrap();
            for (i, (prompt, max_tokens)) in requests.iter().enumerate() {
                s.add_request(request(&format!("r{i}"), prompt.clone(), *max_tokens)).unwrap();
            }
            runs.push(run_all_rejected(&mut s));
            assert_eq!(s.pool().usage().used, 0);
            drafted += s.snapshot().spec.drafts;
        }
        if runs[0].1 == 0 {
            compared += 1;
            assert_eq!(runs[1].1, 0, "speculation preempted where decoding without it did not: {requests:?}");
            assert_eq!(runs[0].0, runs[1].0, "other sequences planned: {requests:?}, {num_blocks} blocks");
        }
    }
    assert!(compared > 50 && drafted > 100, "{compared} runs compared, {drafted} drafted steps");
}

#[test]
fn an_output_ended_by_a_stop_string_is_not_kept_for_suffix_proposals() {
    // The output thread finds stop strings in the text and ends the sequence from outside;
    // by then the scheduler knows tokens past the string (the rest of a verified step,
    // or later steps): they are not the output, and no later request is proposed them.
    let mut s = Scheduler::new(config(64, 3, SpecMethod::Suffix)).unwrap();
    s.add_request(request("a", vec![1, 2], 20)).unwrap();
    for token in [7, 8, 9] {
        let p = s.schedule().unwrap();
        s.apply_result(p.step_id, &[token]).unwrap();
    }
    assert!(s.finish(0, FinishReason::Stop).unwrap());
    let cache = s.suffix_cache.as_ref().unwrap();
    assert_eq!(cache.num_docs(), 0, "a stop-string output is kept with tokens past the string");
    // An output the scheduler ended itself is kept.
    s.add_request(request("b", vec![1, 2], 2)).unwrap();
    for token in [7, 8] {
        let p = s.schedule().unwrap();
        s.apply_result(p.step_id, &[token]).unwrap();
    }
    assert!(!s.has_unfinished());
    assert_eq!(s.suffix_cache.as_ref().unwrap().num_docs(), 1);
}

#[test]
fn a_no_spec_request_is_never_proposed_for_and_keeps_the_overlap() {
    let mut cfg = config(32, 3, SpecMethod::Ngram);
    cfg.pipeline_depth = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(RequestSpec { no_spec: true, ..request("a", vec![1, 2, 3, 4, 5, 6, 1, 2], 20) }).unwrap();
    let p0 = s.schedule().unwrap();
    let p1 = s.schedule().expect("planned behind a placeholder, not waiting for drafts");
    assert_eq!(p1.input_ids, vec![crate::plan::PLACEHOLDER_TOKEN]);
    s.apply_result(p0.step_id, &[3]).unwrap();
    // "1 2 3" occurred before: a sequence that may draft would be proposed 4 5 6 now.
    let p2 = s.schedule().unwrap();
    assert!(p2.num_draft_tokens.is_empty());
    assert_eq!(s.snapshot().spec.proposals, 0, "the proposer never ran for it");
    assert_eq!(s.snapshot().spec.disabled_sequences, 0, "not counted as turned off by the adaptive rule");
    s.check_invariants().unwrap();
}

#[test]
fn a_sequence_backing_off_is_not_proposed_for() {
    let adaptive = SchedulerConfig { spec_min_acceptance: 0.1, ..config(64, 2, SpecMethod::Executor) };
    let mut s = Scheduler::new(adaptive).unwrap();
    s.add_request(request("a", vec![1, 2, 3], 40)).unwrap();
    let p0 = s.schedule().unwrap();
    assert_eq!(p0.propose_indices, vec![0]);
    assert_eq!(p0.propose_counts, vec![1], "nothing kept yet (learning): one");
    let drafts = SpecResult { num_accepted: None, next_drafts: Some((&[1], &[7])) };
    s.apply_spec_result(p0.step_id, &[6], drafts).unwrap();
    let p1 = s.schedule().unwrap();
    assert_eq!(p1.num_draft_tokens, vec![1]);
    // One kept (past the executor proposers' learning steps), then nothing: 4 plain steps.
    let kept = SpecResult { num_accepted: Some(&[1]), next_drafts: Some((&[1], &[3])) };
    s.apply_spec_result(p1.step_id, &[7, 5], kept).unwrap();
    let p2 = s.schedule().unwrap();
    assert_eq!(p2.num_draft_tokens, vec![1]);
    assert_eq!(p2.propose_counts, vec![2], "a draft kept: the adaptive rule's count");
    accept(&mut s, p2.step_id, &[5], &[0]).unwrap();
    let mut proposed = Vec::new();
    for _ in 0..6 {
        let p = s.schedule().unwrap();
        assert!(p.num_draft_tokens.is_empty());
        proposed.push(!p.propose_indices.is_empty());
        if !p.propose_indices.is_empty() {
            assert_eq!(p.propose_counts, vec![2], "kept about one a step lately: two");
        }
        s.apply_result(p.step_id, &[9]).unwrap();
    }
    // The last plain step asks for drafts; none came (an empty proposal): 8 more.
    assert_eq!(proposed, [false, false, false, true, false, false]);
    assert_eq!(s.snapshot().spec.empty_proposals, 1);
}

#[test]
fn the_plan_names_the_sequences_the_executor_proposes_for() {
    let mut s = Scheduler::new(config(32, 2, SpecMethod::Executor)).unwrap();
    s.add_request(request("free", vec![1, 2, 3], 20)).unwrap();
    s.add_request(RequestSpec { no_spec: true, ..request("no", vec![1, 2, 3], 20) }).unwrap();
    // One output and max_tokens 2: its next step has no room for a draft.
    s.add_request(request("short", vec![1, 2, 3], 2)).unwrap();
    let script = [4, 5, 6, 7].map(Some).to_vec();
    let grammar = ConstraintHandle(Arc::new(crate::constraint::testing::Script(script, 1)));
    s.add_request(RequestSpec { constraint: Some(grammar), ..request("g", vec![1, 2, 3], 20) }).unwrap();
    let mut p = request("pool", vec![1, 2, 3], 1);
    p.pooling = true;
    p.max_tokens = 0;
    s.add_request(p).unwrap();
    let p0 = s.schedule().unwrap();
    assert_eq!(p0.num_samples(), 4, "the pooling prompt is not sampled");
    assert_eq!(p0.propose_indices, vec![0], "only the first may draft in its next step");
    assert_eq!(p0.propose_counts, vec![2], "the adaptive rule off: its room, k");
    // "short" has no room next step but may still draft as far as the adaptive rule goes.
    assert_eq!(p0.may_draft_indices, vec![0, 2], "not no_spec, constrained or pooling");
    // Off for other methods.
    let mut n = Scheduler::new(config(32, 2, SpecMethod::Ngram)).unwrap();
    n.add_request(request("free", vec![1, 2, 3], 20)).unwrap();
    let plan = n.schedule().unwrap();
    assert!(plan.propose_indices.is_empty() && plan.may_draft_indices.is_empty());
}

#[test]
fn an_executor_proposer_that_keeps_nothing_at_first_is_turned_off_without_backing_off() {
    let adaptive = SchedulerConfig { spec_min_acceptance: 0.1, ..config(64, 2, SpecMethod::Executor) };
    let mut s = Scheduler::new(adaptive).unwrap();
    s.add_request(request("a", vec![1, 2, 3], 40)).unwrap();
    let p0 = s.schedule().unwrap();
    let drafts = SpecResult { num_accepted: None, next_drafts: Some((&[2], &[7, 8])) };
    s.apply_spec_result(p0.step_id, &[6], drafts).unwrap();
    for step in 1..=crate::spec::EXECUTOR_LEARNING_STEPS {
        let p = s.schedule().unwrap();
        // (one draft a try while learning, though the executor sent two)
        assert_eq!(p.num_draft_tokens, vec![1], "verified again at once: no back-off");
        let last = step == crate::spec::EXECUTOR_LEARNING_STEPS;
        // Proposed for before the verdict, but not after its last try: that proposal would
        // be dropped with the sequence.
        assert_eq!(p.propose_indices.is_empty(), last);
        assert_eq!(p.may_draft_indices, vec![0], "still mirrored: the try may keep its draft");
        let next: Option<(&[i32], &[i64])> = if last { None } else { Some((&[2], &[7, 8])) };
        let rejected = SpecResult { num_accepted: Some(&[0]), next_drafts: next };
        s.apply_spec_result(p.step_id, &[5], rejected).unwrap();
        assert_eq!(s.snapshot().spec.disabled_learning, u64::from(last));
    }
    let stats = s.snapshot().spec;
    assert_eq!((stats.disabled_sequences, stats.backoffs), (1, 0));
    // Off for good: plain steps, no proposal, out of may_draft_indices.
    for _ in 0..5 {
        let p = s.schedule().unwrap();
        assert!(
            p.num_draft_tokens.is_empty() && p.propose_indices.is_empty() && p.may_draft_indices.is_empty()
        );
        s.apply_result(p.step_id, &[9]).unwrap();
    }
}

#[test]
fn an_executor_proposer_is_asked_for_one_draft_until_one_is_kept() {
    let adaptive = SchedulerConfig { spec_min_acceptance: 0.1, ..config(64, 4, SpecMethod::Executor) };
    let mut s = Scheduler::new(adaptive).unwrap();
    s.add_request(request("a", vec![1, 2, 3], 40)).unwrap();
    let p0 = s.schedule().unwrap();
    assert_eq!(p0.propose_counts, vec![crate::spec::EXECUTOR_LEARNING_DRAFTS as i32]);
    assert_eq!(crate::spec::EXECUTOR_LEARNING_DRAFTS, 1);
    // An executor that sends more than it was asked for: one is verified all the same.
    let three = SpecResult { num_accepted: None, next_drafts: Some((&[3], &[7, 8, 9])) };
    s.apply_spec_result(p0.step_id, &[6], three).unwrap();
    let p1 = s.schedule().unwrap();
    assert_eq!((p1.num_draft_tokens.clone(), p1.propose_counts.clone()), (vec![1], vec![1]));
    // The first try keeps nothing: still learning, one draft again.
    let one = SpecResult { num_accepted: Some(&[0]), next_drafts: Some((&[1], &[4])) };
    s.apply_spec_result(p1.step_id, &[5], one).unwrap();
    // Its last learning try: nothing is proposed after it (the verdict, in the same
    // executor call, would most likely drop the proposal).
    let p2 = s.schedule().unwrap();
    assert_eq!((p2.num_draft_tokens.clone(), p2.propose_counts.clone()), (vec![1], vec![]));
    // It keeps its draft: a step without drafts, then the adaptive rule's count (1 kept
    // of 2 steps: two), growing to k.
    let kept = SpecResult { num_accepted: Some(&[1]), next_drafts: None };
    s.apply_spec_result(p2.step_id, &[4, 3], kept).unwrap();
    let p3 = s.schedule().unwrap();
    assert_eq!((p3.num_draft_tokens.clone(), p3.propose_counts.clone()), (vec![], vec![2]));
    let two = SpecResult { num_accepted: None, next_drafts: Some((&[2], &[5, 6])) };
    s.apply_spec_result(p3.step_id, &[2], two).unwrap();
    let p4 = s.schedule().unwrap();
    assert_eq!((p4.num_draft_tokens.clone(), p4.propose_counts.clone()), (vec![2], vec![3]));
    let all = SpecResult { num_accepted: Some(&[2]), next_drafts: Some((&[3], &[1, 2, 3])) };
    s.apply_spec_result(p4.step_id, &[5, 6, 9], all).unwrap();
    let p5 = s.schedule().unwrap();
    assert_eq!((p5.num_draft_tokens.clone(), p5.propose_counts.clone()), (vec![3], vec![4]), "k");
    assert_eq!(s.snapshot().spec.disabled_sequences, 0);
}

#[test]
fn an_executor_proposer_that_keeps_its_first_draft_goes_to_k_at_once() {
    let adaptive = SchedulerConfig { spec_min_acceptance: 0.1, ..config(64, 4, SpecMethod::Executor) };
    let mut s = Scheduler::new(adaptive).unwrap();
    s.add_request(request("a", vec![1, 2, 3], 40)).unwrap();
    let p0 = s.schedule().unwrap();
    assert_eq!(p0.propose_counts, vec![1]);
    let one = SpecResult { num_accepted: None, next_drafts: Some((&[1], &[7])) };
    s.apply_spec_result(p0.step_id, &[6], one).unwrap();
    let p1 = s.schedule().unwrap();
    assert_eq!(
        (p1.num_draft_tokens.clone(), p1.propose_counts.clone()),
        (vec![1], vec![1]),
        "verdict not in yet"
    );
    // Its first draft kept, none lost: k from the next proposal on, not a ramp from 2.
    let kept = SpecResult { num_accepted: Some(&[1]), next_drafts: Some((&[1], &[8])) };
    s.apply_spec_result(p1.step_id, &[7, 9], kept).unwrap();
    let p2 = s.schedule().unwrap();
    assert_eq!((p2.num_draft_tokens.clone(), p2.propose_counts.clone()), (vec![1], vec![4]));
    let kept = SpecResult { num_accepted: Some(&[1]), next_drafts: Some((&[4], &[1, 2, 3, 4])) };
    s.apply_spec_result(p2.step_id, &[8, 5], kept).unwrap();
    let p3 = s.schedule().unwrap();
    assert_eq!((p3.num_draft_tokens.clone(), p3.propose_counts.clone()), (vec![4], vec![4]));
    // A first draft lost: the adaptive rule's count (about 1.4 kept a step: 3).
    let half = SpecResult { num_accepted: Some(&[2]), next_drafts: Some((&[4], &[1, 2, 3, 4])) };
    s.apply_spec_result(p3.step_id, &[1, 2, 6], half).unwrap();
    let p4 = s.schedule().unwrap();
    assert_eq!(p4.num_draft_tokens, vec![3]);
}
