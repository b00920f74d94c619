//! Planning one step: running sequences first (decodes and the rest of chunked prefills),
//! then waiting ones, within the token budget, the sequence cap and the free blocks.

use crate::block_pool::{BlockId, NULL_BLOCK};
use crate::constraint::MaskTicket;
use crate::plan::{StepPlan, PLACEHOLDER_TOKEN};
use crate::request::{SeqIndex, SeqState};
use crate::spec::SpecMethod;

use super::tables::{push_write, TableHit};
use super::{InflightStep, Scheduler};

impl Scheduler {
    /// Plans the next step, or returns None when the pipeline is full or nothing can run.
    ///
    /// Each sequence is written into the plan as soon as it is picked: preemption only
    /// ever takes sequences ranked below the one being served, which have not been
    /// visited yet, so nothing written needs to be taken back.
    pub fn schedule(&mut self) -> Option<StepPlan> {
        if !self.can_plan() {
            return None;
        }
        let mut budget = self.config.max_num_batched_tokens;
        let mut plan = StepPlan { step_id: self.next_step_id, ..StepPlan::default() };
        let mut step = InflightStep { step_id: plan.step_id, ..InflightStep::default() };
        let expected = self.running.len() + 8;
        for v in [&mut plan.rows, &mut plan.num_scheduled_tokens, &mut plan.seq_lens] {
            v.reserve(expected);
        }
        plan.query_start_loc.reserve(expected + 1);
        plan.query_start_loc.push(0);
        plan.input_ids.reserve(expected);
        plan.positions.reserve(expected);
        plan.slot_mapping.reserve(expected);
        plan.logits_indices.reserve(expected);
        plan.sample_rows.reserve(expected);
        step.scheduled.reserve(expected);
        step.sampled.reserve(expected);
        step.written.reserve(expected);
        let preempted = self.schedule_running(&mut budget, &mut plan, &mut step);
        self.flush_registrations(&mut step);
        if !preempted {
            self.schedule_waiting(&mut budget, &mut plan, &mut step);
            self.flush_registrations(&mut step);
        }
        if step.scheduled.is_empty() {
            // Rows freed so far stay queued for the next plan that is actually sent.
            return None;
        }
        self.next_step_id += 1;
        plan.freed_rows = std::mem::take(&mut self.freed_rows);
        if !step.masked.is_empty() {
            let (tx, ticket) = MaskTicket::new();
            step.mask_tx = Some(tx);
            plan.grammar_mask = Some(ticket);
        }
        let unpark = std::mem::take(&mut step.unpark);
        for seq_index in unpark {
            self.unpark_siblings(seq_index);
        }
        self.inflight.push_back(step);
        self.counters.steps_planned += 1;
        Some(plan)
    }

    /// Makes the blocks this step filled so far findable in the prefix cache.
    fn flush_registrations(&mut self, step: &mut InflightStep) {
        let bs = self.config.block_size;
        // The sequence is read only for a KV-cache event: with events off the loop stays
        // a run of independent map inserts.
        let recording = self.pool.records_events();
        for &(block, hash, seq_index, i, table) in &step.to_register[step.num_flushed..] {
            if table > 0 {
                self.pool.register_quiet(block, hash);
                continue;
            }
            let (tokens, parent) = if recording {
                let seq = self.seqs[seq_index as usize].as_ref();
                seq.map_or((&[][..], None), |seq| seq.hashed_block(i as usize, bs))
            } else {
                (&[][..], None)
            };
            self.pool.register(block, hash, parent, tokens);
        }
        step.num_flushed = step.to_register.len();
    }

    /// Tokens for one sequence this step, after the budget and the per-step prefill cap.
    fn chunk_size(&self, seq_index: SeqIndex, budget: usize) -> usize {
        let seq = self.seq(seq_index).unwrap();
        self.cap_chunk(seq.tokens_wanted(&self.config), budget, seq.pooling)
    }

    /// How many of `wanted` tokens fit this step: within the budget and the per-step prefill
    /// cap; a pooling prompt goes in one piece or not at all (it is validated to fit the
    /// budget). 0 means "not this step".
    fn cap_chunk(&self, wanted: usize, budget: usize, pooling: bool) -> usize {
        if pooling {
            return if wanted <= budget { wanted } else { 0 };
        }
        let cap = self.config.long_prefill_token_threshold;
        if cap > 0 && wanted > 1 {
            wanted.min(budget).min(cap)
        } else {
            wanted.min(budget)
        }
    }

