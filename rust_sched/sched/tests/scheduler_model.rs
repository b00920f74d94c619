//! Model-based property test of the scheduler: random sequences of add / schedule / apply /
//! fail / abort / finish run in lock-step against a naive model of what the executor and
//! the output thread see.
//!
//! The model plays the executor: it keeps each row's block table (from the plan's
//! block-table writes), each row's known tokens (announced tokens plus its samples) and a KV
//! store keyed by slot whose value identifies the exact token prefix that produced it. Every
//! plan is checked against that model (budget, rows, slot mapping, placeholders, continuity
//! of each sequence's positions), every scheduled row re-reads its whole context from the KV
//! store (so a block shared, cached, evicted or reallocated at the wrong time shows up as
//! a content mismatch), and block reference counts are compared with the owners the model
//! derives from plans and output events. Output events are checked against the stop rules
//! (max_tokens, min_tokens, EOS, stop ids) computed independently. A failed step writes
//! poison into its slots, so KV reused from it is caught by the same content check.
//!
//! With every KV group windowed (`kv_groups.rs`), the model derives on its own which
//! leading blocks each scheduled row no longer reads (those behind the window of its first
//! query); they must be gone from the pool's owners, table writes skip them, and each row
//! re-reads only the positions its window reaches, so a block freed too early shows up as
//! a content mismatch. Some cases are hybrid (a full group beside a windowed one): with
//! one shared table nothing is freed early then; with per-group tables (`group_tables`)
//! the model keeps every table of every row (writes routed by `block_table_groups`, slots
//! checked against `group_slot_mapping`), applies the same rule to each table by its own
//! window, and tags each table's KV content with the table, so a block of one table read
//! as another's (a prefix hit under the wrong table's key) is a content mismatch too.
//!
//! `PROPTEST_CASES=N` changes the case count of both properties (defaults: 512 and 256).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use proptest::prelude::*;
use proptest::sample::Index;
use pyengine_sched::kv_groups::blocks_behind;
use pyengine_sched::sim::{fake_token, FakeExecutor};
use pyengine_sched::{
    Attachment, FinishReason, KvGroup, Policy, RequestSpec, SchedError, Scheduler, SchedulerConfig, StepPlan,
    PLACEHOLDER_TOKEN,
};

/// Prompt tokens come from a tiny vocabulary so that prefixes repeat and the cache hits.
const PROMPT_VOCAB: u32 = 4;
/// Sampled tokens too, so that EOS and stop ids are drawn often.
const SAMPLE_VOCAB: u32 = 8;
const MAX_PROMPT: usize = 80;
/// A table entry behind the window, in the model's tables.
const NULL_ENTRY: i32 = -1;
/// KV content of a slot whose step failed.
const POISON: u64 = 0xDEAD_BEEF;

// ---------------------------------------------------------------- generated inputs ----

#[derive(Debug, Clone)]
struct ReqGen {
    stem: usize,
    stem_len: usize,
    suffix: Vec<u32>,
    max_tokens: usize,
    min_tokens: usize,
    eos: Vec<u32>,
    ignore_eos: bool,
    stop: Vec<u32>,
    priority: i64,
    n: usize,
    pooling: bool,
    salt: bool,
    /// Reuse the id of an earlier request (live: rejected as a duplicate; ended: accepted).
    reuse_id: Option<Index>,
}

#[derive(Debug, Clone)]
enum Op {
    Add(ReqGen),
    /// Plan one step; the executor model runs it at once (plans run in order).
    Schedule,
    /// Report the oldest in-flight step.
    Apply,
    Abort(Index),
    Finish(Index),
    /// Report the oldest in-flight step as failed (`fail_step`), when it is the only one in
    /// flight; otherwise apply it.
    Fail,
}

#[derive(Debug, Clone)]
enum Sampler {
    /// `pyengine_sched::sim::fake_token`: a function of (sequence id, position).
    Fake,
    /// Tokens drawn by proptest, handed out in turn.
    Drawn(Vec<u32>),
}

#[derive(Debug, Clone)]
struct Case {
    config: SchedulerConfig,
    stems: Vec<Vec<u32>>,
    sampler: Sampler,
    ops: Vec<Op>,
}

fn config_strategy() -> impl Strategy<Value = SchedulerConfig> {
    (
        1usize..=8,                               // block_size
        prop_oneof![40usize..120, 120usize..600], // tiny / small pool, in tokens
        1usize..=8,                               // max_num_seqs
        prop_oneof![Just(0usize), 0usize..40],    // budget beyond max_num_seqs
        prop_oneof![Just(64usize), Just(128usize)],
        prop_oneof![Just(0usize), 1usize..12],
        any::<bool>(),
        any::<bool>(),
        1usize..=2,
        (kv_groups_strategy(), any::<bool>()),
    )
        .prop_map(
            |(bs, pool_tokens, seqs, extra, mml, thr, caching, prio, depth, (kv_groups, tables))| {
                SchedulerConfig {
                    num_blocks: pool_tokens.div_ceil(bs),
                    block_size: bs,
                    max_num_seqs: seqs,
                    max_num_batched_tokens: seqs + extra,
                    max_model_len: mml,
                    long_prefill_token_threshold: thr,
                    enable_prefix_caching: caching,
                    enable_kv_events: false,
                    policy: if prio { Policy::Priority } else { Policy::Fcfs },
                    pipeline_depth: depth,
                    kv_groups,
                    group_tables: tables,
                    ..SchedulerConfig::default()
                }
            },
        )
}

/// No groups (full attention), every group windowed (blocks freed behind the widest
/// window) or hybrid (a full group keeps every block).
fn kv_groups_strategy() -> impl Strategy<Value = Vec<KvGroup>> {
    prop_oneof![
        2 => Just(Vec::new()),
        3 => (1usize..48, prop::option::of(1usize..48))
            .prop_map(|(w, w2)| {
                let mut g = vec![KvGroup::windowed(w, 2)];
                g.extend(w2.map(|w2| KvGroup::windowed(w2, 1)));
                g
            }),
        1 => (1usize..48).prop_map(|w| vec![KvGroup::windowed(w, 3), KvGroup::full(1)]),
        // Gemma 2 (alternating) and Qwen2-like (more full layers than windowed ones).
        2 => (1usize..48).prop_map(|w| vec![KvGroup::windowed(w, 1), KvGroup::full(1)]),
        1 => (1usize..48).prop_map(|w| vec![KvGroup::full(2), KvGroup::windowed(w, 1)]),
    ]
}

