//! Integration tests of the scheduler thread through [`EngineHandle`]: an executor loop on
//! the test thread takes plans, runs them with [`FakeExecutor`] and submits the results,
//! and drains output events.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use pyengine_sched::engine::THREAD_NAME;
use pyengine_sched::sim::{fake_token, FakeExecutor};
use pyengine_sched::{
    Attachment, EngineHandle, FinishReason, OutputEvent, RequestSpec, SchedError, Scheduler, SchedulerConfig,
};

const VOCAB: u32 = 1000;
const EOS: u32 = 7;

fn config(depth: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks: 512,
        block_size: 16,
        max_num_seqs: 64,
        max_num_batched_tokens: 1024,
        max_model_len: 512,
        pipeline_depth: depth,
        ..SchedulerConfig::default()
    }
}

/// `count` requests of varied prompt lengths, output lengths and sample counts; a few stop
/// early on EOS. Prompts share prefixes so that the prefix cache hits.
fn workload(count: usize) -> Vec<RequestSpec> {
    (0..count)
        .map(|i| RequestSpec {
            request_id: format!("req-{i}"),
            prompt: (0..1 + (i * 37) % 200).map(|p| fake_token((i % 5) as u64, p, VOCAB)).collect(),
            max_tokens: 1 + (i * 13) % 40,
            eos_token_ids: vec![EOS],
            ignore_eos: i % 3 == 0,
            n: 1 + usize::from(i % 10 == 0),
            ..Default::default()
        })
        .collect()
}

/// What the output side saw.
#[derive(Debug, Default, PartialEq)]
struct Seen {
    tokens: BTreeMap<u64, Vec<i64>>,
    /// Sequence id -> (finish reason code, stop token).
    finished: BTreeMap<u64, (u8, i64)>,
    events: usize,
}

impl Seen {
    fn absorb(&mut self, ev: OutputEvent) {
        self.events += 1;
        for (&s, &t) in ev.seq_ids.iter().zip(&ev.token_ids) {
            assert!(!self.finished.contains_key(&s), "token for ended sequence {s}");
            self.tokens.entry(s).or_default().push(t);
        }
        for (i, &s) in ev.finished_seq_ids.iter().enumerate() {
            let prev = self.finished.insert(s, (ev.finish_reasons[i], ev.stop_token_ids[i]));
            assert!(prev.is_none(), "sequence {s} ended twice");
        }
    }
}

/// Runs the executor loop until `done(seen)` holds; panics after `limit`.
fn drive(
    h: &EngineHandle,
    exec: &mut FakeExecutor,
    seen: &mut Seen,
    limit: Duration,
    done: impl Fn(&Seen) -> bool,
) {
    let deadline = Instant::now() + limit;
    while !done(seen) {
        assert!(Instant::now() < deadline, "engine made no progress within {limit:?}");
        if let Some(plan) = h.next_plan(Some(Duration::from_millis(2))).unwrap() {
            let sampled = exec.run(&plan);
            h.submit_result(plan.step_id, sampled, None).unwrap();
        }
        while let Some(ev) = h.next_output(Some(Duration::ZERO)).unwrap() {
            seen.absorb(ev);
        }
    }
}

fn run_engine(depth: usize, specs: &[RequestSpec]) -> Seen {
    let h = EngineHandle::start(config(depth)).unwrap();
    let mut total = 0;
    for (i, spec) in specs.iter().enumerate() {
        assert_eq!(h.add_request(spec.clone()).unwrap(), total, "request {i}");
        total += spec.n as u64;
    }
    let mut exec = FakeExecutor::new(VOCAB);
    let mut seen = Seen::default();
    drive(&h, &mut exec, &mut seen, Duration::from_secs(60), |s| s.finished.len() as u64 == total);
    let stats = h.stats(Duration::from_secs(5));
    assert_eq!(stats.scheduler.kv.used, 0, "blocks still held after every request ended");
    assert_eq!(stats.scheduler.num_running + stats.scheduler.num_waiting, 0);
    assert!(stats.scheduler.prefix.hit_tokens > 0, "the workload shares prefixes");
    h.shutdown(Duration::from_secs(5)).unwrap();
    seen.events = 0;
    seen
}

