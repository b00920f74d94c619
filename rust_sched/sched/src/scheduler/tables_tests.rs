//! Per-group block tables (`tables.rs`): a hybrid model's windowed tables hold a bounded
//! number of blocks at long context while its full table keeps every block, prefix hits
//! need each table's blocks, and preemption, forks and drafts give every block back.

use super::tables::TableHit;
use super::*;
use crate::kv_groups::KvGroup;
use crate::sim::FakeExecutor;

const BS: usize = 4;

fn config(num_blocks: usize, groups: Vec<KvGroup>, depth: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size: BS,
        max_num_seqs: 8,
        max_num_batched_tokens: 16,
        max_model_len: 1024,
        pipeline_depth: depth,
        kv_groups: groups,
        group_tables: true,
        ..SchedulerConfig::default()
    }
}

fn request(id: &str, prompt: Vec<u32>, max_tokens: usize, n: usize) -> RequestSpec {
    RequestSpec { request_id: id.into(), prompt, max_tokens, ignore_eos: true, n, ..Default::default() }
}

/// Runs everything to the end; returns the most blocks in use after any plan.
fn run(s: &mut Scheduler) -> usize {
    run_with(s, &mut FakeExecutor::new(1000))
}

fn run_with(s: &mut Scheduler, exec: &mut FakeExecutor) -> usize {
    let mut pending: VecDeque<(u64, Vec<i64>)> = VecDeque::new();
    let mut most = 0;
    for _ in 0..100_000 {
        while let Some(plan) = s.schedule() {
            s.check_invariants().unwrap();
            most = most.max(s.pool().usage().used);
            pending.push_back((plan.step_id, exec.run(&plan)));
        }
        let Some((step, sampled)) = pending.pop_front() else {
            assert!(!s.has_unfinished());
            return most;
        };
        s.apply_result(step, &sampled).unwrap();
        s.check_invariants().unwrap();
        s.take_output(Some(step));
    }
    panic!("did not finish");
}

/// Gemma 2's shape: one windowed layer to one full.
fn gemma2(window: usize) -> Vec<KvGroup> {
    vec![KvGroup::windowed(window, 1), KvGroup::full(1)]
}

#[test]
fn a_hybrid_models_windowed_table_holds_a_bounded_number_of_blocks() {
    for depth in [1, 2] {
        let mut s = Scheduler::new(config(400, gemma2(10), depth)).unwrap();
        s.add_request(request("a", (0..30).collect(), 300, 1)).unwrap();
        let most = run(&mut s);
        // The full table holds all 330 tokens (83 blocks); the windowed one at most the
        // window's 4 blocks, a prefill chunk's 4 more and the block being filled.
        let full = 330usize.div_ceil(BS);
        assert!(most > full && most <= full + 10, "depth {depth}: {most} blocks in use at once");
        assert_eq!(s.pool().usage().used, 0, "blocks leaked");
        assert!(s.counters().window_freed_blocks >= 70);
    }
}

#[test]
fn the_shared_table_keeps_every_block_without_group_tables() {
    let mut cfg = config(400, gemma2(10), 1);
    cfg.group_tables = false;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("a", (0..30).collect(), 100, 1)).unwrap();
    assert_eq!(run(&mut s), 130usize.div_ceil(BS));
    assert_eq!(s.counters().window_freed_blocks, 0);
}

#[test]
fn every_table_grows_and_the_plan_says_which() {
    // Gemma 3's shape in small: 5 windowed layers to 1 full, 6 tables of one layer.
    let groups = vec![KvGroup::windowed(8, 5), KvGroup::full(1)];
    let mut s = Scheduler::new(config(200, groups, 1)).unwrap();
    s.add_request(request("a", (0..10).collect(), 4, 1)).unwrap();
    let plan = s.schedule().unwrap();
    // 10 tokens: 3 blocks in each of 6 tables.
    assert_eq!(plan.block_table_groups, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5]);
    assert_eq!(plan.group_slot_mapping.len(), 10 * 5);
    let ids = &plan.block_table_ids;
    // Token 5 sits in column 1, slot 1 of its block, in every table.
    for t in 1..6 {
        assert_eq!(plan.group_slot_mapping[5 * 5 + t - 1], i64::from(ids[t * 3 + 1]) * BS as i64 + 1);
    }
    assert_eq!(s.pool().usage().used, 18);
}

#[test]
fn a_repeated_prompt_hits_every_table() {
    let mut s = Scheduler::new(config(400, gemma2(8), 1)).unwrap();
    let prompt: Vec<u32> = (0..41).collect();
    s.add_request(request("a", prompt.clone(), 20, 1)).unwrap();
    run(&mut s);
    // Its windowed blocks behind the window were offered to the cache before they went.
    s.add_request(request("b", prompt, 4, 1)).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.num_scheduled_tokens, [1], "all but the last prompt token hit");
    // Table 0 announces every block of the hit; the windowed table only those its window
    // reaches from position 40 (33..=40: blocks 8, 9 and the new 10th).
    let cols = |t: i32| -> Vec<i32> {
        (0..plan.block_table_ids.len())
            .filter(|&i| plan.block_table_groups[i] == t)
            .map(|i| plan.block_table_cols[i])
            .collect()
    };
    assert_eq!(cols(0), (0..11).collect::<Vec<_>>());
    assert_eq!(cols(1), vec![8, 9, 10]);
    let mut exec = FakeExecutor::new(1000);
    let sampled = exec.run(&plan);
    s.apply_result(plan.step_id, &sampled).unwrap();
    run_with(&mut s, &mut exec);
    assert_eq!(s.pool().usage().used, 0);
}

