//! Sliding windows as block accounting (`window.rs`): bounded blocks at long context,
//! prefix hits that need only the window, forks, preemption and hybrid models.

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
        max_model_len: 512,
        pipeline_depth: depth,
        kv_groups: groups,
        ..SchedulerConfig::default()
    }
}

fn request(id: &str, prompt: Vec<u32>, max_tokens: usize, n: usize) -> RequestSpec {
    RequestSpec { request_id: id.into(), prompt, max_tokens, ignore_eos: true, n, ..Default::default() }
}

/// Runs everything to the end; returns the most blocks in use after any plan.
fn run(s: &mut Scheduler) -> usize {
    let mut exec = FakeExecutor::new(1000);
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

#[test]
fn a_uniform_window_holds_a_bounded_number_of_blocks() {
    for depth in [1, 2] {
        let mut s = Scheduler::new(config(200, vec![KvGroup::windowed(10, 4)], depth)).unwrap();
        s.add_request(request("a", (0..30).collect(), 300, 1)).unwrap();
        let most = run(&mut s);
        // The window (10) spans at most 4 blocks of 4, a prefill chunk of 16 four more,
        // plus the block being filled: far below the 83 blocks of 330 tokens.
        assert!(most <= 10, "depth {depth}: {most} blocks in use at once");
        assert_eq!(s.pool().usage().used, 0, "blocks leaked");
        assert!(s.counters().window_freed_blocks >= 70);
    }
}

#[test]
fn a_full_group_keeps_every_block() {
    let groups = vec![KvGroup::windowed(10, 4), KvGroup::full(1)];
    let mut s = Scheduler::new(config(200, groups, 1)).unwrap();
    s.add_request(request("a", (0..30).collect(), 100, 1)).unwrap();
    let most = run(&mut s);
    assert_eq!(most, 130usize.div_ceil(BS));
    assert_eq!(s.counters().window_freed_blocks, 0);
}

#[test]
fn the_widest_window_governs() {
    let groups = vec![KvGroup::windowed(4, 2), KvGroup::windowed(40, 2)];
    let mut s = Scheduler::new(config(200, groups, 1)).unwrap();
    s.add_request(request("a", (0..8).collect(), 200, 1)).unwrap();
    let most = run(&mut s);
    assert!((11..=16).contains(&most), "{most} blocks for a window of 40 tokens");
}

#[test]
fn samples_of_one_request_share_and_free_their_blocks_exactly() {
    let mut s = Scheduler::new(config(200, vec![KvGroup::windowed(8, 2)], 2)).unwrap();
    s.add_request(request("a", (0..40).collect(), 60, 3)).unwrap();
    run(&mut s);
    assert_eq!(s.pool().usage().used, 0);
}

#[test]
fn a_prefix_hit_needs_only_the_blocks_inside_the_window() {
    let mut s = Scheduler::new(config(200, vec![KvGroup::windowed(8, 2)], 1)).unwrap();
    let prompt: Vec<u32> = (0..41).collect();
    s.add_request(request("a", prompt.clone(), 1, 1)).unwrap();
    run(&mut s);
    assert_eq!(s.pool().usage().used, 0);
    // Forget the first blocks of the cached prompt: a full-attention hit would stop at 0.
    let mut probe = prompt.clone();
    probe.push(99);
    let mut seq_hashes = Vec::new();
    crate::block_hash::extend_block_hashes(&mut seq_hashes, &probe, BS, None);
    let mut hit = Vec::new();
    s.pool.longest_cached_prefix(&seq_hashes[..2], &mut hit);
    for b in hit.clone() {
        s.pool.forget(b);
    }
    s.add_request(request("b", probe, 1, 1)).unwrap();
    let plan = s.schedule().unwrap();
    // 42 known tokens, at most 41 reusable: 10 blocks, the first query at 40 reads 33..=40.
    assert_eq!(plan.positions[0], 40, "resumed after the cached window, not from 0");
    let cols: Vec<i32> = plan.block_table_cols.clone();
    assert_eq!(cols.first(), Some(&8), "columns behind the window are not written");
    s.check_invariants().unwrap();
    assert_eq!(s.pool().prefix_stats().hit_tokens, 40);
}

#[test]
fn preemption_and_resume_keep_exact_accounting() {
    // Each request fits the pool alone (25 of 26 blocks), two windows of 64 do not.
    let mut s = Scheduler::new(config(26, vec![KvGroup::windowed(64, 2)], 2)).unwrap();
    s.add_request(request("a", (0..20).collect(), 80, 1)).unwrap();
    s.add_request(request("b", (100..120).collect(), 80, 1)).unwrap();
    run(&mut s);
    assert!(s.counters().preemptions > 0, "the case did not preempt");
    assert!(s.counters().window_freed_blocks > 0);
    assert_eq!(s.pool().usage().used, 0);
}

#[test]
fn longest_cached_window_scans_runs_from_the_end() {
    use crate::block_hash::BlockHash;
    let mut p = crate::block_pool::BlockPool::new(16, BS, true);
    let hashes: Vec<BlockHash> = (0..10u128).map(BlockHash).collect();
    let mut blocks = Vec::new();
    p.try_allocate(10, &mut blocks).unwrap();
    for i in 5..10 {
        p.register(blocks[i], hashes[i], None, &[0; BS]);
    }
    let behind = |k: usize| k.saturating_sub(3);
    let mut out = Vec::new();
    assert_eq!(p.longest_cached_window(&hashes, behind, &mut out), 7);
    assert_eq!(out, blocks[7..10]);
    p.forget(blocks[8]);
    assert_eq!(p.longest_cached_window(&hashes, behind, &mut out), 5);
    assert_eq!(out, blocks[5..8]);
    p.forget(blocks[6]);
    assert_eq!(p.longest_cached_window(&hashes, behind, &mut out), 0, "no run reaches back far enough");
    assert!(out.is_empty());
}