/// The same workload on the bare scheduler, one step at a time.
fn run_direct(specs: &[RequestSpec]) -> Seen {
    let mut s = Scheduler::new(SchedulerConfig { pipeline_depth: 1, ..config(1) }).unwrap();
    for spec in specs {
        s.add_request(spec.clone()).unwrap();
    }
    let mut exec = FakeExecutor::new(VOCAB);
    let mut seen = Seen::default();
    while let Some(plan) = s.schedule() {
        s.apply_result(plan.step_id, &exec.run(&plan)).unwrap();
        seen.absorb(s.take_output(Some(plan.step_id)));
    }
    assert!(!s.has_unfinished());
    seen.events = 0;
    seen
}

#[test]
fn hundreds_of_requests_finish_with_identical_streams_at_depth_one_and_two() {
    let specs = workload(300);
    let total: usize = specs.iter().map(|s| s.n).sum();
    let depth1 = run_engine(1, &specs);
    let depth2 = run_engine(2, &specs);
    assert_eq!(depth1.finished.len(), total);
    let mut first = 0u64;
    for spec in &specs {
        for seq in first..first + spec.n as u64 {
            let out = depth1.tokens.get(&seq).map_or(0, Vec::len);
            let (reason, stop) = depth1.finished[&seq];
            assert!(out <= spec.max_tokens);
            if reason == FinishReason::Stop as u8 {
                assert!(!spec.ignore_eos && stop == i64::from(EOS));
            } else {
                assert_eq!((reason, out), (FinishReason::Length as u8, spec.max_tokens));
            }
        }
        first += spec.n as u64;
    }
    assert!(depth1.finished.values().any(|&(r, _)| r == FinishReason::Stop as u8), "some stop on EOS");
    assert_eq!(depth1, depth2, "depth 1 and depth 2 token streams differ");
    assert_eq!(depth1, run_direct(&specs), "the thread changes the token streams");
}

fn long_request(id: &str) -> RequestSpec {
    RequestSpec {
        request_id: id.into(),
        prompt: (0..40).collect(),
        max_tokens: 400,
        ignore_eos: true,
        n: 1,
        ..Default::default()
    }
}

#[test]
fn abort_frees_blocks() {
    for depth in [1, 2] {
        let h = EngineHandle::start(config(depth)).unwrap();
        let mut exec = FakeExecutor::new(VOCAB);
        let mut seen = Seen::default();
        let a = h.add_request(long_request("a")).unwrap();
        let b = h.add_request(long_request("b")).unwrap();
        drive(&h, &mut exec, &mut seen, Duration::from_secs(20), |s| {
            s.tokens.get(&a).map_or(0, Vec::len) >= 5
        });
        h.abort("a").unwrap();
        h.abort("never-added").unwrap();
        drive(&h, &mut exec, &mut seen, Duration::from_secs(20), |s| s.finished.contains_key(&a));
        assert_eq!(seen.finished[&a].0, FinishReason::Abort as u8);
        let stats = h.stats(Duration::from_secs(5));
        assert_eq!(stats.scheduler.num_running, 1, "b keeps running");
        h.abort("b").unwrap();
        drive(&h, &mut exec, &mut seen, Duration::from_secs(20), |s| s.finished.contains_key(&b));
        // Plans made before the abort may still be in flight: run them out.
        while let Some(plan) = h.next_plan(Some(Duration::from_millis(50))).unwrap() {
            h.submit_result(plan.step_id, exec.run(&plan), None).unwrap();
        }
        let stats = h.stats(Duration::from_secs(5));
        assert_eq!(stats.scheduler.num_inflight_steps, 0);
        assert_eq!(stats.scheduler.kv.used, 0, "aborted requests still hold blocks (depth {depth})");
        h.shutdown(Duration::from_secs(5)).unwrap();
    }
}

