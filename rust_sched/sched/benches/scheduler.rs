//! Scheduler hot paths, without an executor: every timed iteration is one
//! `schedule()` + `apply_result()` + `take_output()` at pipeline depth 1, with fixed
//! sampled tokens. State is prepared (and restored) outside the timed part with
//! `iter_custom`, so only the step itself is measured.
//!
//! - `decode_step/N`: steady-state decode of N running requests (512-token prompts).
//! - `prefill_burst`: one step while 256 requests of 2048 tokens wait, budget 8192.
//! - `prefix_hit_admission/M`: M requests sharing a cached 2048-token prefix, all admitted
//!   in one step (each computes only its 16-token tail).
//!
//! - `spec_decode_step/{ngram,suffix}/1024`: the decode step of 1024 sequences with
//!   speculation on (k = 4), every draft rejected (the result is one new random token per
//!   sequence), so the state stays a steady decode; the proposer scans each sequence's
//!   600-odd tokens every step and rarely finds a match (random tokens, vocab 32,000),
//!   its worst case. Its time per step alone is printed from the scheduler's counters.
//!
//! `cargo bench --bench scheduler` measures; `cargo test --benches` runs each once.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pyengine_sched::sim::{fake_token, uniform_requests};
use pyengine_sched::{RequestSpec, Scheduler, SchedulerConfig, SpecMethod, SpecResult};

/// The same allocator the extension module uses (see `rust_sched/python/src/lib.rs`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BLOCK_SIZE: usize = 16;
const VOCAB: u32 = 32_000;

/// Runs one step with `sampled` tokens (resized to the plan's sampled sequences; drafts,
/// if any, all rejected); returns the plan.
fn step(s: &mut Scheduler, sampled: &mut Vec<i64>) -> pyengine_sched::StepPlan {
    let plan = s.schedule().expect("something to schedule");
    if plan.num_draft_tokens.is_empty() {
        sampled.resize(plan.num_samples(), 0);
        s.apply_result(plan.step_id, sampled).expect("result accepted");
    } else {
        let seqs = plan.num_draft_tokens.len();
        sampled.resize(seqs, 0);
        let accepted = vec![0; seqs];
        let spec = SpecResult { num_accepted: Some(&accepted), next_drafts: None };
        s.apply_spec_result(plan.step_id, sampled, spec).expect("result accepted");
    }
    black_box(s.take_output(Some(plan.step_id)));
    plan
}

// ---------------------------------------------------------------- decode step ----

const DECODE_PROMPT: usize = 512;
/// Timed steps before the state is rebuilt; sequences grow by this many tokens, so block
/// allocation (every 16th step per sequence) is part of what is measured.
const DECODE_WINDOW: usize = 256;

struct DecodeState {
    s: Scheduler,
    steps: usize,
}

/// N requests admitted and prefilled; the next step is a pure decode of all N.
fn decode_state(n: usize) -> DecodeState {
    decode_state_with(n, 0, SpecMethod::None)
}

/// [`decode_state`] with `k` drafts per sequence by `method` (0 and None: off).
fn decode_state_with(n: usize, k: usize, method: SpecMethod) -> DecodeState {
    let budget = n.max(16_384);
    // Never reached within a window, counting the tokens the first requests decode while
    // the last ones are still in prefill.
    let max_tokens = DECODE_WINDOW + (n * DECODE_PROMPT).div_ceil(budget) + 64;
    let total = DECODE_PROMPT + max_tokens;
    let config = SchedulerConfig {
        num_blocks: n * total.div_ceil(BLOCK_SIZE) + 16,
        block_size: BLOCK_SIZE,
        max_num_seqs: n,
        max_num_batched_tokens: budget,
        max_model_len: total,
        pipeline_depth: 1,
        num_speculative_tokens: k,
        speculative_method: method,
        spec_min_acceptance: 0.0,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(config).unwrap();
    for spec in uniform_requests(n, DECODE_PROMPT, max_tokens, VOCAB) {
        s.add_request(spec).unwrap();
    }
    let mut sampled = Vec::new();
    loop {
        let plan = step(&mut s, &mut sampled);
        // Every sequence decodes one token (plus its drafts) and samples.
        let drafts: usize = plan.num_draft_tokens.iter().map(|&d| d as usize).sum();
        let sampling =
            if plan.num_draft_tokens.is_empty() { plan.num_samples() } else { plan.num_draft_tokens.len() };
        if plan.num_tokens() == n + drafts && sampling == n {
            break;
        }
    }
    DecodeState { s, steps: 0 }
}

fn bench_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_step");
    for n in [64usize, 256, 1024, 4096] {
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            let mut state = decode_state(n);
            let sampled = vec![0i64; n];
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    if state.steps == DECODE_WINDOW {
                        state = decode_state(n);
                    }
                    let t = Instant::now();
                    let seqs = decode_step(&mut state.s, &sampled);
                    timed += t.elapsed();
                    assert_eq!(seqs, n, "every request decodes");
                    state.steps += 1;
                }
                timed
            });
        });
    }
    group.finish();
}

