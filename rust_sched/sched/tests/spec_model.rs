//! Property test of speculative decoding in the scheduler: random workloads on tiny pools
//! (preemption), random acceptance, aborts and failed steps. After every step the
//! scheduler's invariants hold; once everything ended the pool is full again; every block
//! the prefix cache holds has the content of committed tokens only; and with a greedy
//! verifier (`MarkovExecutor`) the outputs equal a run without speculation. Some cases are
//! a hybrid model with per-group tables (a windowed table beside the full one), whose
//! rewinds give back every table's blocks for rejected drafts.

use std::collections::{HashMap, HashSet, VecDeque};

use proptest::prelude::*;
use pyengine_sched::block_hash::{extend_block_hashes, BlockHash};
use pyengine_sched::sim::{MarkovExecutor, VerifiedStep};
use pyengine_sched::{KvGroup, RequestSpec, Scheduler, SchedulerConfig, SpecMethod, SpecResult, StepPlan};

const VOCAB: u32 = 9;

#[derive(Debug, Clone)]
struct Case {
    block_size: usize,
    num_blocks: usize,
    depth: usize,
    k: usize,
    method: SpecMethod,
    budget: usize,
    prompts: Vec<(Vec<u32>, usize)>,
    /// A hybrid model's window (a windowed layer beside a full one, per-group tables).
    hybrid: Option<usize>,
    /// Per step: a random number for the acceptance double, whether to abort, to fail.
    noise: Vec<(u32, bool, bool)>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(2usize), Just(4)],
        6usize..20,
        1usize..=2,
        1usize..=4,
        prop_oneof![Just(SpecMethod::Ngram), Just(SpecMethod::Suffix)],
        8usize..24,
        prop::collection::vec((prop::collection::vec(0u32..VOCAB, 1..10), 1usize..14), 1..7),
        prop::collection::vec((any::<u32>(), prop::bool::weighted(0.03), prop::bool::weighted(0.02)), 400),
        prop::option::weighted(0.3, 1usize..12),
    )
        .prop_map(|(block_size, num_blocks, depth, k, method, budget, prompts, noise, hybrid)| Case {
            block_size,
            // Room for the longest request in every table.
            num_blocks: num_blocks
                .max((9 + 14usize).div_ceil(block_size) * if hybrid.is_some() { 2 } else { 1 }),
            hybrid,
            depth,
            k,
            method,
            budget,
            prompts,
            noise,
        })
}

fn config(c: &Case, speculate: bool) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks: c.num_blocks,
        block_size: c.block_size,
        max_num_seqs: 4,
        max_num_batched_tokens: c.budget,
        max_model_len: 64,
        pipeline_depth: c.depth,
        num_speculative_tokens: if speculate { c.k } else { 0 },
        speculative_method: if speculate { c.method } else { SpecMethod::None },
        spec_min_acceptance: 0.0,
        kv_groups: c.hybrid.map_or_else(Vec::new, |w| vec![KvGroup::windowed(w, 1), KvGroup::full(1)]),
        group_tables: true,
        ..SchedulerConfig::default()
    }
}

fn add_all(s: &mut Scheduler, c: &Case) -> HashMap<u64, Vec<u32>> {
    let mut prompts = HashMap::new();
    for (i, (prompt, max_tokens)) in c.prompts.iter().enumerate() {
        let spec = RequestSpec {
            request_id: format!("r{i}"),
            prompt: prompt.clone(),
            max_tokens: *max_tokens,
            ignore_eos: true,
            n: 1,
            ..Default::default()
        };
        let id = s.add_request(spec).unwrap();
        prompts.insert(id, prompt.clone());
    }
    prompts
}

/// The acceptance double: a random number of each sequence's drafts, then a random token.
fn random_result(plan: &StepPlan, r: u32) -> VerifiedStep {
    let with_drafts = !plan.num_draft_tokens.is_empty();
    let n = if with_drafts { plan.num_draft_tokens.len() } else { plan.num_samples() };
    let mut out = VerifiedStep::default();
    let mut acc = Vec::new();
    let mut at = 0;
    let mut x = r;
    for k in 0..n {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let d = if with_drafts { plan.num_draft_tokens[k] as usize } else { 0 };
        let a = (x >> 16) as usize % (d + 1);
        out.sampled.extend_from_slice(&plan.draft_token_ids[at..at + a]);
        out.sampled.push(i64::from((x >> 8) % VOCAB));
        acc.push(a as i32);
        at += d;
    }
    if with_drafts {
        out.num_accepted = Some(acc);
    }
    out
}

