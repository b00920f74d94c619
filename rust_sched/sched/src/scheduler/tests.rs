//! Unit tests of the scheduler through small factories, without an executor.

use super::*;
use crate::plan::PLACEHOLDER_TOKEN;
use crate::sim::FakeExecutor;

fn config(num_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size: 4,
        max_num_seqs: 8,
        max_num_batched_tokens: 32,
        max_model_len: 256,
        pipeline_depth: 1,
        ..SchedulerConfig::default()
    }
}

fn request(id: &str, prompt: Vec<u32>, max_tokens: usize) -> RequestSpec {
    RequestSpec { request_id: id.into(), prompt, max_tokens, ignore_eos: true, n: 1, ..Default::default() }
}

/// Drives the scheduler with a fake executor until everything finished; returns each
/// sequence's output tokens.
fn run_to_completion(s: &mut Scheduler) -> HashMap<u64, Vec<i64>> {
    run_with(s, &mut FakeExecutor::new(1000))
}

fn run_with(s: &mut Scheduler, exec: &mut FakeExecutor) -> HashMap<u64, Vec<i64>> {
    let mut outputs: HashMap<u64, Vec<i64>> = HashMap::new();
    let mut pending: VecDeque<(u64, Vec<i64>)> = VecDeque::new();
    for _ in 0..100_000 {
        while let Some(plan) = s.schedule() {
            s.check_invariants().unwrap();
            pending.push_back((plan.step_id, exec.run(&plan)));
        }
        let Some((step, sampled)) = pending.pop_front() else {
            assert!(!s.has_unfinished(), "nothing in flight but requests are unfinished");
            return outputs;
        };
        s.apply_result(step, &sampled).unwrap();
        s.check_invariants().unwrap();
        let ev = s.take_output(Some(step));
        for (seq, tok) in ev.seq_ids.iter().zip(ev.token_ids) {
            outputs.entry(*seq).or_default().push(tok);
        }
    }
    panic!("did not finish");
}

#[test]
fn decode_requests_finish_with_max_tokens() {
    let mut s = Scheduler::new(config(64)).unwrap();
    for i in 0..3 {
        s.add_request(request(&format!("r{i}"), vec![1, 2, 3, 4, 5], 7)).unwrap();
    }
    let out = run_to_completion(&mut s);
    assert_eq!(out.len(), 3);
    assert!(out.values().all(|v| v.len() == 7));
    assert_eq!(s.pool().usage().used, 0);
}

#[test]
fn first_plan_prefills_then_decodes_with_placeholders_at_depth_two() {
    let mut cfg = config(64);
    cfg.pipeline_depth = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("a", (0..6).collect(), 4)).unwrap();
    let p0 = s.schedule().unwrap();
    assert_eq!(p0.num_scheduled_tokens, vec![6]);
    assert_eq!(p0.logits_indices, vec![5]);
    assert_eq!(p0.new_seq_ids, vec![0]);
    assert_eq!(p0.block_table_ids.len(), 2);
    let p1 = s.schedule().unwrap();
    assert_eq!(p1.input_ids, vec![PLACEHOLDER_TOKEN]);
    assert_eq!(p1.positions, vec![6]);
    assert!(s.schedule().is_none(), "pipeline depth 2 allows two steps in flight");
}

#[test]
fn chunked_prefill_respects_budget_and_cap() {
    let mut cfg = config(64);
    cfg.max_num_batched_tokens = 10;
    cfg.long_prefill_token_threshold = 6;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("a", (0..20).collect(), 2)).unwrap();
    s.add_request(request("b", (0..20).collect(), 2)).unwrap();
    let p = s.schedule().unwrap();
    assert_eq!(p.num_scheduled_tokens, vec![6, 4]);
    assert!(p.logits_indices.is_empty(), "no prompt is complete yet");
}

#[test]
fn prefix_cache_hits_are_reused_and_counted() {
    let mut s = Scheduler::new(config(64)).unwrap();
    let prompt: Vec<u32> = (0..10).collect();
    s.add_request(request("a", prompt.clone(), 2)).unwrap();
    run_to_completion(&mut s);
    s.add_request(request("b", prompt, 2)).unwrap();
    let p = s.schedule().unwrap();
    // Two full blocks of 4 are cached; the last 2 tokens are computed.
    assert_eq!(p.num_scheduled_tokens, vec![2]);
    assert_eq!(p.positions, vec![8, 9]);
    assert_eq!(s.pool().prefix_stats().hit_tokens, 8);
}