/// One decode step answered with `sampled` (one token per sequence); returns the number
/// of sequences it scheduled.
fn decode_step(s: &mut Scheduler, sampled: &[i64]) -> usize {
    let plan = s.schedule().expect("decoding");
    s.apply_result(plan.step_id, &sampled[..plan.num_samples()]).expect("result accepted");
    black_box(s.take_output(Some(plan.step_id)));
    plan.num_seqs()
}

const SPEC_SEQS: usize = 1024;
const SPEC_K: usize = 4;

/// One decode step with speculation on, every draft rejected: one new token per sequence.
fn spec_decode_step(
    s: &mut Scheduler,
    serial: u64,
    sampled: &mut Vec<i64>,
    accepted: &mut Vec<i32>,
) -> usize {
    let plan = s.schedule().expect("decoding");
    let seqs = plan.num_seqs();
    sampled.clear();
    sampled.extend((0..seqs).map(|i| i64::from(fake_token(serial, i, VOCAB))));
    accepted.clear();
    accepted.resize(seqs, 0);
    let spec = if plan.num_draft_tokens.is_empty() {
        SpecResult::default()
    } else {
        SpecResult { num_accepted: Some(accepted), next_drafts: None }
    };
    s.apply_spec_result(plan.step_id, sampled, spec).expect("result accepted");
    black_box(s.take_output(Some(plan.step_id)));
    seqs
}

fn bench_spec_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("spec_decode_step");
    group.throughput(Throughput::Elements(SPEC_SEQS as u64));
    let mut proposer = Vec::new();
    for method in [SpecMethod::Ngram, SpecMethod::Suffix] {
        let (mut propose_ns, mut steps) = (0u64, 0u64);
        group.bench_function(BenchmarkId::new(method.name(), SPEC_SEQS), |b| {
            let mut state = decode_state_with(SPEC_SEQS, SPEC_K, method);
            let (mut sampled, mut accepted) = (Vec::new(), Vec::new());
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    if state.steps == DECODE_WINDOW {
                        state = decode_state_with(SPEC_SEQS, SPEC_K, method);
                    }
                    let before = state.s.snapshot().spec.propose_ns;
                    let t = Instant::now();
                    let seqs = spec_decode_step(&mut state.s, steps, &mut sampled, &mut accepted);
                    timed += t.elapsed();
                    propose_ns += state.s.snapshot().spec.propose_ns - before;
                    steps += 1;
                    assert_eq!(seqs, SPEC_SEQS, "every request decodes");
                    state.steps += 1;
                }
                timed
            });
        });
        proposer.push((method, propose_ns, steps));
    }
    group.finish();
    for (method, ns, steps) in proposer {
        println!(
            "spec_decode_step/{}/{SPEC_SEQS}: proposer {:.1} us per step (mean of {steps} steps, every sequence)",
            method.name(),
            ns as f64 / steps.max(1) as f64 * 1e-3
        );
    }
}

// -------------------------------------------------------------- prefill burst ----

const BURST_REQUESTS: usize = 256;
const BURST_PROMPT: usize = 2048;
const BURST_BUDGET: usize = 8192;

/// A 2048-token request whose prompt no other request shares.
fn distinct_request(serial: u64, len: usize, max_tokens: usize) -> RequestSpec {
    RequestSpec {
        request_id: format!("r{serial}"),
        prompt: (0..len).map(|p| fake_token(serial, p, VOCAB)).collect(),
        max_tokens,
        ignore_eos: true,
        n: 1,
        ..Default::default()
    }
}

struct BurstState {
    s: Scheduler,
    serial: u64,
    /// Request id of each sequence id.
    ids: std::collections::HashMap<u64, String>,
}

impl BurstState {
    fn new() -> Self {
        let config = SchedulerConfig {
            num_blocks: BURST_REQUESTS * (BURST_PROMPT + 64).div_ceil(BLOCK_SIZE),
            block_size: BLOCK_SIZE,
            max_num_seqs: BURST_REQUESTS,
            max_num_batched_tokens: BURST_BUDGET,
            max_model_len: 4096,
            pipeline_depth: 1,
            ..SchedulerConfig::default()
        };
        let mut state = BurstState { s: Scheduler::new(config).unwrap(), serial: 0, ids: Default::default() };
        for _ in 0..BURST_REQUESTS {
            state.add();
        }
        state
    }

