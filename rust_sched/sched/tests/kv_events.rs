//! KV-cache events from a whole scheduler run: a subscriber that replays every output
//! event's log holds exactly the pool's cached hashes, through evictions (a pool far
//! smaller than the workload) and preemptions (sequences that outgrow it).

use std::collections::{BTreeSet, VecDeque};

use pyengine_sched::block_hash::BlockHash;
use pyengine_sched::config::SchedulerConfig;
use pyengine_sched::kv_events::*;
use pyengine_sched::request::RequestSpec;
use pyengine_sched::scheduler::Scheduler;
use pyengine_sched::sim::FakeExecutor;

fn replay(set: &mut BTreeSet<u64>, log: &KvEventLog, block_size: usize) {
    let mut tokens = log.tokens.chunks(block_size);
    for (i, &kind) in log.kinds.iter().enumerate() {
        match kind {
            KV_STORED_ROOT | KV_STORED_CHILD => {
                let block = tokens.next().expect("a stored event owns block_size tokens");
                assert_eq!(block.len(), block_size);
                if kind == KV_STORED_ROOT {
                    // A root block's hash is reproducible from its tokens alone (no salt here).
                    assert_eq!(BlockHash::chain(None, block, None).published(), log.hashes[i]);
                }
                assert!(set.insert(log.hashes[i]), "hash {:#x} stored twice", log.hashes[i]);
            }
            KV_REMOVED => assert!(set.remove(&log.hashes[i]), "removed {:#x}, never stored", log.hashes[i]),
            KV_ALL_CLEARED => set.clear(),
            other => panic!("unknown event kind {other}"),
        }
    }
    assert!(tokens.next().is_none(), "tokens left over");
}

fn config(enable_kv_events: bool) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks: 12,
        block_size: 4,
        max_num_seqs: 6,
        max_num_batched_tokens: 16,
        max_model_len: 48,
        long_prefill_token_threshold: 5,
        enable_prefix_caching: true,
        enable_kv_events,
        pipeline_depth: 2,
        ..SchedulerConfig::default()
    }
}

/// Requests sharing three prompt stems (prefix hits), long enough outputs to preempt.
fn workload() -> Vec<RequestSpec> {
    (0..16)
        .map(|i| {
            let mut prompt: Vec<u32> = (0..12).map(|t| (t * 7 + (i % 3)) % 50).collect();
            prompt.extend((0..(i % 5)).map(|t| 100 + t + i));
            RequestSpec {
                request_id: format!("r{i}"),
                prompt,
                max_tokens: 6 + (i as usize % 4) * 6,
                ignore_eos: true,
                n: 1,
                ..Default::default()
            }
        })
        .collect()
}

#[test]
fn replayed_events_hold_the_cached_set_through_evictions_and_preemptions() {
    let mut s = Scheduler::new(config(true)).unwrap();
    let mut exec = FakeExecutor::new(1000);
    let mut set = BTreeSet::new();
    let mut pending: VecDeque<(u64, Vec<i64>)> = VecDeque::new();
    let mut requests = workload().into_iter();
    let mut removed = 0usize;
    for round in 0..100_000 {
        if round % 3 == 0 {
            if let Some(r) = requests.next() {
                s.add_request(r).unwrap();
            }
        }
        while let Some(plan) = s.schedule() {
            pending.push_back((plan.step_id, exec.run(&plan)));
        }
        if let Some((step, sampled)) = pending.pop_front() {
            s.apply_result(step, &sampled).unwrap();
        }
        let ev = s.take_output(None);
        if let Some(log) = &ev.kv_events {
            removed += log.kinds.iter().filter(|&&k| k == KV_REMOVED).count();
            replay(&mut set, log, 4);
        }
        assert_eq!(set.iter().copied().collect::<Vec<_>>(), s.pool().cached_hashes(), "after round {round}");
        if !s.has_unfinished() && pending.is_empty() && requests.len() == 0 {
            break;
        }
    }
    assert!(!s.has_unfinished());
    assert!(s.counters().preemptions > 0, "the workload must preempt");
    assert!(removed > 0, "the workload must evict cached blocks");
    assert!(!set.is_empty());
}

#[test]
fn events_off_leave_output_events_without_a_log() {
    let mut s = Scheduler::new(config(false)).unwrap();
    let mut exec = FakeExecutor::new(1000);
    for r in workload().into_iter().take(4) {
        s.add_request(r).unwrap();
    }
    for _ in 0..10_000 {
        let Some(plan) = s.schedule() else { break };
        let sampled = exec.run(&plan);
        s.apply_result(plan.step_id, &sampled).unwrap();
        assert_eq!(s.take_output(None).kv_events, None);
    }
    assert!(!s.pool().cached_hashes().is_empty(), "the cache itself still works");
}