    /// Returns true when it preempted anything.
    fn schedule_running(&mut self, budget: &mut usize, plan: &mut StepPlan, step: &mut InflightStep) -> bool {
        let mut preempted = false;
        let speculates = self.config.speculates();
        let tables = self.num_tables();
        // Blocks the running sequences after the current one may need for their own
        // tokens this step: drafts never take them (counted when drafts are first
        // considered, then each sequence's share leaves the count as it is reached).
        let mut later_need: Option<usize> = None;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let (_, seq_index) = self.running.get(i);
            if let Some(total) = later_need.as_mut() {
                *total = total.saturating_sub(self.own_block_need(seq_index));
            }
            if speculates && self.waits_for_result(seq_index) {
                i += 1;
                continue;
            }
            let n = self.chunk_size(seq_index, *budget);
            if n == 0 {
                i += 1;
                continue;
            }
            // Blocks behind every layer's window go back before any are asked for.
            self.drop_behind_window(seq_index);
            self.drop_behind_tables(seq_index);
            // A running sequence holds exactly blocks_for(num_computed) blocks, so the block
            // table itself (a cache line of its own) is not read here.
            let computed = self.seq(seq_index).unwrap().computed();
            let held = self.config.blocks_for(computed);
            let mut d = 0;
            if speculates && n == 1 && self.may_speculate(seq_index) {
                // Drafts take only budget no later running sequence needs for its own token,
                // and only free blocks that no later running sequence may need for its own
                // tokens (`later_need`): they never cause a preemption, or a wait, that
                // decoding without them would not.
                let spare = budget.saturating_sub(self.running.len() - i);
                let reserved = *later_need.get_or_insert_with(|| {
                    (i + 1..self.running.len()).map(|j| self.own_block_need(self.running.get(j).1)).sum()
                });
                let usable = held + self.pool.num_free().saturating_sub(reserved) / tables;
                let room = (usable * self.config.block_size).saturating_sub(computed + 1);
                d = self.propose(seq_index, spare.min(room));
            }
            let need = self.config.blocks_for(computed + n + d) - held;
            // Every table grows by as many blocks.
            let need_all = need * tables;
            // Make room by preempting lower-ranked sequences (always the last of the list).
            while self.pool.num_free() < need_all && self.running.len() > i + 1 {
                self.preempt_at(self.running.len() - 1);
                preempted = true;
            }
            if self.pool.num_free() < need_all {
                // Nothing ranked below is left: wait for blocks that in-flight steps hold.
                i += 1;
                continue;
            }
            self.grow_blocks(seq_index, need, plan);
            if d == 0 {
                self.emit(seq_index, n, &[], plan, step);
            } else {
                let drafts = std::mem::take(&mut self.draft_buf);
                self.emit(seq_index, n + d, &drafts[..d], plan, step);
                self.draft_buf = drafts;
            }
            *budget -= n + d;
            i += 1;
        }
        preempted
    }

    /// At most how many blocks a running sequence needs this step for its own tokens (no
    /// drafts): its chunk as large as the per-step limits allow, whatever budget is left.
    fn own_block_need(&self, seq_index: SeqIndex) -> usize {
        let seq = self.seq(seq_index).unwrap();
        let n =
            self.cap_chunk(seq.tokens_wanted(&self.config), self.config.max_num_batched_tokens, seq.pooling);
        let computed = seq.computed();
        (self.config.blocks_for(computed + n) - self.config.blocks_for(computed)) * self.num_tables()
    }

    fn schedule_waiting(&mut self, budget: &mut usize, plan: &mut StepPlan, step: &mut InflightStep) {
        let mut hit: Vec<BlockId> = Vec::new();
        let mut extra_hits = vec![TableHit::default(); self.extra_windows.len()];
        let tables = self.num_tables();
        while *budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some((rank, seq_index)) = self.waiting.first() else {
                break;
            };
            let bs = self.config.block_size;
            let seq = self.seq(seq_index).unwrap();
            if seq.pending_samples > 0 {
                // Preempted while its last step is in flight; admissible once that reports.
                break;
            }
            let known = seq.num_tokens();
            // What earlier admissions of this step filled must be findable now.
            self.flush_registrations(step);
            // Never reuse the whole prompt: at least one token is computed for its logits.
            let max_hit_blocks = (known - 1) / bs;
            // A windowed hit skips the blocks behind its window: held as null entries.
            let skipped = self.find_reusable_prefix(seq_index, max_hit_blocks, &mut hit, &mut extra_hits);
            let hit_blocks = skipped + hit.len();
            let cached = hit_blocks * bs;
            let wanted = known - cached;
            let seq = self.seq(seq_index).unwrap();
            let n = self.cap_chunk(wanted, *budget, seq.pooling);
            if n == 0 {
                break; // a pooling prompt that does not fit this step's budget
            }
            let need = self.config.blocks_for(cached + n) - hit_blocks;
            let evictable_hits = self.pool.count_evictable(&hit)
                + extra_hits.iter().map(|h| self.pool.count_evictable(&h.blocks)).sum::<usize>();
            let free_after_hits = self.pool.num_free() - evictable_hits;
            if need * tables > free_after_hits {
                break;
            }
            let used_cache = self.pool.caching_enabled() && !seq.pooling && seq.fork_source.is_none();
            if used_cache {
                self.pool.record_lookup(known, cached);
            }
            self.pool.acquire(&hit);
            for h in &extra_hits {
                self.pool.acquire(&h.blocks);
            }
            self.waiting.remove(&rank);
            let row = self.rows.take().expect("a free row exists while running < max_num_seqs");
            let max_model_len = self.config.max_model_len;
            let seq = self.seq_mut(seq_index);
            seq.blocks.clear();
            seq.blocks.resize(skipped, NULL_BLOCK);
            seq.blocks.extend_from_slice(&hit);
            if let Some(&b) = hit.last() {
                seq.tail_block = b;
            }
            seq.num_window_freed = skipped as u32;
            seq.num_computed = cached as u32;
            seq.num_registered = hit_blocks as u32;
            seq.num_shared_blocks = hit_blocks as u32;
            seq.row = row;
            seq.state = SeqState::Running;
            seq.fork_source = None;
            if !seq.admitted_once {
                seq.admitted_once = true;
                seq.num_cached_tokens = cached;
                // Room for every token it may produce, so that decode steps never move the
                // token vector (a copy, and fresh pages to fault in, in the middle of a step).
                let most = (seq.prompt_len() + seq.max_tokens as usize).min(max_model_len);
                seq.reserve_tokens(most);
            }
            self.install_tables(seq_index, &extra_hits);
            self.running.insert(rank, seq_index);
            self.announce_new(seq_index, plan);
            self.grow_blocks(seq_index, need, plan);
            self.emit(seq_index, n, &[], plan, step);
            *budget -= n;
        }
    }

    /// Fills `hit` with blocks the waiting sequence at `seq_index` can reuse: its first
    /// sibling's prompt blocks when it was forked, else the longest cached prefix. Returns
    /// how many leading blocks the hit skips, behind a sliding window (`window.rs`). With
    /// per-group tables, `hit` is table 0's and `extra_hits` the others' (`tables.rs`).
    fn find_reusable_prefix(
        &mut self,
        seq_index: SeqIndex,
        max_blocks: usize,
        hit: &mut Vec<BlockId>,
        extra_hits: &mut [TableHit],
    ) -> usize {
        hit.clear();
        for h in extra_hits.iter_mut() {
            h.skipped = 0;
            h.blocks.clear();
        }
        let caching = self.pool.caching_enabled();
        let seq = self.seqs[seq_index as usize].as_mut().unwrap();
        if seq.pooling {
            return 0;
        }
        if caching {
            seq.update_hashes(self.config.block_size);
        }
        let seq = self.seq(seq_index).unwrap();
        if let Some(src) = seq.fork_source {
            if let Some(parent) = self.seq(src) {
                if parent.state == SeqState::Running && parent.id < seq.id {
                    let shared = (parent.computed().min(seq.prompt_len()) / self.config.block_size)
                        .min(max_blocks)
                        .min(parent.blocks.len());
                    // Shared only if the parent still holds what the window reaches.
                    let skip = self.hit_skips(shared);
                    if parent.num_window_freed as usize <= skip
                        && self.tables_fork_share(parent, shared, extra_hits)
                    {
                        hit.extend_from_slice(&parent.blocks[skip..shared]);
                        return skip;
                    }
                }
            }
        }
        if !caching {
            return 0;
        }
        let limit = max_blocks.min(seq.hashes.len());
        if !self.extra_windows.is_empty() {
            self.tables_cached_prefix(&seq.hashes[..limit], hit, extra_hits);
            return 0;
        }
        self.cached_prefix(&seq.hashes[..limit], hit)
    }

    /// Allocates `need` more blocks for the sequence at `seq_index` (checked free) and
    /// records the table writes.
    fn grow_blocks(&mut self, seq_index: SeqIndex, need: usize, plan: &mut StepPlan) {
        if need == 0 {
            return;
        }
        let seq = self.seqs[seq_index as usize].as_mut().unwrap();
        let start = seq.blocks.len();
        self.pool.allocate(need, &mut seq.blocks);
        seq.tail_block = *seq.blocks.last().unwrap();
        let row = seq.row().expect("running sequence has a row") as i32;
        if seq.extra.is_empty() {
            for (col, &b) in seq.blocks.iter().enumerate().skip(start) {
                plan.block_table_rows.push(row);
                plan.block_table_cols.push(col as i32);
                plan.block_table_ids.push(b as i32);
            }
        } else {
            for (col, &b) in seq.blocks.iter().enumerate().skip(start) {
                push_write(plan, 0, row, col, b);
            }
            self.grow_tables(seq_index, need, plan);
        }
    }

    /// Lists a sequence entering the batch with all its known tokens and its block table so
    /// far (prefix hits; blocks allocated in this step are added by `grow_blocks`).
    fn announce_new(&mut self, seq_index: SeqIndex, plan: &mut StepPlan) {
        let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
        let row = seq.row().expect("admitted sequence has a row") as i32;
        if plan.new_token_offsets.is_empty() {
            plan.new_token_offsets.push(0);
        }
        plan.new_rows.push(row);
        plan.new_seq_ids.push(seq.id);
        plan.new_num_prompt_tokens.push(seq.num_prompt as i32);
        plan.new_attachments.push(seq.attachment.clone());
        plan.new_token_ids.extend(seq.known_tokens().iter().map(|&t| i64::from(t)));
        plan.new_token_offsets.push(plan.new_token_ids.len() as i64);
        // Entries behind the window are never read: the executor's table is not written there.
        if seq.extra.is_empty() {
            for (col, &b) in seq.blocks.iter().enumerate().skip(seq.num_window_freed as usize) {
                plan.block_table_rows.push(row);
                plan.block_table_cols.push(col as i32);
                plan.block_table_ids.push(b as i32);
            }
            return;
        }
        for (col, &b) in seq.blocks.iter().enumerate() {
            push_write(plan, 0, row, col, b);
        }
        for (t, table) in seq.extra.iter().enumerate() {
            for (col, &b) in table.blocks.iter().enumerate().skip(table.freed as usize) {
                push_write(plan, t + 1, row, col, b);
            }
        }
    }

    /// Writes one picked sequence's tokens into the plan (`n` of them, the last
    /// `drafts.len()` being its drafts), advances its computed count, registers prompt
    /// blocks that became full, and records it in the step.
    fn emit(
        &mut self,
        seq_index: SeqIndex,
        n: usize,
        drafts: &[u32],
        plan: &mut StepPlan,
        step: &mut InflightStep,
    ) {
        let bs = self.config.block_size;
        let caching = self.pool.caching_enabled();
        let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
        let start = seq.computed();
        let end = start + n;
        let known = seq.num_tokens();
        let num_blocks = end.div_ceil(bs); // grown to cover `end` before emit
        for b in start / bs..=(end - 1) / bs {
            step.written.push(seq.block_at(b * bs, bs, num_blocks));
            step.written.extend(seq.extra.iter().map(|t| t.blocks[b]));
        }
        let d = drafts.len();
        for pos in start..end {
            let token = if pos < known {
                i64::from(seq.token_at(pos))
            } else if pos - known < d {
                i64::from(drafts[pos - known])
            } else {
                PLACEHOLDER_TOKEN
            };
            plan.input_ids.push(token);
            plan.positions.push(pos as i64);
            let block = i64::from(seq.block_at(pos, bs, num_blocks));
            plan.slot_mapping.push(block * bs as i64 + (pos % bs) as i64);
            for table in &seq.extra {
                let block = i64::from(table.blocks[pos / bs]);
                plan.group_slot_mapping.push(block * bs as i64 + (pos % bs) as i64);
            }
        }
        let row = seq.row().expect("scheduled sequence has a row") as i32;
        let index = plan.rows.len() as i32;
        let mut sampled_at = None;
        plan.rows.push(row);
        plan.num_scheduled_tokens.push(n as i32);
        plan.query_start_loc.push(plan.input_ids.len() as i32);
        plan.seq_lens.push(end as i32);
        if n - d == 1 && start >= seq.prompt_len() {
            self.counters.decode_tokens_scheduled += 1;
        } else {
            self.counters.prefill_tokens_scheduled += n as u64;
        }
        seq.num_computed = end as u32;
        seq.inflight_steps += 1;
        step.scheduled.push(seq_index);
        if seq.pooling {
            plan.pool_indices.push(index);
            step.pooled.push(seq_index);
        } else if end == seq.num_tokens_with_pending() + d {
            let last = plan.input_ids.len() as i64 - 1;
            if d == 0 {
                plan.logits_indices.push(last);
                plan.sample_rows.push(row);
            } else {
                plan.logits_indices.extend(last - d as i64..=last);
                plan.sample_rows.extend(std::iter::repeat_n(row, d + 1));
                if step.drafts.is_empty() {
                    // The step's first drafts: the sequences sampled before had none.
                    plan.num_draft_tokens.resize(step.sampled.len(), 0);
                    step.draft_counts.resize(step.sampled.len(), 0);
                }
                plan.draft_token_ids.extend(drafts.iter().map(|&t| i64::from(t)));
                step.drafts.extend_from_slice(drafts);
            }
            if !step.drafts.is_empty() {
                plan.num_draft_tokens.push(d as i32);
                step.draft_counts.push(d as u32);
            }
            seq.pending_samples += 1;
            if seq.constrained {
                plan.mask_sample_indices.push(plan.logits_indices.len() as i32 - 1);
                step.masked.push(seq_index);
                step.mask_words = step.mask_words.max(seq.matcher.as_ref().map_or(1, |m| m.mask_words));
            }
            step.sampled.push(seq_index);
            sampled_at = Some(step.sampled.len() - 1);
        }
        // (The index, in the block table's cache line, is only read at the end of a prompt.)
        if start < seq.prompt_len() && end >= seq.prompt_len() && seq.sample_index == 0 {
            step.unpark.push(seq_index);
        }
        // Prompt blocks that are now full of computed tokens become findable. Blocks that
        // hold generated tokens wait until the sequence stops running (`register_rest`).
        // (With prefix caching off nothing is hashed at all.)
        let full = end.min(seq.prompt_len()) / bs;
        if full > seq.num_registered as usize {
            if caching {
                seq.update_hashes(bs);
                for i in seq.num_registered as usize..full {
                    // Registered in batches (`flush_registrations`): a tight loop of
                    // independent map inserts lets the CPU overlap their cache misses.
                    step.to_register.push((
                        seq.block_at(i * bs, bs, num_blocks),
                        seq.hashes[i],
                        seq_index,
                        i as u32,
                        0,
                    ));
                    for (t, table) in seq.extra.iter().enumerate() {
                        if table.blocks[i] != NULL_BLOCK {
                            let hash = seq.hashes[i].for_table(t + 1);
                            step.to_register.push((
                                table.blocks[i],
                                hash,
                                seq_index,
                                i as u32,
                                (t + 1) as u8,
                            ));
                        }
                    }
                }
            }
            seq.num_registered = full as u32;
        }
        if let Some(k) = sampled_at {
            if self.config.speculative_method == SpecMethod::Executor {
                let wanted = self.executor_drafts_wanted(seq_index, d);
                if wanted > 0 {
                    plan.propose_indices.push(k as i32);
                    plan.propose_counts.push(wanted as i32);
                }
                self.seq_mut(seq_index).spec.drafts_asked = wanted > 0;
            }
        }
        if self.config.speculative_method == SpecMethod::Executor && self.may_speculate(seq_index) {
            plan.may_draft_indices.push(index);
        }
    }

    /// The first sample's prompt is scheduled: its parked siblings may now be admitted and
    /// share its prompt blocks.
    pub(super) fn unpark_siblings(&mut self, first: SeqIndex) {
        let req = self.seq(first).unwrap().request_id.clone();
        let Some(group) = self.requests.get(&req) else {
            return;
        };
        let parked: Vec<SeqIndex> = group
            .seq_indices
            .iter()
            .copied()
            .filter(|&s| self.seq(s).is_some_and(|q| q.state == SeqState::Parked && q.request_id == req))
            .collect();
        for seq_index in parked {
            self.seq_mut(seq_index).state = SeqState::Waiting;
            let rank = self.rank_of(seq_index);
            self.waiting.insert(rank, seq_index);
        }
    }
}