    fn add(&mut self) {
        self.serial += 1;
        let spec = distinct_request(self.serial, BURST_PROMPT, 64);
        let id = spec.request_id.clone();
        let seq = self.s.add_request(spec).unwrap();
        self.ids.insert(seq, id);
    }

    /// Puts the burst back as it was: the requests the step admitted are replaced by new
    /// waiting ones with prompts nobody has cached.
    fn restore(&mut self, admitted: &[u64]) {
        for seq in admitted {
            let id = self.ids.remove(seq).unwrap();
            self.s.abort(&id);
            self.add();
        }
        black_box(self.s.take_output(None));
    }
}

fn bench_prefill_burst(c: &mut Criterion) {
    let mut group = c.benchmark_group("prefill_burst");
    group.throughput(Throughput::Elements(BURST_BUDGET as u64));
    group.bench_function(BenchmarkId::new("256x2048_budget8192", BURST_BUDGET), |b| {
        let mut state = BurstState::new();
        let mut sampled = Vec::new();
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                let plan = step(&mut state.s, &mut sampled);
                timed += t.elapsed();
                assert_eq!(plan.num_tokens(), BURST_BUDGET);
                state.restore(&plan.new_seq_ids);
            }
            timed
        });
    });
    group.finish();
}

// ------------------------------------------------------- prefix-hit admission ----

const SHARED_PREFIX: usize = 2048;
const TAIL: usize = 16;

struct PrefixState {
    s: Scheduler,
    m: usize,
    serial: u64,
    prefix: Vec<u32>,
}

impl PrefixState {
    fn new(m: usize) -> Self {
        let config = SchedulerConfig {
            num_blocks: SHARED_PREFIX / BLOCK_SIZE + 4 * m + 16,
            block_size: BLOCK_SIZE,
            max_num_seqs: m,
            max_num_batched_tokens: (m * TAIL).max(SHARED_PREFIX + TAIL),
            max_model_len: 4096,
            pipeline_depth: 1,
            ..SchedulerConfig::default()
        };
        let prefix: Vec<u32> = (0..SHARED_PREFIX).map(|p| fake_token(u64::MAX, p, VOCAB)).collect();
        let mut state = PrefixState { s: Scheduler::new(config).unwrap(), m, serial: 0, prefix };
        // One request computes the prefix and leaves it cached.
        let warm = state.request();
        let id = warm.request_id.clone();
        state.s.add_request(warm).unwrap();
        step(&mut state.s, &mut Vec::new());
        state.s.abort(&id);
        state.s.take_output(None);
        state.refill();
        state
    }

    fn request(&mut self) -> RequestSpec {
        self.serial += 1;
        let mut prompt = self.prefix.clone();
        prompt.extend((0..TAIL).map(|p| fake_token(self.serial, p, VOCAB)));
        RequestSpec {
            request_id: format!("p{}", self.serial % (4 * self.m as u64)),
            prompt,
            max_tokens: 64,
            ignore_eos: true,
            n: 1,
            ..Default::default()
        }
    }

    /// M waiting requests that share the cached prefix.
    fn refill(&mut self) {
        for _ in 0..self.m {
            let spec = self.request();
            self.s.add_request(spec).unwrap();
        }
    }

    fn restore(&mut self) {
        let first = self.serial - self.m as u64 + 1;
        for serial in first..=self.serial {
            self.s.abort(&format!("p{}", serial % (4 * self.m as u64)));
        }
        black_box(self.s.take_output(None));
        self.refill();
    }
}

fn bench_prefix_hit(c: &mut Criterion) {
    let mut group = c.benchmark_group("prefix_hit_admission");
    for m in [16usize, 64, 256] {
        group.throughput(Throughput::Elements(m as u64));
        group.bench_with_input(BenchmarkId::from_parameter(m), &m, |b, &m| {
            let mut state = PrefixState::new(m);
            let mut sampled = Vec::new();
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let plan = step(&mut state.s, &mut sampled);
                    timed += t.elapsed();
                    assert_eq!(plan.new_seq_ids.len(), m, "all admitted in one step");
                    assert_eq!(plan.num_tokens(), m * TAIL, "only the tails are computed");
                    state.restore();
                }
                timed
            });
        });
    }
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_decode, bench_spec_decode, bench_prefill_burst, bench_prefix_hit
}
criterion_main!(benches);