fn req_strategy() -> impl Strategy<Value = ReqGen> {
    (
        (0usize..3, 0usize..=MAX_PROMPT, prop::collection::vec(0..PROMPT_VOCAB, 0..12)),
        (1usize..24, prop_oneof![Just(0usize), 0usize..6]),
        (
            prop::collection::vec(0..SAMPLE_VOCAB, 0..2),
            any::<bool>(),
            prop::collection::vec(0..SAMPLE_VOCAB, 0..2),
        ),
        (-2i64..3, 1usize..=3, prop::bool::weighted(0.1), prop::bool::weighted(0.1)),
        prop::option::weighted(0.15, any::<Index>()),
    )
        .prop_map(
            |(
                (stem, stem_len, suffix),
                (max_tokens, min_tokens),
                (eos, ignore_eos, stop),
                (priority, n, pooling, salt),
                reuse_id,
            )| {
                ReqGen {
                    stem,
                    stem_len,
                    suffix,
                    max_tokens,
                    min_tokens,
                    eos,
                    ignore_eos,
                    stop,
                    priority,
                    n: if pooling { 1 } else { n },
                    pooling,
                    salt,
                    reuse_id,
                }
            },
        )
}

fn op_strategy(with_commands: bool) -> BoxedStrategy<Op> {
    let base = prop_oneof![
        3 => req_strategy().prop_map(Op::Add),
        4 => Just(Op::Schedule),
        4 => Just(Op::Apply),
    ];
    if with_commands {
        prop_oneof![
            11 => base,
            1 => any::<Index>().prop_map(Op::Abort),
            1 => any::<Index>().prop_map(Op::Finish),
            1 => Just(Op::Fail),
        ]
        .boxed()
    } else {
        base.boxed()
    }
}

fn case_strategy(with_commands: bool, fake_only: bool) -> impl Strategy<Value = Case> {
    let sampler = if fake_only {
        Just(Sampler::Fake).boxed()
    } else {
        prop_oneof![
            Just(Sampler::Fake),
            prop::collection::vec(0..SAMPLE_VOCAB, 1..64).prop_map(Sampler::Drawn),
        ]
        .boxed()
    };
    (
        config_strategy(),
        prop::collection::vec(prop::collection::vec(0..PROMPT_VOCAB, MAX_PROMPT), 3),
        sampler,
        prop::collection::vec(op_strategy(with_commands), 1..200),
    )
        .prop_map(|(config, stems, sampler, ops)| Case { config, stems, sampler, ops })
}

// ------------------------------------------------------------------------- model ----

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// Holds no blocks.
    None,
    /// Holds `blocks` for sure.
    Holding,
    /// Holds `blocks` unless it was preempted in a `schedule()` that returned no plan (the
    /// preemption only becomes visible in the next plan's `freed_rows`).
    Uncertain,
}

#[derive(Debug)]
struct SeqModel {
    request: usize,
    prompt: Vec<u32>,
    accepted: Vec<u32>,
    finished: Option<FinishReason>,
    /// Row as the executor sees it (until a plan lists it in `freed_rows`).
    row: Option<i32>,
    /// Its block tables (one per table of the layout; entries of freed blocks are nulls).
    blocks: Vec<Vec<i32>>,
    hold: Hold,
    /// In-flight plans that schedule this sequence.
    inflight: usize,
    announced: u32,
}

#[derive(Debug)]
struct ReqModel {
    id: String,
    spec: RequestSpec,
    first_seq: u64,
    live: usize,
}

#[derive(Debug)]
struct RowModel {
    seq: u64,
    /// One block table per table of the layout (`Model::windows`).
    table: Vec<Vec<i32>>,
    /// Tokens the executor knows for this row: announced ones, then its samples.
    tokens: Vec<u32>,
    /// `prefix[q]` identifies tokens[..=q]: the content KV position q must hold.
    prefix: Vec<u64>,
    /// Context length after the last plan that scheduled this row.
    computed: usize,
}

impl RowModel {
    fn push_token(&mut self, t: u32) {
        let prev = self.prefix.last().copied().unwrap_or(0x51_7cc1_b727_220a);
        let mut x = prev ^ (u64::from(t) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 29;
        self.tokens.push(t);
        self.prefix.push(x);
    }
}

#[derive(Debug)]
struct InflightModel {
    step_id: u64,
    seqs: Vec<u64>,
    sampled_seqs: Vec<u64>,
    pooled: Vec<u64>,
    tokens: Vec<i64>,
    /// KV slots the plan writes (garbage if the step fails).
    slots: Vec<i64>,
}

struct Model {
    cfg: SchedulerConfig,
    /// The window of each block table: the layout's with per-group tables, else the one
    /// shared table's (the shared window, or None).
    windows: Vec<Option<usize>>,
    sched: Scheduler,
    fake: FakeExecutor,
    sampler: Sampler,
    draw: usize,
    stems: Vec<Vec<u32>>,
    seqs: BTreeMap<u64, SeqModel>,
    reqs: Vec<ReqModel>,
    live_ids: HashMap<String, usize>,
    used_ids: Vec<String>,
    next_seq: u64,
    next_step: u64,
    rows: HashMap<i32, RowModel>,
    kv: HashMap<i64, u64>,
    inflight: VecDeque<InflightModel>,
    prev_sample_rows: HashSet<i32>,
    preemptions_seen: u64,
    next_req_name: usize,
}

fn expected_valid(spec: &RequestSpec, cfg: &SchedulerConfig) -> bool {
    let len = spec.prompt.len();
    if len == 0 || spec.n == 0 || spec.n > cfg.max_num_seqs {
        return false;
    }
    let tables = cfg.table_layout().map_or(1, |l| l.num_tables());
    let total = if spec.pooling {
        if spec.n != 1 || len > cfg.max_num_batched_tokens {
            return false;
        }
        len
    } else {
        if spec.max_tokens == 0 || spec.min_tokens > spec.max_tokens {
            return false;
        }
        len + spec.max_tokens
    };
    total <= cfg.max_model_len && total.div_ceil(cfg.block_size) * tables <= cfg.num_blocks
}

/// The stop rule, written out again: what accepting `token` as output number `count` does.
fn expected_stop(
    spec: &RequestSpec,
    prompt_len: usize,
    count: usize,
    token: u32,
    max_model_len: usize,
) -> Option<(FinishReason, i64)> {
    if count >= spec.min_tokens
        && ((!spec.ignore_eos && spec.eos_token_ids.contains(&token)) || spec.stop_token_ids.contains(&token))
    {
        return Some((FinishReason::Stop, i64::from(token)));
    }
    if count >= spec.max_tokens || prompt_len + count >= max_model_len {
        return Some((FinishReason::Length, -1));
    }
    None
}

impl Model {
    fn new(cfg: SchedulerConfig, stems: Vec<Vec<u32>>, sampler: Sampler) -> Self {
        let windows = cfg.table_layout().map(|l| l.windows);
        Model {
            windows: windows.unwrap_or_else(|| vec![cfg.shared_window()]),
            sched: Scheduler::new(cfg.clone()).expect("generated configs are valid"),
            cfg,
            fake: FakeExecutor::new(SAMPLE_VOCAB),
            sampler,
            draw: 0,
            stems,
            seqs: BTreeMap::new(),
            reqs: Vec::new(),
            live_ids: HashMap::new(),
            used_ids: Vec::new(),
            next_seq: 0,
            next_step: 0,
            rows: HashMap::new(),
            kv: HashMap::new(),
            inflight: VecDeque::new(),
            prev_sample_rows: HashSet::new(),
            preemptions_seen: 0,
            next_req_name: 0,
        }
    }

