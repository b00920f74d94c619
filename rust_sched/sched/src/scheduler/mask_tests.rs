//! Grammar masks through the scheduler, with hand-written constraints
//! ([`crate::constraint::testing::Script`]) and no executor.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::constraint::testing::Script;
use crate::constraint::{ConstraintHandle, MaskWait};
use crate::plan::StepPlan;

fn config(depth: usize, num_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size: 4,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        pipeline_depth: depth,
        ..SchedulerConfig::default()
    }
}

fn script(tokens: &[Option<u32>]) -> ConstraintHandle {
    ConstraintHandle(Arc::new(Script(tokens.to_vec(), 2)))
}

fn constrained(id: &str, max_tokens: usize, n: usize, c: &ConstraintHandle) -> RequestSpec {
    RequestSpec {
        request_id: id.into(),
        prompt: vec![1, 2, 3, 4, 5],
        max_tokens,
        n,
        constraint: Some(c.clone()),
        ..Default::default()
    }
}

/// Samples one token per entry: for a constrained sample the lowest token its mask allows
/// (the mask must be ready: the driver asks only once the step is the oldest in flight),
/// else `unconstrained`.
fn sample(plan: &StepPlan, unconstrained: i64) -> Vec<i64> {
    let mut out = vec![unconstrained; plan.num_samples()];
    if let Some(ticket) = &plan.grammar_mask {
        let mask = ticket.take(Duration::ZERO).expect("the mask of the oldest step is ready");
        assert_eq!(mask.rows, plan.mask_sample_indices.len());
        for (row, &i) in plan.mask_sample_indices.iter().enumerate() {
            let bits = &mask.bits[row * mask.words..(row + 1) * mask.words];
            let first = (0..mask.words * 32).find(|&t| bits[t / 32] & (1 << (t % 32)) != 0);
            out[i as usize] = first.expect("a mask row allows some token") as i64;
        }
    } else {
        assert!(plan.mask_sample_indices.is_empty());
    }
    out
}

/// Runs to completion as the engine thread does: masks are sent after a plan is made and
/// after a result is applied. Returns every event.
fn drive(s: &mut Scheduler) -> Vec<OutputEvent> {
    let mut events = Vec::new();
    let mut queued: VecDeque<StepPlan> = VecDeque::new();
    for _ in 0..10_000 {
        while let Some(plan) = s.schedule() {
            s.send_front_mask();
            queued.push_back(plan);
        }
        let Some(plan) = queued.pop_front() else {
            assert!(!s.has_unfinished());
            return events;
        };
        let sampled = sample(&plan, 1);
        s.apply_result(plan.step_id, &sampled).unwrap();
        s.send_front_mask();
        s.check_invariants().unwrap();
        events.push(s.take_output(Some(plan.step_id)));
    }
    panic!("did not finish");
}

/// Each sequence's tokens, and how it ended (reason, stop token).
type Outputs = (HashMap<u64, Vec<i64>>, HashMap<u64, (FinishReason, i64)>);

fn outputs(events: &[OutputEvent]) -> Outputs {
    let mut tokens: HashMap<u64, Vec<i64>> = HashMap::new();
    let mut finished = HashMap::new();
    for ev in events {
        for (s, t) in ev.seq_ids.iter().zip(&ev.token_ids) {
            tokens.entry(*s).or_default().push(*t);
        }
        for (i, s) in ev.finished_seq_ids.iter().enumerate() {
            let reason =
                FinishReason::parse(crate::plan::FINISH_REASONS[ev.finish_reasons[i] as usize]).unwrap();
            assert!(finished.insert(*s, (reason, ev.stop_token_ids[i])).is_none(), "finished twice");
        }
    }
    (tokens, finished)
}

#[test]
fn a_constrained_request_follows_its_grammar_and_stops_when_complete_at_both_depths() {
    for depth in [1, 2] {
        let mut s = Scheduler::new(config(depth, 64)).unwrap();
        let c = script(&[Some(7), Some(9), Some(40)]);
        s.add_request(constrained("a", 10, 1, &c)).unwrap();
        s.add_request(RequestSpec {
            request_id: "free".into(),
            prompt: vec![3; 6],
            max_tokens: 4,
            n: 1,
            ..Default::default()
        })
        .unwrap();
        let (tokens, finished) = outputs(&drive(&mut s));
        assert_eq!(tokens[&0], vec![7, 9, 40], "depth {depth}");
        assert_eq!(finished[&0], (FinishReason::Stop, -1));
        assert_eq!(tokens[&1], vec![1, 1, 1, 1], "unconstrained rows are untouched");
        assert_eq!(finished[&1].0, FinishReason::Length);
        assert_eq!(s.pool().usage().used, 0);
        // At depth 2 the step planned before the completion was seen masks once more.
        assert_eq!(s.counters().masks_computed, 2 + depth as u64);
    }
}