#[test]
fn duplicate_id_rejected_while_live_and_accepted_after_it_ended() {
    let h = EngineHandle::start(config(2)).unwrap();
    let mut exec = FakeExecutor::new(VOCAB);
    let mut seen = Seen::default();
    let spec = RequestSpec { max_tokens: 3, ..long_request("dup") };
    let first = h.add_request(spec.clone()).unwrap();
    match h.add_request(spec.clone()) {
        Err(SchedError::DuplicateRequest(id)) => assert_eq!(id, "dup"),
        other => panic!("expected a duplicate error, got {other:?}"),
    }
    drive(&h, &mut exec, &mut seen, Duration::from_secs(20), |s| s.finished.contains_key(&first));
    let second = h.add_request(spec).expect("the id is free once its request ended");
    assert!(second > first);
    drive(&h, &mut exec, &mut seen, Duration::from_secs(20), |s| s.finished.contains_key(&second));
    assert_eq!(seen.tokens[&second].len(), 3);
    h.shutdown(Duration::from_secs(5)).unwrap();
}

fn thread_names() -> Vec<String> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        if let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) {
            names.push(comm.trim_end().to_string());
        }
    }
    names
}

#[test]
fn scheduler_thread_is_named() {
    assert!(THREAD_NAME.len() <= 15, "Linux truncates thread names to 15 bytes");
    if !std::path::Path::new("/proc/self/task").exists() {
        return; // Not Linux.
    }
    let h = EngineHandle::start(config(1)).unwrap();
    assert!(h.is_alive());
    // start() returns only once the thread runs under its name: no waiting here.
    let names = thread_names();
    assert!(names.iter().any(|n| n == THREAD_NAME), "no {THREAD_NAME:?} thread in {names:?}");
    h.shutdown(Duration::from_secs(5)).unwrap();
    assert!(!h.is_alive());
}

#[test]
fn shutdown_joins_with_requests_in_flight_and_outputs_not_drained() {
    for depth in [1, 2] {
        // Room for four requests of 2000 output tokens: more steps than the output channel
        // holds events.
        let config = SchedulerConfig { num_blocks: 1024, max_model_len: 4096, ..config(depth) };
        let h = EngineHandle::start(config).unwrap();
        let mut exec = FakeExecutor::new(VOCAB);
        for i in 0..4 {
            h.add_request(RequestSpec { max_tokens: 2000, ..long_request(&format!("r{i}")) }).unwrap();
        }
        // Run steps without draining outputs until the thread blocks on the full output
        // channel and stops planning.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut steps = 0;
        while let Some(plan) = h.next_plan(Some(Duration::from_millis(200))).unwrap() {
            assert!(Instant::now() < deadline, "the output channel never filled");
            h.submit_result(plan.step_id, exec.run(&plan), None).unwrap();
            steps += 1;
        }
        assert!(steps >= 1000, "planning stopped after {steps} steps, before the output channel filled");
        let stats = h.stats(Duration::from_millis(100));
        assert!(stats.output_queue_depth > 0);
        // Another request in flight, and a plan taken whose result never comes.
        h.add_request(long_request("late")).unwrap();
        let started = Instant::now();
        h.shutdown(Duration::from_secs(2)).expect("shutdown joins in time");
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(!h.is_alive());
        assert!(matches!(h.add_request(long_request("after")), Err(SchedError::Closed(_))));
        assert!(matches!(h.submit_result(0, vec![], None), Err(SchedError::Closed(_))));
        // A second shutdown is a no-op.
        h.shutdown(Duration::from_secs(1)).unwrap();
    }
}

#[test]
fn shutdown_joins_while_a_plan_is_unanswered() {
    let h = EngineHandle::start(config(2)).unwrap();
    h.add_request(long_request("r")).unwrap();
    let plan = h.next_plan(Some(Duration::from_secs(5))).unwrap().expect("a plan");
    assert_eq!(plan.num_seqs(), 1);
    h.shutdown(Duration::from_secs(2)).unwrap();
    assert!(matches!(h.next_plan(Some(Duration::from_millis(10))), Err(SchedError::Closed(_)) | Ok(Some(_))));
}