    fn run(&mut self, op: &Op) {
        match op {
            Op::Add(g) => self.add(g),
            Op::Schedule => self.schedule(),
            Op::Apply => self.apply(),
            Op::Abort(i) => self.abort(*i),
            Op::Finish(i) => self.finish(*i),
            Op::Fail => self.fail(),
        }
        self.check();
    }

    fn spec_of(&mut self, g: &ReqGen) -> RequestSpec {
        let mut prompt: Vec<u32> = self.stems[g.stem][..g.stem_len].to_vec();
        prompt.extend_from_slice(&g.suffix);
        prompt.truncate(MAX_PROMPT);
        if prompt.is_empty() {
            prompt.push(1);
        }
        let request_id = match g.reuse_id {
            Some(i) if !self.used_ids.is_empty() => i.get(&self.used_ids).clone(),
            _ => {
                self.next_req_name += 1;
                format!("req-{}", self.next_req_name)
            }
        };
        RequestSpec {
            request_id,
            prompt,
            max_tokens: g.max_tokens,
            min_tokens: g.min_tokens,
            eos_token_ids: g.eos.clone(),
            ignore_eos: g.ignore_eos,
            stop_token_ids: g.stop.clone(),
            priority: g.priority,
            pooling: g.pooling,
            n: g.n,
            cache_salt: g.salt.then(|| "tenant".to_string()),
            // Each sample's attachment is the id it will get, so every plan that admits it
            // (again after a preemption) can be checked to carry its own.
            sample_attachments: (0..g.n as u64).map(|i| Attachment::new(self.next_seq + i)).collect(),
            constraint: None,
            no_spec: false,
        }
    }

    fn add(&mut self, g: &ReqGen) {
        let spec = self.spec_of(g);
        self.add_spec(spec);
    }

    fn add_spec(&mut self, spec: RequestSpec) -> Option<u64> {
        let valid = expected_valid(&spec, &self.cfg);
        let live = self.live_ids.contains_key(&spec.request_id);
        let result = self.sched.add_request(spec.clone());
        match result {
            Ok(first) => {
                assert!(valid && !live, "accepted {spec:?} (valid {valid}, live {live})");
                assert_eq!(first, self.next_seq, "sequence ids are consecutive");
                self.next_seq += spec.n as u64;
                let idx = self.reqs.len();
                for k in 0..spec.n as u64 {
                    self.seqs.insert(
                        first + k,
                        SeqModel {
                            request: idx,
                            prompt: spec.prompt.clone(),
                            accepted: Vec::new(),
                            finished: None,
                            row: None,
                            blocks: Vec::new(),
                            hold: Hold::None,
                            inflight: 0,
                            announced: 0,
                        },
                    );
                }
                self.live_ids.insert(spec.request_id.clone(), idx);
                if !self.used_ids.contains(&spec.request_id) {
                    self.used_ids.push(spec.request_id.clone());
                }
                self.reqs.push(ReqModel {
                    id: spec.request_id.clone(),
                    first_seq: first,
                    live: spec.n,
                    spec,
                });
                Some(first)
            }
            Err(SchedError::InvalidRequest { .. }) => {
                assert!(!valid, "rejected a valid request {spec:?}");
                None
            }
            Err(SchedError::DuplicateRequest(id)) => {
                assert!(valid && live, "duplicate error for {id:?} (valid {valid}, live {live})");
                None
            }
            Err(e) => panic!("unexpected add_request error {e}"),
        }
    }

    fn num_live_requests(&self) -> usize {
        self.live_ids.len()
    }

    fn schedule(&mut self) {
        let can_plan = self.sched.can_plan();
        assert_eq!(can_plan, self.inflight.len() < self.cfg.pipeline_depth);
        let idle = self.inflight.is_empty();
        match self.sched.schedule() {
            Some(plan) => {
                assert!(can_plan, "planned with a full pipeline");
                self.on_plan(plan);
            }
            None => {
                assert!(
                    !(idle && self.num_live_requests() > 0),
                    "no progress: {} live requests, nothing in flight, yet no plan",
                    self.num_live_requests()
                );
                let pre = self.sched.counters().preemptions;
                if pre != self.preemptions_seen {
                    // Preempted without a plan: who lost its blocks shows in the next plan.
                    for seq in self.seqs.values_mut() {
                        if seq.row.is_some() && seq.finished.is_none() && seq.hold == Hold::Holding {
                            seq.hold = Hold::Uncertain;
                        }
                    }
                }
            }
        }
        self.preemptions_seen = self.sched.counters().preemptions;
    }