#[test]
fn max_tokens_before_the_grammar_completes_is_length() {
    let mut s = Scheduler::new(config(2, 64)).unwrap();
    let c = script(&[Some(7), Some(9), Some(40)]);
    s.add_request(constrained("a", 2, 1, &c)).unwrap();
    let (tokens, finished) = outputs(&drive(&mut s));
    assert_eq!(tokens[&0], vec![7, 9]);
    assert_eq!(finished[&0].0, FinishReason::Length);
}

#[test]
fn a_dead_end_finishes_without_emitting_a_token() {
    for depth in [1, 2] {
        let mut s = Scheduler::new(config(depth, 64)).unwrap();
        let c = script(&[Some(7), None]);
        s.add_request(constrained("a", 10, 1, &c)).unwrap();
        let (tokens, finished) = outputs(&drive(&mut s));
        assert_eq!(tokens[&0], vec![7], "depth {depth}: nothing after the dead end");
        assert_eq!(finished[&0], (FinishReason::DeadEnd, -1));
        assert_eq!(s.counters().dead_ends, 1);
        assert_eq!(s.pool().usage().used, 0);
    }
}

#[test]
fn a_token_the_grammar_refuses_is_never_emitted() {
    let mut s = Scheduler::new(config(1, 64)).unwrap();
    let c = script(&[Some(7), Some(9)]);
    s.add_request(constrained("a", 10, 1, &c)).unwrap();
    let plan = s.schedule().unwrap();
    s.send_front_mask();
    s.apply_result(plan.step_id, &[8]).unwrap(); // as if the mask had not been applied
    let ev = s.take_output(Some(plan.step_id));
    assert!(ev.token_ids.is_empty());
    assert_eq!(ev.finish_reasons, vec![FinishReason::DeadEnd as u8]);
    assert!(!s.has_unfinished());
}

#[test]
fn at_depth_two_the_next_mask_waits_for_the_previous_result() {
    let mut s = Scheduler::new(config(2, 64)).unwrap();
    let c = script(&[Some(7), Some(9), Some(40)]);
    s.add_request(constrained("a", 10, 1, &c)).unwrap();
    let p0 = s.schedule().unwrap();
    assert!(s.send_front_mask());
    let p1 = s.schedule().unwrap();
    assert!(!s.send_front_mask(), "step 0 is still the oldest in flight");
    assert_eq!(p1.mask_sample_indices, vec![0]);
    let t1 = p1.grammar_mask.as_ref().unwrap();
    assert_eq!(t1.take(Duration::ZERO), Err(MaskWait::Pending));
    let m0 = p0.grammar_mask.as_ref().unwrap().take(Duration::ZERO).unwrap();
    assert_eq!(m0.bits, vec![1 << 7, 0]);
    s.apply_result(0, &[7]).unwrap();
    assert!(s.send_front_mask());
    assert_eq!(t1.take(Duration::ZERO).unwrap().bits, vec![1 << 9, 0]);
}

#[test]
fn a_sequence_that_ended_gets_an_open_row_and_its_extra_token_is_dropped() {
    let mut s = Scheduler::new(config(2, 64)).unwrap();
    let c = script(&[Some(7), Some(9), Some(40)]);
    s.add_request(constrained("a", 10, 1, &c)).unwrap();
    let _p0 = s.schedule().unwrap();
    s.send_front_mask();
    let p1 = s.schedule().unwrap();
    s.abort("a");
    s.apply_result(0, &[7]).unwrap();
    s.send_front_mask();
    let m1 = p1.grammar_mask.as_ref().unwrap().take(Duration::ZERO).unwrap();
    assert_eq!(m1.bits, vec![u32::MAX, u32::MAX]);
    s.apply_result(1, &[123]).unwrap();
    assert!(!s.has_unfinished());
    assert_eq!(s.counters().discarded_tokens, 2);
}

#[test]
fn each_sample_has_its_own_matcher_and_preemption_keeps_it() {
    // 6 blocks of 4 tokens: three samples of 5 + 12 tokens cannot all run at once.
    let mut s = Scheduler::new(config(2, 6)).unwrap();
    let steps: Vec<Option<u32>> = (0..12).map(|i| Some(10 + i)).collect();
    let c = script(&steps);
    s.add_request(constrained("a", 12, 3, &c)).unwrap();
    let (tokens, finished) = outputs(&drive(&mut s));
    let want: Vec<i64> = (10..22).collect();
    for seq in 0..3 {
        assert_eq!(tokens[&seq], want, "sample {seq}");
        assert_eq!(finished[&seq].0, FinishReason::Stop);
    }
    assert!(s.counters().preemptions > 0, "the pool was meant to force preemption");
    assert_eq!(s.pool().usage().used, 0);
}

#[test]
fn pooling_requests_take_no_constraint() {
    let s = Scheduler::new(config(1, 64)).unwrap();
    let c = script(&[Some(1)]);
    let mut spec = constrained("p", 1, 1, &c);
    spec.pooling = true;
    let err = spec.validate(s.config()).unwrap_err();
    assert!(err.to_string().contains("takes no output constraint"), "{err}");
}