#[test]
fn a_hit_is_where_every_table_agrees() {
    // Window 8 tokens in blocks of 4: a hit of k blocks needs the windowed table's blocks
    // behind(k)..k, behind(k) = (4k + 1 - 8) / 4.
    let s0 = Scheduler::new(config(64, gemma2(8), 1)).unwrap();
    let mut hashes = Vec::new();
    let tokens: Vec<u32> = (0..40).collect();
    crate::block_hash::extend_block_hashes(&mut hashes, &tokens, BS, None);
    let scenario = |full_cached: usize, windowed_cached: std::ops::Range<usize>| {
        let mut s = Scheduler::new(s0.config().clone()).unwrap();
        let mut blocks = Vec::new();
        s.pool.allocate(20, &mut blocks);
        for (i, h) in hashes.iter().enumerate().take(full_cached) {
            s.pool.register(blocks[i], *h, None, &[]);
        }
        for i in windowed_cached {
            s.pool.register_quiet(blocks[10 + i], hashes[i].for_table(1));
        }
        s.pool.release(&blocks);
        let mut hit = Vec::new();
        let mut extra = vec![TableHit::default()];
        let k = s.tables_cached_prefix(&hashes, &mut hit, &mut extra);
        (k, hit.len(), extra[0].skipped, extra[0].blocks.clone())
    };
    // Everything cached: the whole prefix, the windowed table from block 8.
    assert_eq!(scenario(10, 0..10), (10, 10, 8, vec![18, 19]));
    // The windowed table lost its newest blocks: the hit falls back to where its window
    // is whole (k = 6: blocks 4 and 5), though the full table has all 10.
    assert_eq!(scenario(10, 0..6), (6, 6, 4, vec![14, 15]));
    // Only the window's blocks cached: enough for the full hit.
    assert_eq!(scenario(10, 8..10), (10, 10, 8, vec![18, 19]));
    // The full table is missing block 3: no hit reaches past it.
    assert_eq!(scenario(3, 0..10), (3, 3, 1, vec![11, 12]));
    // The windowed table's blocks are cached under their own key, not table 0's.
    assert_eq!(scenario(10, 0..0), (0, 0, 0, vec![]));
}

#[test]
fn preemption_forks_and_drafts_give_every_block_back() {
    for depth in [1, 2] {
        // A pool too small for both requests at once: one is preempted, recomputed.
        let mut s = Scheduler::new(config(44, gemma2(6), depth)).unwrap();
        s.add_request(request("a", (0..20).collect(), 60, 1)).unwrap();
        s.add_request(request("b", (0..20).collect(), 60, 2)).unwrap();
        run(&mut s);
        assert_eq!(s.pool().usage().used, 0, "depth {depth}: blocks leaked");
        assert!(s.counters().preemptions > 0, "depth {depth}: the pool was meant to be short");
    }
    // Prompt lookup drafts on a repeating prompt: rejected drafts' blocks go back in
    // every table (`rewind`).
    let mut cfg = config(200, gemma2(6), 2);
    cfg.num_speculative_tokens = 3;
    cfg.speculative_method = crate::spec::SpecMethod::Ngram;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("c", [1, 2, 3].repeat(8), 40, 1)).unwrap();
    run(&mut s);
    assert_eq!(s.pool().usage().used, 0);
}

#[test]
fn admission_counts_every_table() {
    // 100 tokens need 25 blocks per table: 50 for a Gemma 2 shape.
    let s = Scheduler::new(config(49, gemma2(8), 1));
    let err = s.unwrap().add_request(request("a", (0..50).collect(), 50, 1)).unwrap_err();
    assert!(err.to_string().contains("2 block tables"), "{err}");
    let mut s = Scheduler::new(config(50, gemma2(8), 1)).unwrap();
    s.add_request(request("a", (0..50).collect(), 50, 1)).unwrap();
}

#[test]
fn kv_events_publish_table_zero_only() {
    let mut cfg = config(200, gemma2(8), 1);
    cfg.enable_kv_events = true;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(request("a", (0..41).collect(), 8, 1)).unwrap();
    let mut exec = FakeExecutor::new(1000);
    let mut stored = std::collections::BTreeSet::new();
    while s.has_unfinished() {
        let plan = s.schedule().unwrap();
        let sampled = exec.run(&plan);
        s.apply_result(plan.step_id, &sampled).unwrap();
        if let Some(log) = s.take_output(Some(plan.step_id)).kv_events {
            for (k, h) in log.kinds.iter().zip(&log.hashes) {
                if *k == crate::kv_events::KV_STORED_ROOT || *k == crate::kv_events::KV_STORED_CHILD {
                    stored.insert(*h);
                }
            }
        }
    }
    let mut hashes = Vec::new();
    crate::block_hash::extend_block_hashes(&mut hashes, &(0..41).collect::<Vec<u32>>(), BS, None);
    // The prompt's 10 full blocks and the 2 full ones of output, table 0's hashes only.
    assert!(hashes.iter().all(|h| stored.contains(&h.published())));
    assert_eq!(stored.len(), 12);
    assert_eq!(s.pool().cached_hashes(), stored.into_iter().collect::<Vec<_>>());
    // The windowed table's blocks are cached all the same, under their own keys.
    assert!(s.pool().is_cached(&hashes[9].for_table(1)));
}