    fn sample(&mut self, seq: u64, position: usize) -> u32 {
        match &self.sampler {
            Sampler::Fake => fake_token(seq, position, SAMPLE_VOCAB),
            Sampler::Drawn(v) => {
                let t = v[self.draw % v.len()];
                self.draw += 1;
                t
            }
        }
    }

    fn on_plan(&mut self, plan: StepPlan) {
        let cfg = self.cfg.clone();
        let bs = cfg.block_size;
        let r_count = plan.rows.len();
        let t_count = plan.input_ids.len();
        // -- shape, budget, caps
        assert_eq!(plan.step_id, self.next_step, "step ids increase by one");
        self.next_step += 1;
        assert!(r_count > 0);
        assert!(r_count <= cfg.max_num_seqs, "{r_count} rows > max_num_seqs");
        assert_eq!(plan.num_scheduled_tokens.len(), r_count);
        assert_eq!(plan.seq_lens.len(), r_count);
        assert_eq!(plan.query_start_loc.len(), r_count + 1);
        assert_eq!(plan.query_start_loc[0], 0);
        let total: i64 = plan.num_scheduled_tokens.iter().map(|&n| i64::from(n)).sum();
        assert!(total as usize <= cfg.max_num_batched_tokens, "budget exceeded: {total}");
        assert_eq!(total as usize, t_count);
        for i in 0..r_count {
            let n = plan.num_scheduled_tokens[i];
            assert!(n > 0);
            assert_eq!(plan.query_start_loc[i + 1] - plan.query_start_loc[i], n);
        }
        assert_eq!(plan.positions.len(), t_count);
        assert_eq!(plan.slot_mapping.len(), t_count);
        assert_eq!(plan.logits_indices.len(), plan.sample_rows.len());
        let b_count = plan.block_table_ids.len();
        assert_eq!(plan.block_table_rows.len(), b_count);
        assert_eq!(plan.block_table_cols.len(), b_count);
        let k_count = plan.new_rows.len();
        assert_eq!(plan.new_seq_ids.len(), k_count);
        assert_eq!(plan.new_num_prompt_tokens.len(), k_count);
        assert_eq!(plan.new_attachments.len(), k_count);
        if k_count > 0 {
            assert_eq!(plan.new_token_offsets.len(), k_count + 1);
            assert_eq!(plan.new_token_offsets[0], 0);
            assert_eq!(*plan.new_token_offsets.last().unwrap() as usize, plan.new_token_ids.len());
        } else {
            assert!(plan.new_token_ids.is_empty());
        }
        let mut unique = HashSet::new();
        for &r in &plan.rows {
            assert!(r >= 0 && (r as usize) < cfg.max_num_seqs, "row {r} out of range");
            assert!(unique.insert(r), "row {r} twice in one plan");
        }

        // -- rows released since the previous plan
        let mut unique = HashSet::new();
        for &r in &plan.freed_rows {
            assert!(unique.insert(r), "row {r} freed twice in one plan");
            let row = self.rows.remove(&r).unwrap_or_else(|| panic!("freed row {r} was not held"));
            let seq = self.seqs.get_mut(&row.seq).unwrap();
            seq.row = None;
            if seq.finished.is_none() {
                // Preempted: its blocks went back at once.
                seq.hold = Hold::None;
                seq.blocks.clear();
            }
        }
        for row in self.rows.values() {
            let seq = self.seqs.get_mut(&row.seq).unwrap();
            assert!(seq.finished.is_none(), "sequence {} ended but its row is not in freed_rows", row.seq);
            // Not freed, so not preempted.
            seq.hold = Hold::Holding;
        }

        // -- sequences entering the batch
        let mut new_rows = HashSet::new();
        for k in 0..k_count {
            let r = plan.new_rows[k];
            let id = plan.new_seq_ids[k];
            let attached = plan.new_attachments[k].as_ref().and_then(|a| a.get::<u64>());
            assert_eq!(attached, Some(&id), "sequence {id} admitted without its own attachment");
            assert!(r >= 0 && (r as usize) < cfg.max_num_seqs);
            assert!(!self.rows.contains_key(&r), "row {r} handed out while held");
            new_rows.insert(r);
            let seq = self.seqs.get_mut(&id).unwrap_or_else(|| panic!("unknown new sequence {id}"));
            assert!(seq.finished.is_none(), "ended sequence {id} enters the batch");
            assert!(seq.row.is_none(), "sequence {id} enters the batch twice");
            assert_eq!(seq.hold, Hold::None, "sequence {id} re-enters while holding blocks");
            let (a, b) = (plan.new_token_offsets[k] as usize, plan.new_token_offsets[k + 1] as usize);
            let known: Vec<u32> = seq.prompt.iter().chain(&seq.accepted).copied().collect();
            let announced: Vec<u32> = plan.new_token_ids[a..b].iter().map(|&t| t as u32).collect();
            assert_eq!(announced, known, "announced tokens of sequence {id}");
            assert_eq!(plan.new_num_prompt_tokens[k] as usize, seq.prompt.len());
            seq.row = Some(r);
            seq.hold = Hold::Holding;
            seq.blocks.clear();
            seq.announced += 1;
            let mut row = RowModel {
                seq: id,
                table: vec![Vec::new(); self.windows.len()],
                tokens: Vec::new(),
                prefix: Vec::new(),
                computed: 0,
            };
            for t in known {
                row.push_token(t);
            }
            self.rows.insert(r, row);
        }

        // Each scheduled row handed back the blocks behind its first query's window, in
        // every windowed table, before this plan's blocks were taken (which may reuse
        // them): the model drops them from what the sequence holds.
        let windows = self.windows.clone();
        let num_tables = windows.len();
        for i in 0..r_count {
            let r = plan.rows[i];
            let start = (plan.seq_lens[i] - plan.num_scheduled_tokens[i]) as usize;
            let row = self.rows.get_mut(&r).unwrap_or_else(|| panic!("scheduled free row {r}"));
            for (table, w) in row.table.iter_mut().zip(&windows) {
                if let Some(w) = *w {
                    let behind = blocks_behind(start, w, bs).min(table.len());
                    table[..behind].fill(NULL_ENTRY);
                }
            }
            self.seqs.get_mut(&row.seq).unwrap().blocks = row.table.clone();
        }

        // -- block-table writes: appended in column order, each to its table
        if num_tables > 1 {
            assert_eq!(plan.block_table_groups.len(), b_count, "a table for every write");
            assert_eq!(plan.group_slot_mapping.len(), t_count * (num_tables - 1));
        } else {
            assert!(plan.block_table_groups.is_empty() && plan.group_slot_mapping.is_empty());
        }
        let mut plan_blocks = HashSet::new();
        for i in 0..b_count {
            let (r, c, b) = (plan.block_table_rows[i], plan.block_table_cols[i], plan.block_table_ids[i]);
            let t = plan.block_table_groups.get(i).map_or(0, |&t| t as usize);
            assert!(t < num_tables, "write to table {t} of {num_tables}");
            assert!(b >= 0 && (b as usize) < cfg.num_blocks, "block {b} out of range");
            let row = self.rows.get_mut(&r).unwrap_or_else(|| panic!("table write to free row {r}"));
            let table = &mut row.table[t];
            if c as usize > table.len() {
                // Only a new row's entries behind its window are skipped (checked below).
                assert!(windows[t].is_some(), "row {r} table {t}: table writes must append");
                assert!(new_rows.contains(&r), "row {r}: a running row's table write skips columns");
                table.resize(c as usize, NULL_ENTRY);
            }
            assert_eq!(c as usize, table.len(), "row {r} table {t}: table writes must append");
            assert!(plan_blocks.insert((r, b)), "row {r} is given block {b} twice");
            assert!(row.table.iter().all(|table| !table.contains(&b)), "row {r} holds block {b} twice");
            row.table[t].push(b);
            self.seqs.get_mut(&row.seq).unwrap().blocks = row.table.clone();
        }

        // -- tokens: positions, placeholders, slot mapping, KV writes
        let mut slots = HashSet::new();
        let mut pool_rows = HashSet::new();
        for &p in &plan.pool_indices {
            assert!(p >= 0 && (p as usize) < r_count);
            assert!(pool_rows.insert(p as usize));
        }
        let mut starts = Vec::with_capacity(r_count);
        let mut extra_slots = Vec::new();
        for i in 0..r_count {
            let r = plan.rows[i];
            let n = plan.num_scheduled_tokens[i] as usize;
            let end = plan.seq_lens[i] as usize;
            assert!(end >= n && end <= cfg.max_model_len);
            let start = end - n;
            starts.push(start);
            let row = self.rows.get_mut(&r).unwrap_or_else(|| panic!("scheduled free row {r}"));
            let seq = &self.seqs[&row.seq];
            assert!(seq.finished.is_none(), "scheduled ended sequence {}", row.seq);
            if new_rows.contains(&r) {
                // Starts after its reused prefix (whole blocks), before its last known token.
                assert_eq!(start % bs, 0, "row {r}: reused prefix is not whole blocks");
                assert!(start < row.tokens.len(), "row {r}: nothing left to compute");
            } else {
                assert_eq!(start, row.computed, "row {r}: positions must continue");
            }
            row.computed = end;
            for table in &row.table {
                assert!(table.len() * bs >= end, "row {r}: {end} tokens in {} blocks", table.len());
                assert_eq!(table.len(), row.table[0].len(), "row {r}: tables of unequal lengths");
            }
            let first = plan.query_start_loc[i] as usize;
            for j in 0..n {
                let t = first + j;
                let pos = start + j;
                assert_eq!(plan.positions[t] as usize, pos);
                let id = plan.input_ids[t];
                if id == PLACEHOLDER_TOKEN {
                    assert_eq!(j, 0, "placeholder not first in its sequence");
                    assert!(cfg.pipeline_depth > 1, "placeholder at depth 1");
                    assert!(!new_rows.contains(&r), "placeholder for a new row");
                    assert!(
                        self.prev_sample_rows.contains(&r),
                        "placeholder: row {r} did not sample last plan"
                    );
                    assert_eq!(pos + 1, row.tokens.len(), "placeholder is not the last sample");
                } else {
                    assert!(pos < row.tokens.len(), "row {r}: token at {pos} is not known");
                    assert_eq!(id, i64::from(row.tokens[pos]), "row {r}: wrong token at {pos}");
                }
                for (k, table) in row.table.iter().enumerate() {
                    assert_ne!(table[pos / bs], NULL_ENTRY, "row {r} table {k}: writes a freed block");
                    let slot = i64::from(table[pos / bs]) * bs as i64 + (pos % bs) as i64;
                    let planned = if k == 0 {
                        plan.slot_mapping[t]
                    } else {
                        plan.group_slot_mapping[t * (num_tables - 1) + k - 1]
                    };
                    assert_eq!(planned, slot, "row {r} table {k} position {pos}: slot");
                    assert!(slots.insert(slot), "slot {slot} written twice in one plan");
                    self.kv.insert(slot, table_content(k, row.prefix[pos]));
                    if k > 0 {
                        extra_slots.push(slot);
                    }
                }
            }
            let seq = &self.seqs[&row.seq];
            let spec = &self.reqs[seq.request].spec;
            if pool_rows.contains(&i) {
                assert!(spec.pooling, "pool_indices lists a generating sequence");
                assert_eq!((start, end), (0, seq.prompt.len()), "pooling prompt not in one piece");
            } else {
                assert!(!spec.pooling, "pooling sequence scheduled but not pooled");
            }
        }
        // Every scheduled row reads its whole context after the step's writes, in every
        // table (a windowed one: what its first query's window reaches onwards).
        for (i, &start) in starts.iter().enumerate() {
            let r = plan.rows[i];
            let row = &self.rows[&r];
            for (k, (table, w)) in row.table.iter().zip(&windows).enumerate() {
                let lo = w.map_or(0, |w| (start + 1).saturating_sub(w));
                for q in lo..plan.seq_lens[i] as usize {
                    assert_ne!(
                        table[q / bs],
                        NULL_ENTRY,
                        "row {r} table {k}: position {q} in its window is freed"
                    );
                    let slot = i64::from(table[q / bs]) * bs as i64 + (q % bs) as i64;
                    assert_eq!(
                        self.kv.get(&slot),
                        Some(&table_content(k, row.prefix[q])),
                        "KV of sequence {} table {k} at position {q} (slot {slot}) is not its own",
                        row.seq
                    );
                }
            }
        }

        // -- sampling
        let fake_out = self.fake.run(&plan);
        let mut sampled_rows = HashSet::new();
        let mut record = InflightModel {
            step_id: plan.step_id,
            seqs: Vec::new(),
            sampled_seqs: Vec::new(),
            pooled: Vec::new(),
            tokens: Vec::new(),
            slots: [plan.slot_mapping.clone(), extra_slots].concat(),
        };
        for (k, (&idx, &r)) in plan.logits_indices.iter().zip(&plan.sample_rows).enumerate() {
            let i = plan.rows.iter().position(|&x| x == r).expect("sampled row is scheduled");
            assert_eq!(idx, i64::from(plan.query_start_loc[i + 1] - 1), "sample not at the chunk's end");
            assert!(!pool_rows.contains(&i));
            assert!(sampled_rows.insert(r), "row {r} sampled twice");
            let pos = plan.positions[idx as usize] as usize;
            let seq_id = self.rows[&r].seq;
            assert_eq!(pos + 1, self.rows[&r].tokens.len(), "sampled before the last known token");
            let tok = self.sample(seq_id, pos + 1);
            if let Sampler::Fake = self.sampler {
                assert_eq!(fake_out[k], i64::from(tok));
            }
            self.rows.get_mut(&r).unwrap().push_token(tok);
            record.sampled_seqs.push(seq_id);
            record.tokens.push(i64::from(tok));
        }
        for i in 0..r_count {
            let r = plan.rows[i];
            let row = &self.rows[&r];
            if !pool_rows.contains(&i) && !sampled_rows.contains(&r) {
                assert!(
                    (plan.seq_lens[i] as usize) < row.tokens.len(),
                    "row {r} reached its last known token but does not sample"
                );
            }
            record.seqs.push(row.seq);
            if pool_rows.contains(&i) {
                record.pooled.push(row.seq);
            }
            self.seqs.get_mut(&row.seq).unwrap().inflight += 1;
        }
        self.prev_sample_rows = sampled_rows;
        self.inflight.push_back(record);
    }