/// Runs a case to the end; returns each sequence's emitted tokens.
fn run(s: &mut Scheduler, c: &Case, markov: bool, commands: bool) -> HashMap<u64, Vec<u32>> {
    let mut exec = MarkovExecutor::new(VOCAB);
    let mut outputs: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut pending: VecDeque<(u64, VerifiedStep)> = VecDeque::new();
    let mut step = 0usize;
    for _ in 0..10_000 {
        while let Some(plan) = s.schedule() {
            s.check_invariants().unwrap();
            let (r, _, _) = c.noise[step % c.noise.len()];
            let result = if markov { exec.run(&plan) } else { random_result(&plan, r) };
            pending.push_back((plan.step_id, result));
        }
        let Some((id, result)) = pending.pop_front() else {
            assert!(!s.has_unfinished(), "nothing in flight but requests unfinished");
            return outputs;
        };
        let (_, abort, fail) = c.noise[step % c.noise.len()];
        step += 1;
        if commands && abort {
            s.abort(&format!("r{}", step % c.prompts.len()));
        }
        if commands && fail {
            s.fail_step(id).unwrap();
        } else {
            let spec = SpecResult { num_accepted: result.num_accepted.as_deref(), next_drafts: None };
            s.apply_spec_result(id, &result.sampled, spec).unwrap();
        }
        s.check_invariants().unwrap();
        let ev = s.take_output(Some(id));
        for (seq, tok) in ev.seq_ids.iter().zip(&ev.token_ids) {
            outputs.entry(*seq).or_default().push(*tok as u32);
        }
    }
    panic!("did not finish");
}

fn committed_hashes(
    prompts: &HashMap<u64, Vec<u32>>,
    outputs: &HashMap<u64, Vec<u32>>,
    bs: usize,
    tables: usize,
) -> HashSet<BlockHash> {
    let mut all = HashSet::new();
    for (seq, prompt) in prompts {
        let mut tokens = prompt.clone();
        tokens.extend(outputs.get(seq).into_iter().flatten());
        let mut hashes = Vec::new();
        extend_block_hashes(&mut hashes, &tokens, bs, None);
        // A hybrid model's other table caches the same tokens under its own key.
        all.extend(hashes.iter().flat_map(|h| (0..tables).map(|t| h.for_table(t))));
    }
    all
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn random_acceptance_aborts_and_failures_leak_nothing(c in case()) {
        let mut s = Scheduler::new(config(&c, true)).unwrap();
        let prompts = add_all(&mut s, &c);
        let outputs = run(&mut s, &c, false, true);
        let usage = s.pool().usage();
        prop_assert_eq!(usage.used, 0);
        prop_assert_eq!(usage.free, c.num_blocks);
        let tables = if c.hybrid.is_some() { 2 } else { 1 };
        let committed = committed_hashes(&prompts, &outputs, c.block_size, tables);
        for b in 0..c.num_blocks as u32 {
            if let Some(h) = s.pool().hash_of(b) {
                prop_assert!(committed.contains(&h), "block {} cached with content nobody committed", b);
            }
        }
    }

    #[test]
    fn greedy_verification_equals_decoding_without_drafts(c in case()) {
        let mut plain = Scheduler::new(config(&c, false)).unwrap();
        add_all(&mut plain, &c);
        let want = run(&mut plain, &c, true, false);
        let mut spec = Scheduler::new(config(&c, true)).unwrap();
        add_all(&mut spec, &c);
        let got = run(&mut spec, &c, true, false);
        prop_assert_eq!(got, want);
        prop_assert_eq!(spec.pool().usage().used, 0);
    }
}

/// A fixed case that exercises what the properties are about: drafts accepted and
/// rejected, preemptions on a tiny pool, aborts and a failed step.
#[test]
fn a_tiny_pool_case_drafts_preempts_and_still_leaks_nothing() {
    let c = Case {
        block_size: 2,
        num_blocks: 14,
        depth: 2,
        k: 3,
        method: SpecMethod::Ngram,
        budget: 12,
        prompts: (0..6).map(|i| ((0..9).map(|t| (t * 2 + i) % 4).collect(), 13)).collect(),
        hybrid: None,
        noise: (0..400u32).map(|i| (i.wrapping_mul(2_654_435_761), i % 41 == 7, i % 97 == 50)).collect(),
    };
    let mut s = Scheduler::new(config(&c, true)).unwrap();
    add_all(&mut s, &c);
    run(&mut s, &c, false, true);
    let snap = s.snapshot();
    assert!(snap.counters.preemptions > 0);
    assert!(snap.spec.drafts > 0 && snap.spec.accepted_tokens > 0);
    assert!(snap.spec.accepted_tokens < snap.spec.draft_tokens, "some drafts were rejected");
    assert_eq!(s.pool().usage().used, 0);
    let mut plain = Scheduler::new(config(&c, false)).unwrap();
    add_all(&mut plain, &c);
    let want = run(&mut plain, &c, true, false);
    let mut spec = Scheduler::new(config(&c, true)).unwrap();
    add_all(&mut spec, &c);
    assert_eq!(run(&mut spec, &c, true, false), want);
    assert!(spec.snapshot().counters.preemptions > 0);
}