#[test]
fn injected_panic_closes_the_engine_with_its_message() {
    let h = EngineHandle::start(config(2)).unwrap();
    h.add_request(long_request("r")).unwrap();
    h.inject_panic().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let err = loop {
        assert!(Instant::now() < deadline, "the engine kept running after inject_panic");
        match h.next_plan(Some(Duration::from_millis(10))) {
            Err(e) => break e,
            Ok(Some(plan)) => {
                let _ = h.submit_result(plan.step_id, FakeExecutor::new(VOCAB).run(&plan), None);
            }
            Ok(None) => {}
        }
    };
    let SchedError::Closed(msg) = &err else { panic!("expected Closed, got {err:?}") };
    assert!(msg.contains("panic"), "next_plan error does not mention the panic: {msg}");
    for result in [
        h.add_request(long_request("later")).map(|_| ()),
        h.abort("r"),
        h.finish(0, FinishReason::Stop),
        h.submit_result(0, vec![1], None),
        h.next_output(Some(Duration::from_millis(10))).map(|_| ()),
    ] {
        match result {
            Err(SchedError::Closed(msg)) => assert!(msg.contains("panic"), "{msg}"),
            other => panic!("expected Closed after the panic, got {other:?}"),
        }
    }
    assert!(h.death().unwrap().contains("inject_panic"));
    assert!(!h.is_alive());
    h.shutdown(Duration::from_secs(2)).unwrap();
}

/// Sequence ids from several request-adding threads stay unique and every request runs.
#[test]
fn concurrent_adds_get_unique_ids() {
    let h = EngineHandle::start(config(2)).unwrap();
    let ids: Vec<u64> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let h = &h;
                scope.spawn(move || {
                    (0..25)
                        .map(|i| {
                            let spec = RequestSpec { max_tokens: 2, ..long_request(&format!("t{t}-{i}")) };
                            h.add_request(spec).unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|j| j.join().unwrap()).collect()
    });
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 100);
    let mut exec = FakeExecutor::new(VOCAB);
    let mut seen = Seen::default();
    drive(&h, &mut exec, &mut seen, Duration::from_secs(30), |s| s.finished.len() == 100);
    assert!(ids.iter().all(|id| seen.tokens[id].len() == 2));
    h.shutdown(Duration::from_secs(5)).unwrap();
}

/// A request's sample attachments reach the executor in the plan that admits each sample,
/// and a step result's attachment reaches the output thread in that step's event: the
/// data crosses the channels, nothing is shared beside them.
#[test]
fn attachments_travel_with_plans_and_events() {
    let h = EngineHandle::start(config(2)).unwrap();
    let spec = RequestSpec {
        request_id: "with-params".into(),
        prompt: vec![1, 2, 3],
        max_tokens: 3,
        ignore_eos: true,
        n: 2,
        sample_attachments: vec![Attachment::new("sample-0"), Attachment::new("sample-1")],
        ..Default::default()
    };
    let first = h.add_request(spec).unwrap();
    let mut exec = FakeExecutor::new(VOCAB);
    let mut admitted = BTreeMap::new();
    let mut step_attachments = 0;
    let mut finished = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while finished < 2 {
        assert!(Instant::now() < deadline, "no progress");
        if let Some(plan) = h.next_plan(Some(Duration::from_millis(2))).unwrap() {
            assert_eq!(plan.new_attachments.len(), plan.new_seq_ids.len());
            for (seq, a) in plan.new_seq_ids.iter().zip(&plan.new_attachments) {
                let label = *a.as_ref().expect("attachment given").get::<&str>().unwrap();
                admitted.insert(*seq, label);
            }
            let sampled = exec.run(&plan);
            h.submit_result(plan.step_id, sampled, Some(Attachment::new(plan.step_id))).unwrap();
        }
        while let Some(ev) = h.next_output(Some(Duration::ZERO)).unwrap() {
            if let Some(step) = ev.step_id {
                assert_eq!(ev.step_attachment.as_ref().and_then(|a| a.get::<u64>()), Some(&step));
                step_attachments += 1;
            }
            finished += ev.finished_seq_ids.len();
        }
    }
    assert_eq!(admitted, BTreeMap::from([(first, "sample-0"), (first + 1, "sample-1")]));
    assert!(step_attachments >= 3);
    h.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn sample_attachments_must_match_n() {
    let h = EngineHandle::start(config(1)).unwrap();
    let spec = RequestSpec {
        request_id: "bad".into(),
        prompt: vec![1],
        max_tokens: 1,
        n: 2,
        sample_attachments: vec![Attachment::new(())],
        ..Default::default()
    };
    assert!(matches!(h.add_request(spec), Err(SchedError::InvalidRequest { .. })));
}