    /// The executor failed the oldest step: its KV writes never happened and every
    /// sequence in it that had not ended ends with `error`. Only the sole in-flight step
    /// fails here: a later plan would already build on the failed one.
    fn fail(&mut self) {
        if self.inflight.len() != 1 {
            return self.apply();
        }
        let step = self.inflight.pop_front().unwrap();
        self.sched.fail_step(step.step_id).expect("failure accepted");
        for slot in &step.slots {
            self.kv.insert(*slot, POISON);
        }
        let ev = self.sched.take_output(Some(step.step_id));
        assert!(ev.seq_ids.is_empty(), "a failed step yields no tokens");
        let want = step
            .seqs
            .iter()
            .filter(|id| self.seqs[id].finished.is_none())
            .map(|&id| (id, (FinishReason::Error, -1)))
            .collect();
        self.check_finished(&ev, &want);
        self.retire(&step);
    }

    fn retire(&mut self, step: &InflightModel) {
        for &id in &step.seqs {
            let seq = self.seqs.get_mut(&id).unwrap();
            seq.inflight -= 1;
            if seq.finished.is_some() && seq.inflight == 0 {
                seq.hold = Hold::None;
                seq.blocks.clear();
            }
        }
    }

    fn apply(&mut self) {
        let Some(step) = self.inflight.pop_front() else {
            assert!(self.sched.apply_result(self.next_step, &[]).is_err());
            return;
        };
        self.sched.apply_result(step.step_id, &step.tokens).expect("result accepted");
        let ev = self.sched.take_output(Some(step.step_id));
        assert_eq!(ev.step_id, Some(step.step_id));
        // Tokens: every sample of a sequence that had not ended, in step order.
        let mut want_tokens = Vec::new();
        let mut want_finished: BTreeMap<u64, (FinishReason, i64)> = BTreeMap::new();
        for (&id, &tok) in step.sampled_seqs.iter().zip(&step.tokens) {
            let seq = self.seqs.get_mut(&id).unwrap();
            if seq.finished.is_some() {
                continue;
            }
            want_tokens.push((id, tok));
            seq.accepted.push(tok as u32);
            let spec = &self.reqs[seq.request].spec;
            assert!(seq.accepted.len() <= spec.max_tokens, "sequence {id} exceeds max_tokens");
            if let Some(stop) =
                expected_stop(spec, seq.prompt.len(), seq.accepted.len(), tok as u32, self.cfg.max_model_len)
            {
                want_finished.insert(id, stop);
            }
        }
        for &id in &step.pooled {
            if self.seqs[&id].finished.is_none() {
                want_finished.insert(id, (FinishReason::Pooled, -1));
            }
        }
        let got_tokens: Vec<(u64, i64)> =
            ev.seq_ids.iter().copied().zip(ev.token_ids.iter().copied()).collect();
        assert_eq!(got_tokens, want_tokens, "accepted tokens of step {}", step.step_id);
        self.check_finished(&ev, &want_finished);
        self.retire(&step);
    }