#[test]
fn whole_prompt_hit_still_computes_one_token() {
    let mut s = Scheduler::new(config(64)).unwrap();
    let prompt: Vec<u32> = (0..8).collect();
    s.add_request(request("a", prompt.clone(), 1)).unwrap();
    run_to_completion(&mut s);
    s.add_request(request("b", prompt, 1)).unwrap();
    let p = s.schedule().unwrap();
    assert_eq!(p.positions, vec![4, 5, 6, 7]);
}

#[test]
fn preemption_under_a_tiny_pool_still_yields_identical_tokens() {
    let reference = {
        let mut s = Scheduler::new(config(256)).unwrap();
        for i in 0..6 {
            s.add_request(request(&format!("r{i}"), (0..9).map(|t| t + i).collect(), 20)).unwrap();
        }
        run_to_completion(&mut s)
    };
    let mut s = Scheduler::new(config(12)).unwrap();
    for i in 0..6 {
        s.add_request(request(&format!("r{i}"), (0..9).map(|t| t + i).collect(), 20)).unwrap();
    }
    let out = run_to_completion(&mut s);
    assert!(s.counters().preemptions > 0, "the pool was meant to force preemption");
    assert_eq!(out, reference);
    assert_eq!(s.pool().usage().used, 0);
}

#[test]
fn admission_rejects_what_can_never_run() {
    let mut s = Scheduler::new(config(4)).unwrap();
    let err = s.add_request(request("big", (0..10).collect(), 10)).unwrap_err();
    assert!(matches!(err, SchedError::InvalidRequest { .. }), "{err}");
    let err = s.add_request(request("empty", vec![], 1)).unwrap_err();
    assert!(err.to_string().contains("empty"));
    let err = s.add_request(request("long", (0..250).collect(), 10)).unwrap_err();
    assert!(err.to_string().contains("max_model_len"));
    s.add_request(request("ok", vec![1], 1)).unwrap();
    assert!(matches!(s.add_request(request("ok", vec![1], 1)), Err(SchedError::DuplicateRequest(_))));
}

#[test]
fn eos_stops_only_after_min_tokens() {
    let mut s = Scheduler::new(config(64)).unwrap();
    let mut spec = request("a", vec![1, 2], 10);
    spec.ignore_eos = false;
    spec.eos_token_ids = vec![7];
    spec.min_tokens = 2;
    s.add_request(spec).unwrap();
    for expected_finished in [false, true] {
        let p = s.schedule().unwrap();
        s.apply_result(p.step_id, &[7]).unwrap();
        let ev = s.take_output(Some(p.step_id));
        assert_eq!(!ev.finished_seq_ids.is_empty(), expected_finished);
    }
    assert_eq!(s.pool().usage().used, 0);
}

#[test]
fn abort_during_inflight_step_frees_blocks_after_it_reports() {
    let mut cfg = config(64);
    cfg.pipeline_depth = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("a", vec![1, 2, 3], 10)).unwrap();
    let p0 = s.schedule().unwrap();
    let p1 = s.schedule().unwrap();
    assert!(s.abort("a"));
    assert!(s.pool().usage().used > 0, "blocks stay while steps reference them");
    s.apply_result(p0.step_id, &[5]).unwrap();
    let ev = s.take_output(Some(p0.step_id));
    assert!(ev.seq_ids.is_empty(), "tokens of an aborted sequence are dropped");
    s.apply_result(p1.step_id, &[6]).unwrap();
    assert_eq!(s.pool().usage().used, 0);
    assert!(!s.has_unfinished());
    s.check_invariants().unwrap();
}

#[test]
fn n_samples_share_prompt_blocks() {
    let mut s = Scheduler::new(config(64)).unwrap();
    let mut spec = request("a", (0..10).collect(), 3);
    spec.n = 3;
    let first = s.add_request(spec).unwrap();
    let p0 = s.schedule().unwrap();
    assert_eq!(p0.new_seq_ids, vec![first]);
    let sampled = FakeExecutor::new(100).run(&p0);
    s.apply_result(p0.step_id, &sampled).unwrap();
    let p1 = s.schedule().unwrap();
    // The siblings only compute the prompt's partial tail block (2 tokens each).
    assert_eq!(p1.new_seq_ids, vec![first + 1, first + 2]);
    assert_eq!(p1.num_scheduled_tokens, vec![1, 2, 2]);
    s.check_invariants().unwrap();
    let shared = s.seqs.iter().flatten().find(|q| q.id == first + 1).unwrap().blocks[0];
    assert_eq!(s.pool().ref_count(shared), 3);
}