    /// Compares an event's ended sequences with the expected ones and records them.
    fn check_finished(
        &mut self,
        ev: &pyengine_sched::OutputEvent,
        want: &BTreeMap<u64, (FinishReason, i64)>,
    ) {
        let f = ev.finished_seq_ids.len();
        for v in [&ev.finish_reasons.len(), &ev.stop_token_ids.len()] {
            assert_eq!(*v, f);
        }
        for v in [&ev.num_prompt_tokens, &ev.num_cached_tokens, &ev.num_output_tokens, &ev.num_preemptions] {
            assert_eq!(v.len(), f);
        }
        let mut got = BTreeMap::new();
        for i in 0..f {
            let id = ev.finished_seq_ids[i];
            let reason =
                FinishReason::parse(pyengine_sched::FINISH_REASONS[ev.finish_reasons[i] as usize]).unwrap();
            assert!(got.insert(id, (reason, ev.stop_token_ids[i])).is_none(), "sequence {id} ended twice");
            let seq = self.seqs.get_mut(&id).unwrap();
            assert!(seq.finished.is_none(), "sequence {id} ended again");
            assert_eq!(ev.num_prompt_tokens[i] as usize, seq.prompt.len());
            assert_eq!(ev.num_output_tokens[i] as usize, seq.accepted.len());
            assert!(ev.num_cached_tokens[i] as usize <= seq.prompt.len());
            assert!(ev.num_preemptions[i] as u32 + 1 >= seq.announced, "preemptions undercounted");
            seq.finished = Some(reason);
            if seq.inflight == 0 {
                seq.hold = Hold::None;
                seq.blocks.clear();
            }
            let req = &mut self.reqs[seq.request];
            req.live -= 1;
            if req.live == 0 {
                self.live_ids.remove(&req.id);
            }
        }
        assert_eq!(&got, want, "ended sequences");
    }

    fn abort(&mut self, pick: Index) {
        let mut ids = self.used_ids.clone();
        ids.push("never-added".into());
        let id = pick.get(&ids).clone();
        let live = self.live_ids.get(&id).copied();
        assert_eq!(self.sched.abort(&id), live.is_some(), "abort({id:?})");
        let ev = self.sched.take_output(None);
        assert!(ev.seq_ids.is_empty());
        let mut want = BTreeMap::new();
        if let Some(idx) = live {
            let req = &self.reqs[idx];
            for s in req.first_seq..req.first_seq + req.spec.n as u64 {
                if self.seqs[&s].finished.is_none() {
                    want.insert(s, (FinishReason::Abort, -1));
                }
            }
        }
        self.check_finished(&ev, &want);
    }

    fn finish(&mut self, pick: Index) {
        let id = pick.index(self.next_seq as usize + 1) as u64;
        let result = self.sched.finish(id, FinishReason::Stop);
        let ev = self.sched.take_output(None);
        let mut want = BTreeMap::new();
        if id >= self.next_seq {
            assert!(matches!(result, Err(SchedError::Unknown { .. })), "{result:?}");
        } else {
            let live = self.seqs[&id].finished.is_none();
            assert_eq!(result, Ok(live), "finish({id})");
            if live {
                want.insert(id, (FinishReason::Stop, -1));
            }
        }
        assert!(ev.seq_ids.is_empty());
        self.check_finished(&ev, &want);
    }

    fn check(&self) {
        let s = &self.sched;
        if let Err(e) = s.check_invariants() {
            panic!("scheduler invariant broken: {e}");
        }
        let usage = s.pool().usage();
        assert_eq!(usage.free + usage.used, usage.total);
        assert_eq!(usage.total, self.cfg.num_blocks);
        assert!(usage.evictable <= usage.free);
        let mut lo = vec![0u32; self.cfg.num_blocks];
        let mut hi = vec![0u32; self.cfg.num_blocks];
        for seq in self.seqs.values() {
            if seq.hold == Hold::None {
                continue;
            }
            // Behind the window of its next query, a block may already be handed back
            // (planning visited the row) even if no plan shows it yet.
            let computed = seq.row.and_then(|r| self.rows.get(&r)).map_or(0, |row| row.computed);
            for (table, w) in seq.blocks.iter().zip(&self.windows) {
                let maybe_freed = w.map_or(0, |w| blocks_behind(computed, w, self.cfg.block_size));
                for (j, &b) in table.iter().enumerate() {
                    if b == NULL_ENTRY {
                        continue;
                    }
                    hi[b as usize] += 1;
                    if seq.hold == Hold::Holding && j >= maybe_freed {
                        lo[b as usize] += 1;
                    }
                }
            }
        }
        let mut used = 0;
        for b in 0..self.cfg.num_blocks {
            let rc = s.pool().ref_count(b as u32);
            assert!(
                lo[b] <= rc && rc <= hi[b],
                "block {b}: reference count {rc}, the model expects {}..={}",
                lo[b],
                hi[b]
            );
            used += usize::from(rc > 0);
        }
        assert_eq!(used, usage.used);
        assert_eq!(s.num_live_requests(), self.num_live_requests());
        assert_eq!(s.has_unfinished(), self.num_live_requests() > 0 || !self.inflight.is_empty());
        assert_eq!(s.num_inflight(), self.inflight.len());
    }

    /// Schedules and applies until nothing is unfinished; then everything must be free.
    fn drain(&mut self) {
        for _ in 0..100_000 {
            if !self.sched.has_unfinished() {
                break;
            }
            while self.sched.can_plan() {
                let before = self.inflight.len();
                self.schedule();
                self.check();
                if self.inflight.len() == before {
                    break;
                }
            }
            self.apply();
            self.check();
        }
        assert!(!self.sched.has_unfinished(), "did not drain");
        assert_eq!(self.sched.pool().usage().used, 0, "blocks leaked");
        assert!(self.rows.values().all(|r| self.seqs[&r.seq].finished.is_some()));
        for (id, seq) in &self.seqs {
            let reason = seq.finished.unwrap_or_else(|| panic!("sequence {id} never ended"));
            let spec = &self.reqs[seq.request].spec;
            assert!(seq.accepted.len() <= spec.max_tokens);
            if reason == FinishReason::Length {
                assert!(
                    seq.accepted.len() == spec.max_tokens
                        || seq.prompt.len() + seq.accepted.len() >= self.cfg.max_model_len
                );
            }
        }
    }