#[test]
fn priority_policy_preempts_the_least_important() {
    let mut cfg = config(6);
    cfg.policy = Policy::Priority;
    let mut s = Scheduler::new(cfg).unwrap();
    let mut low = request("low", (0..8).collect(), 12);
    low.priority = 5;
    s.add_request(low).unwrap();
    let mut exec = FakeExecutor::new(9);
    let p = s.schedule().unwrap();
    s.apply_result(p.step_id, &exec.run(&p)).unwrap();
    let mut high = request("high", (0..8).collect(), 12);
    high.priority = -1;
    high.prompt[0] = 99;
    s.add_request(high).unwrap();
    let out = run_with(&mut s, &mut exec);
    let mut lens: Vec<(u64, usize)> = out.iter().map(|(k, v)| (*k, v.len())).collect();
    lens.sort();
    assert_eq!(lens, vec![(0, 12), (1, 12)], "the first token is still in the pending event");
    assert!(s.counters().preemptions >= 1);
}

#[test]
fn bad_results_are_rejected_without_changes() {
    let mut s = Scheduler::new(config(64)).unwrap();
    s.add_request(request("a", vec![1, 2], 3)).unwrap();
    let p = s.schedule().unwrap();
    assert!(matches!(s.apply_result(p.step_id + 1, &[1]), Err(SchedError::BadStepResult(_))));
    assert!(matches!(s.apply_result(p.step_id, &[1, 2]), Err(SchedError::BadStepResult(_))));
    assert!(matches!(s.apply_result(p.step_id, &[-3]), Err(SchedError::BadStepResult(_))));
    s.apply_result(p.step_id, &[1]).unwrap();
}

#[test]
fn failed_step_ends_its_sequences_with_error() {
    let mut s = Scheduler::new(config(64)).unwrap();
    s.add_request(request("a", vec![1, 2], 3)).unwrap();
    let p = s.schedule().unwrap();
    s.fail_step(p.step_id).unwrap();
    let ev = s.take_output(Some(p.step_id));
    assert_eq!(ev.finish_reasons, vec![FinishReason::Error as u8]);
    assert_eq!(s.pool().usage().used, 0);
    assert!(!s.has_unfinished());
}

#[test]
fn a_prefix_registered_earlier_in_the_same_step_is_hit() {
    let mut s = Scheduler::new(config(64)).unwrap();
    let prefix: Vec<u32> = (100..108).collect();
    s.add_request(request("a", [prefix.clone(), vec![1, 2, 3]].concat(), 2)).unwrap();
    s.add_request(request("b", [prefix, vec![4, 5]].concat(), 2)).unwrap();
    let p = s.schedule().unwrap();
    assert_eq!(p.num_scheduled_tokens, vec![11, 2]);
    assert_eq!(s.pool().prefix_stats().hit_tokens, 8);
}

#[test]
fn a_failed_step_also_fails_later_readers_of_its_blocks() {
    let mut cfg = config(64);
    cfg.pipeline_depth = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    let prefix: Vec<u32> = (100..108).collect();
    s.add_request(request("a", [prefix.clone(), vec![1]].concat(), 4)).unwrap();
    let p0 = s.schedule().unwrap();
    // Admitted in the next plan, hitting the blocks p0 is still computing.
    s.add_request(request("b", [prefix, vec![2]].concat(), 4)).unwrap();
    let p1 = s.schedule().unwrap();
    assert!(p1.new_seq_ids.contains(&1));
    assert_eq!(s.pool().prefix_stats().hit_tokens, 8);
    s.fail_step(p0.step_id).unwrap();
    let ev = s.take_output(None);
    assert_eq!(ev.finished_seq_ids, vec![0, 1], "b read KV that p0 never wrote");
    assert!(ev.finish_reasons.iter().all(|&r| r == FinishReason::Error as u8));
    s.apply_result(p1.step_id, &vec![5; p1.num_samples()]).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.pool().usage().used, 0);
    assert!(!s.has_unfinished());
}