    /// Output tokens and end reason of every sequence.
    fn streams(&self) -> BTreeMap<u64, (Vec<u32>, Option<FinishReason>)> {
        self.seqs.iter().map(|(&id, s)| (id, (s.accepted.clone(), s.finished))).collect()
    }
}

fn run_case(case: &Case) -> Model {
    let mut m = Model::new(case.config.clone(), case.stems.clone(), case.sampler.clone());
    for op in &case.ops {
        m.run(op);
    }
    m.drain();
    if std::env::var_os("MODEL_STATS").is_some() {
        let c = m.sched.counters();
        let p = m.sched.pool().prefix_stats();
        let reasons: Vec<_> = m.seqs.values().map(|s| s.finished.unwrap().name()).collect();
        eprintln!(
            "reqs {} steps {} preempt {} window-freed {} hit {}/{} gen {} discarded {} stop {} len {} abort {} pooled {}",
            m.reqs.len(),
            c.steps_planned,
            c.preemptions,
            c.window_freed_blocks,
            p.hit_tokens,
            p.queried_tokens,
            c.generated_tokens,
            c.discarded_tokens,
            reasons.iter().filter(|r| **r == "stop").count(),
            reasons.iter().filter(|r| **r == "length").count(),
            reasons.iter().filter(|r| **r == "abort").count(),
            reasons.iter().filter(|r| **r == "pooled").count(),
        );
    }
    m
}

/// The same accepted requests on a pool and batch that never preempt, depth 1.
fn reference_streams(m: &Model) -> BTreeMap<u64, (Vec<u32>, Option<FinishReason>)> {
    let cfg = SchedulerConfig {
        max_num_seqs: 512,
        max_num_batched_tokens: 1 << 16,
        pipeline_depth: 1,
        long_prefill_token_threshold: 0,
        ..m.cfg.clone()
    };
    // Room for every sample's whole sequence at once: no preemption.
    let num_blocks: usize = m
        .reqs
        .iter()
        .map(|r| r.spec.n * (r.spec.prompt.len() + r.spec.max_tokens).div_ceil(m.cfg.block_size))
        .sum::<usize>()
        * m.windows.len();
    let cfg = SchedulerConfig { num_blocks: num_blocks.max(1), ..cfg };
    let mut r = Model::new(cfg, m.stems.clone(), Sampler::Fake);
    for (i, req) in m.reqs.iter().enumerate() {
        let spec = RequestSpec { request_id: format!("ref-{i}"), ..req.spec.clone() };
        assert_eq!(r.add_spec(spec), Some(req.first_seq));
    }
    r.drain();
    assert_eq!(r.sched.counters().preemptions, 0);
    r.streams()
}

/// What KV position `q` holds in block table `table`, for content `prefix`: tagged with
/// the table, since a block holds one table's layers.
fn table_content(table: usize, prefix: u64) -> u64 {
    if table == 0 {
        prefix
    } else {
        prefix ^ (table as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)
    }
}

/// `PROPTEST_CASES` overrides the default case count of each property.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(512),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Every operation, every check, then a full drain.
    #[test]
    fn scheduler_matches_model(case in case_strategy(true, false)) {
        run_case(&case);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(256),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Without aborts and external finishes, FakeExecutor token streams do not depend on the
    /// pool, the batch, the pipeline depth or preemptions.
    #[test]
    fn token_streams_match_unconstrained_reference(case in case_strategy(false, true)) {
        let m = run_case(&case);
        prop_assert_eq!(m.streams(), reference_streams(&m));
    }
}

/// A hand-written case that must preempt: many long requests on a tiny pool at depth 2.
#[test]
fn tiny_pool_preempts_and_still_matches_reference() {
    let config = SchedulerConfig {
        num_blocks: 12,
        block_size: 4,
        max_num_seqs: 6,
        max_num_batched_tokens: 16,
        max_model_len: 48,
        long_prefill_token_threshold: 5,
        enable_prefix_caching: true,
        enable_kv_events: false,
        policy: Policy::Fcfs,
        pipeline_depth: 2,
        ..SchedulerConfig::default()
    };
    let stems: Vec<Vec<u32>> =
        (0..3).map(|s| (0..MAX_PROMPT as u32).map(|t| (t * 7 + s) % PROMPT_VOCAB).collect()).collect();
    let mut ops = Vec::new();
    for i in 0..8 {
        ops.push(Op::Add(ReqGen {
            stem: i % 3,
            stem_len: 9 + i,
            suffix: vec![],
            max_tokens: 20,
            min_tokens: 0,
            eos: vec![],
            ignore_eos: true,
            stop: vec![],
            priority: 0,
            n: 1 + i % 2,
            pooling: false,
            salt: false,
            reuse_id: None,
        }));
    }
    let m = run_case(&Case { config, stems, sampler: Sampler::Fake, ops });
    assert!(m.sched.counters().preemptions > 0, "the pool was meant to force preemption");
    assert_eq!(m.streams(), reference_streams(&m));
}

/// Regression: a request's sample that ended while waiting gave its sequence index back; a
/// later request took the index, and aborting the first request then aborted the later one
/// too.
#[test]
fn abort_does_not_touch_a_reused_seq_index() {
    let config =
        SchedulerConfig { num_blocks: 64, block_size: 4, max_num_seqs: 4, ..SchedulerConfig::default() };
    let mut s = Scheduler::new(config).unwrap();
    let spec = |id: &str, n: usize| RequestSpec {
        request_id: id.into(),
        prompt: vec![1, 2, 3],
        max_tokens: 4,
        n,
        ..Default::default()
    };
    let first = s.add_request(spec("pair", 2)).unwrap();
    assert_eq!(s.finish(first, FinishReason::Stop), Ok(true));
    let other = s.add_request(spec("other", 1)).unwrap();
    s.take_output(None);
    assert!(s.abort("pair"));
    let ev = s.take_output(None);
    assert_eq!(ev.finished_seq_ids, vec![first + 1], "only the live sample of 'pair' ends");
    assert_eq!(s.num_live_requests(), 1, "'other' ({other}) is still live");
    s.check_invariants().unwrap();
}

/// A failed step never wrote its KV: a later request must not find the blocks that step
/// filled in the prefix cache.
#[test]
fn failed_step_leaves_nothing_in_the_prefix_cache() {
    let config = SchedulerConfig {
        num_blocks: 64,
        block_size: 4,
        max_num_seqs: 4,
        max_num_batched_tokens: 64,
        pipeline_depth: 1,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(config).unwrap();
    let spec = |id: &str| RequestSpec {
        request_id: id.into(),
        prompt: (0..9).collect(),
        max_tokens: 2,
        ignore_eos: true,
        n: 1,
        ..Default::default()
    };
    s.add_request(spec("a")).unwrap();
    let p = s.schedule().unwrap();
    s.fail_step(p.step_id).unwrap();
    s.check_invariants().unwrap();
    s.add_request(spec("b")).unwrap();
    let p = s.schedule().unwrap();
    assert_eq!(p.positions.first(), Some(&0), "b reuses KV the failed step never wrote");
    assert_eq!(s.pool().prefix_stats().hit_tokens, 0);
}