/// Depth 2, decode at a block boundary: the block holding the first generated token is
/// written by a step that fails. It must never become findable (the sequence ends with
/// an error, and its blocks are not offered to the cache).
#[test]
fn a_block_registered_by_a_later_plan_is_forgotten_when_its_writer_fails() {
    let mut cfg = config(64);
    cfg.pipeline_depth = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    let mut spec = request("a", vec![1, 2, 3], 10);
    spec.ignore_eos = false;
    s.add_request(spec).unwrap();
    let p0 = s.schedule().unwrap(); // prefill, samples position 3
    let p1 = s.schedule().unwrap(); // writes position 3 (a placeholder): fills block 0
    assert_eq!(p1.input_ids, vec![PLACEHOLDER_TOKEN]);
    s.apply_result(p0.step_id, &[7]).unwrap();
    let p2 = s.schedule().unwrap(); // token 3 is known now: block 0 is registered here
    s.fail_step(p1.step_id).unwrap();
    s.apply_result(p2.step_id, &[9]).unwrap();
    s.check_invariants().unwrap();
    s.add_request(request("b", vec![1, 2, 3, 7, 5], 2)).unwrap();
    let p3 = s.schedule().unwrap();
    assert_eq!(p3.positions[0], 0, "b must not reuse block 0: its last slot was never written");
}

/// A failed step's blocks fail the sequences that *reused* them, not one that was merely
/// handed a freed block and writes it itself.
#[test]
fn a_failed_step_spares_sequences_that_got_its_blocks_as_fresh_allocations() {
    for caching in [true, false] {
        let cfg = SchedulerConfig {
            num_blocks: 7,
            block_size: 4,
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            max_model_len: 64,
            long_prefill_token_threshold: 12,
            enable_prefix_caching: caching,
            pipeline_depth: 2,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(cfg).unwrap();
        s.add_request(request("d", (100..108).collect(), 1)).unwrap();
        s.add_request(request("b", (200..224).collect(), 1)).unwrap();
        let p0 = s.schedule().unwrap();
        s.add_request(request("a", (300..308).collect(), 1)).unwrap();
        let p1 = s.schedule().unwrap(); // only a: b still needs blocks
        assert_eq!(p1.new_seq_ids.len(), 1);
        s.apply_result(p0.step_id, &[1]).unwrap(); // d ends
        let _ = s.take_output(None);
        let _p2 = s.schedule().unwrap(); // b preempts a and takes blocks, a's among them
        assert_eq!(s.counters().preemptions, 1);
        s.fail_step(p1.step_id).unwrap();
        let ev = s.take_output(None);
        assert!(!ev.finished_seq_ids.contains(&1), "caching={caching}: b never read a's KV");
        s.check_invariants().unwrap();
    }
}

/// Blocks holding generated tokens are not hashed while their sequence runs (the decode
/// step stays free of hashing); once it ends they are findable, so a follow-up turn that
/// repeats the conversation reuses them.
#[test]
fn generated_blocks_become_findable_when_their_sequence_ends() {
    let prompt: Vec<u32> = (1..=6).collect();
    let follow_up = |known: &[u32]| request("b", [known, &[999]].concat(), 1);

    // While a runs: after 4 decode results it knows 10 tokens and computed 9, so blocks 0
    // (prompt) and 1 (2 prompt + 2 generated tokens) are full; only block 0 is findable.
    let mut s = Scheduler::new(config(64)).unwrap(); // block size 4, depth 1
    s.add_request(request("a", prompt.clone(), 7)).unwrap();
    let mut exec = FakeExecutor::new(1000);
    let mut known = prompt.clone();
    for _ in 0..4 {
        let plan = s.schedule().unwrap();
        let sampled = exec.run(&plan);
        known.extend(sampled.iter().map(|&t| t as u32));
        s.apply_result(plan.step_id, &sampled).unwrap();
    }
    s.add_request(follow_up(&known)).unwrap();
    s.schedule().unwrap();
    assert_eq!(s.pool().prefix_stats().hit_tokens, 4);

    // After a ended: its 12 computed tokens fill 3 blocks, all findable.
    let mut s = Scheduler::new(config(64)).unwrap();
    s.add_request(request("a", prompt.clone(), 7)).unwrap();
    let out = run_to_completion(&mut s);
    let known: Vec<u32> = prompt.iter().copied().chain(out[&0].iter().map(|&t| t as u32)).collect();
    assert_eq!(known.len(), 13);
    s.add_request(follow_up(&known)).unwrap();
    s.schedule().unwrap();
    assert_eq!(s.pool().prefix_stats().hit_tokens, 12);
    s.check_invariants().unwrap();
}
