//! Single-query (decode) attention over the paged KV cache, on the CPU.
//!
//! For each sequence (row) and KV head, every context position's key is read once and
//! scored against the query heads of that KV head's group; a softmax per query head; then
//! every value is read once and added into the group's outputs. Blocks are read in place
//! (no gather), K and V each once per step and layer: the memory traffic the decode step
//! is bound by. Rows are split into `threads` ranges of equal context, run as described
//! in `parallel.rs`.
//!
//! Consecutive rows that are one sequence's successive tokens (the same block table,
//! lengths growing by one: a verification step's entries handed over a row per token)
//! form a run whose K and V are read once for all its rows; each row still scores and
//! sums only the positions it sees, with the arithmetic it would have alone.
//!
//! A sliding-window layer (`window > 0`) attends to the last `window` positions of each
//! row only: the blocks before the window are neither read nor scored, so a decode step
//! costs the same at any context length beyond the window.

use std::ops::Range;
use std::sync::Mutex;

use super::parallel::for_each_part;
#[cfg(target_arch = "x86_64")]
use super::vector::Avx2;
use super::vector::{exp_shifted_in_place, max, Ops, Portable};
use super::KernelError;

/// One layer's paged cache: keys and values `[num_blocks, block_size, kv_heads, head_dim]`.
#[derive(Clone, Copy)]
pub struct PagedKv<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// The queries of one step's single-token rows.
#[derive(Clone, Copy)]
pub struct DecodeQueries<'a> {
    /// `[rows, heads, head_dim]`.
    pub query: &'a [f32],
    pub heads: usize,
    /// `[rows, table_width]` block ids; row r's context is its first `seq_lens[r]` slots.
    pub block_tables: &'a [i32],
    pub table_width: usize,
    /// `[rows]`, each in `1..=table_width * block_size`.
    pub seq_lens: &'a [i32],
    /// Score scale, usually `head_dim^-0.5`.
    pub scale: f32,
    /// Attend to the last `window` positions of each row only; 0: the whole context.
    pub window: usize,
    /// Soft-cap the scores as `softcap * tanh(score / softcap)` (Gemma 2); 0: no cap.
    pub softcap: f32,
}

impl DecodeQueries<'_> {
    /// First context position row `row` attends to (0 without a window).
    fn first_position(&self, row: usize) -> usize {
        let len = self.seq_lens[row] as usize;
        if self.window == 0 {
            0
        } else {
            len.saturating_sub(self.window)
        }
    }
}

/// Below this much context (positions times query heads) a second thread costs more than
/// it saves. On PyTorch's OpenMP team (spinning after every operator) joining costs about a
/// microsecond: dropping the threshold from 16384 to 1024 took a batch-8 decode step at
/// context 384 from 7.2 to 5.1-5.4 ms (contiguous cache: 4.3-5.0 ms).
const MIN_WORK_PER_THREAD: usize = 1024;

/// Writes `softmax(q K^T * scale) V` of every row and query head into `out`
/// (`[rows, heads, head_dim]`).
pub fn paged_decode_attention(
    queries: &DecodeQueries<'_>,
    kv: &PagedKv<'_>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    check(queries, kv, out.len())?;
    let rows = queries.seq_lens.len();
    let group_len = queries.heads / kv.kv_heads * kv.head_dim;
    let attended: Vec<i32> =
        (0..rows).map(|r| queries.seq_lens[r] - queries.first_position(r) as i32).collect();
    let work: usize = attended.iter().map(|&l| l as usize).sum::<usize>() * queries.heads;
    let threads = threads.max(1).min(work / MIN_WORK_PER_THREAD + 1);
    // Fewer rows than threads (batch 1): each row's KV heads split into that many ranges.
    let splits = if rows < threads { threads.div_ceil(rows).min(kv.kv_heads) } else { 1 };
    let bounds = balanced_bounds(&attended, threads.min(rows.max(1)));
    let mut pieces = Vec::with_capacity(threads.max(rows * splits));
    let mut rest = out;
    for pair in bounds.windows(2) {
        let rows = pair[0]..pair[1];
        if splits == 1 {
            let (piece, tail) = rest.split_at_mut(rows.len() * kv.kv_heads * group_len);
            pieces.push(Mutex::new(Some((rows, 0..kv.kv_heads, piece))));
            rest = tail;
            continue;
        }
        for row in rows {
            for s in 0..splits {
                let heads = kv.kv_heads * s / splits..kv.kv_heads * (s + 1) / splits;
                let (piece, tail) = rest.split_at_mut(heads.len() * group_len);
                pieces.push(Mutex::new(Some((row..row + 1, heads, piece))));
                rest = tail;
            }
        }
    }
    for_each_part(pieces.len(), &|part| {
        let taken = pieces[part].lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((rows, kv_heads, piece)) = taken {
            attend_rows(queries, kv, rows, kv_heads, piece);
        }
    });
    Ok(())
}

/// [`paged_decode_attention`]'s checks, for an output of `out_len` floats.
pub(crate) fn check(q: &DecodeQueries<'_>, kv: &PagedKv<'_>, out_len: usize) -> Result<(), KernelError> {
    let fail = |message: String| Err(KernelError::new(format!("paged decode attention: {message}")));
    let (rows, d) = (q.seq_lens.len(), kv.head_dim);
    if kv.block_size == 0 || kv.kv_heads == 0 || d == 0 || q.heads == 0 {
        return fail("block_size, kv_heads, head_dim and heads must be positive".into());
    }
    if !(q.softcap >= 0.0 && q.softcap.is_finite()) {
        return fail(format!("softcap must be finite and >= 0 (got {})", q.softcap));
    }
    if q.heads % kv.kv_heads != 0 {
        return fail(format!("{} query heads are not a multiple of {} KV heads", q.heads, kv.kv_heads));
    }
    let block_len = kv.block_size * kv.kv_heads * d;
    if kv.keys.len() != kv.values.len() || kv.keys.len() % block_len != 0 {
        return fail(format!(
            "key and value caches must both hold whole blocks of {block_len} elements (got {} and {})",
            kv.keys.len(),
            kv.values.len()
        ));
    }
    let expected = rows * q.heads * d;
    if q.query.len() != expected || out_len != expected {
        return fail(format!(
            "query and output must be [{rows}, {}, {d}] (got {} and {out_len} elements)",
            q.heads,
            q.query.len()
        ));
    }
    if q.block_tables.len() != rows * q.table_width {
        return fail(format!("block tables must be [{rows}, {}]", q.table_width));
    }
    let num_blocks = kv.keys.len() / block_len;
    for (row, &len) in q.seq_lens.iter().enumerate() {
        let len = usize::try_from(len).unwrap_or(0);
        if len == 0 || len > q.table_width * kv.block_size {
            return fail(format!(
                "row {row}: sequence length {} outside 1..={}",
                q.seq_lens[row],
                q.table_width * kv.block_size
            ));
        }
        let table = &q.block_tables[row * q.table_width..][..len.div_ceil(kv.block_size)];
        if let Some(bad) = table.iter().find(|&&b| b < 0 || b as usize >= num_blocks) {
            return fail(format!("row {row}: block id {bad} outside the cache's {num_blocks} blocks"));
        }
    }
    Ok(())
}

/// Row boundaries `[0, .., rows]` splitting the total context into `parts` near-equal runs.
fn balanced_bounds(seq_lens: &[i32], parts: usize) -> Vec<usize> {
    let total: usize = seq_lens.iter().map(|&l| l as usize).sum();
    let mut bounds = vec![0];
    let mut done = 0;
    for (row, &len) in seq_lens.iter().enumerate() {
        done += len as usize;
        let target = total * bounds.len() / parts;
        if bounds.len() < parts && done >= target && row + 1 < seq_lens.len() {
            bounds.push(row + 1);
        }
    }
    bounds.push(seq_lens.len());
    bounds
}

/// Rows `rows`, KV heads `kv_heads` (and their query heads) of every row: `out` holds those
/// heads' outputs of those rows, row after row (one row when the heads are a part).
fn attend_rows(
    q: &DecodeQueries<'_>,
    kv: &PagedKv<'_>,
    rows: Range<usize>,
    kv_heads: Range<usize>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if kv.head_dim % 8 == 0
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        // SAFETY: the CPU supports the features the function is compiled for.
        unsafe { attend_rows_avx2(q, kv, rows, kv_heads, out) };
        return;
    }
    attend_rows_with::<Portable>(q, kv, rows, kv_heads, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_rows_avx2(
    q: &DecodeQueries<'_>,
    kv: &PagedKv<'_>,
    rows: Range<usize>,
    kv_heads: Range<usize>,
    out: &mut [f32],
) {
    attend_rows_with::<Avx2>(q, kv, rows, kv_heads, out);
}

#[inline(always)]
fn attend_rows_with<S: Ops>(
    q: &DecodeQueries<'_>,
    kv: &PagedKv<'_>,
    rows: Range<usize>,
    kv_heads: Range<usize>,
    out: &mut [f32],
) {
    let (d, bs) = (kv.head_dim, kv.block_size);
    let group = q.heads / kv.kv_heads;
    // The query heads of `kv_heads`; `h` below counts from the first of them.
    let (first_head, heads) = (kv_heads.start * group, kv_heads.len() * group);
    let first_kv = kv_heads.start;
    let slot_len = kv.kv_heads * d;
    let runs = sequence_runs(q, rows.clone());
    // Scores of a run, row-major then head-major: scores[(i * heads + h) * span + t] for
    // the run's i-th row and position first + t, `first` and `span` the run's.
    let longest = runs
        .iter()
        .map(|run| run.len() * (q.seq_lens[run.end - 1] as usize - q.first_position(run.start)))
        .max()
        .unwrap_or(0);
    let mut scores = vec![0f32; heads * longest];
    let mut inverse_sums = vec![0f32; heads * runs.iter().map(|run| run.len()).max().unwrap_or(0)];
    let mut out_rows = out.chunks_exact_mut(heads * d);
    for run in runs {
        let (first, end) = (q.first_position(run.start), q.seq_lens[run.end - 1] as usize);
        let span = end - first;
        // Row i of the run sees positions bounds[i] (its window's first .. its length).
        let bounds: Vec<Range<usize>> =
            run.clone().map(|row| q.first_position(row) - first..q.seq_lens[row] as usize - first).collect();
        let table = &q.block_tables[run.start * q.table_width..][..end.div_ceil(bs)];
        let scores = &mut scores[..run.len() * heads * span];
        for (t, (slot, ahead)) in slots(table, bs, first, end).enumerate() {
            S::prefetch(&kv.keys[ahead * slot_len..][..slot_len]);
            let keys = &kv.keys[slot * slot_len..][..slot_len];
            for (i, row) in run.clone().enumerate() {
                if !bounds[i].contains(&t) {
                    continue;
                }
                let query = &q.query[(row * q.heads + first_head) * d..][..heads * d];
                for (h, qh) in query.chunks_exact(d).enumerate() {
                    let k = &keys[(first_kv + h / group) * d..][..d];
                    scores[(i * heads + h) * span + t] = S::dot(qh, k) * q.scale;
                }
            }
        }
        for (i, row_scores) in scores.chunks_exact_mut(heads * span).enumerate() {
            for (h, head_scores) in row_scores.chunks_exact_mut(span).enumerate() {
                let seen = &mut head_scores[bounds[i].clone()];
                if q.softcap > 0.0 {
                    let cap = q.softcap;
                    seen.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
                }
                let top = max(seen);
                inverse_sums[i * heads + h] = 1.0 / exp_shifted_in_place(seen, top);
            }
        }
        let mut run_out: Vec<&mut [f32]> = out_rows.by_ref().take(run.len()).collect();
        run_out.iter_mut().for_each(|row_out| row_out.fill(0.0));
        for (t, (slot, ahead)) in slots(table, bs, first, end).enumerate() {
            S::prefetch(&kv.values[ahead * slot_len..][..slot_len]);
            let values = &kv.values[slot * slot_len..][..slot_len];
            for (i, out_row) in run_out.iter_mut().enumerate() {
                if !bounds[i].contains(&t) {
                    continue;
                }
                for (h, acc) in out_row.chunks_exact_mut(d).enumerate() {
                    let weight = scores[(i * heads + h) * span + t];
                    S::axpy(acc, weight, &values[(first_kv + h / group) * d..][..d]);
                }
            }
        }
        for (i, out_row) in run_out.iter_mut().enumerate() {
            for (h, acc) in out_row.chunks_exact_mut(d).enumerate() {
                let inverse = inverse_sums[i * heads + h];
                acc.iter_mut().for_each(|x| *x *= inverse);
            }
        }
    }
}

/// `rows` as runs of consecutive rows that are one sequence's successive tokens (a
/// verification step's entries handed over a row per token): the same block table and
/// lengths that grow by one. A run's K and V are read once for all its rows, each row
/// scoring and summing the positions it sees; every row's arithmetic is what it would be
/// alone.
fn sequence_runs(q: &DecodeQueries<'_>, rows: Range<usize>) -> Vec<Range<usize>> {
    let table = |row: usize| &q.block_tables[row * q.table_width..][..q.table_width];
    let mut runs: Vec<Range<usize>> = Vec::new();
    for row in rows {
        match runs.last_mut() {
            Some(run) if q.seq_lens[row] == q.seq_lens[row - 1] + 1 && table(row) == table(run.start) => {
                run.end = row + 1
            }
            _ => runs.push(row..row + 1),
        }
    }
    runs
}

/// How far ahead, in blocks, a row's K / V are prefetched. Blocks are scattered over the
/// cache, so the hardware prefetcher cannot guess the next one; on randomly scattered
/// tables (2 cores, 128 rows of 384 positions) four blocks ahead ran 1.35x faster than one.
/// Today `Ops::prefetch` is the trait's no-op for both ops (`vector.rs`), so the requests go
/// nowhere: on the Intel Xeon development VM, issuing them (every line of the slot 4 blocks
/// ahead, or of the next slot with this slot's values) changed nothing on a cold short context (batch
/// 1, 50 positions, about 68 us a layer once a decode step's weights have streamed through
/// the caches, 18 us warm) and cost at 1,000 warm positions (305 -> 403 us); not kept.
const PREFETCH_BLOCKS: usize = 4;

/// The cache slots of a row's positions `first..end`, in order, each with the slot
/// [`PREFETCH_BLOCKS`] ahead (the same offset in that block; the slot itself near the end).
/// Blocks wholly before `first` are skipped, never touched.
#[inline(always)]
fn slots(
    table: &[i32],
    block_size: usize,
    first: usize,
    end: usize,
) -> impl Iterator<Item = (usize, usize)> + '_ {
    let first_block = first / block_size;
    table.iter().enumerate().skip(first_block).flat_map(move |(i, &block)| {
        let start = block as usize * block_size;
        let next = table.get(i + PREFETCH_BLOCKS).map_or(start, |&b| b as usize * block_size);
        let from = if i == first_block { first - i * block_size } else { 0 };
        let filled = (end - i * block_size).min(block_size);
        (from..filled).map(move |offset| (start + offset, next + offset))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward attention over the gathered context, in f64.
    fn reference(q: &DecodeQueries<'_>, kv: &PagedKv<'_>) -> Vec<f32> {
        let (heads, d, bs) = (q.heads, kv.head_dim, kv.block_size);
        let group = heads / kv.kv_heads;
        let mut out = vec![0f32; q.seq_lens.len() * heads * d];
        for (row, &len) in q.seq_lens.iter().enumerate() {
            let len = len as usize;
            let first = if q.window == 0 { 0 } else { len.saturating_sub(q.window) };
            for h in 0..heads {
                let kvh = h / group;
                let qh = &q.query[(row * heads + h) * d..][..d];
                let slot_of = |t: usize| q.block_tables[row * q.table_width + t / bs] as usize * bs + t % bs;
                let at = |t: usize| (slot_of(t) * kv.kv_heads + kvh) * d;
                let scores: Vec<f64> = (0..len)
                    .map(|t| {
                        if t < first {
                            return f64::NEG_INFINITY;
                        }
                        let k = &kv.keys[at(t)..][..d];
                        let s = qh.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
                            * q.scale as f64;
                        if q.softcap > 0.0 {
                            q.softcap as f64 * (s / q.softcap as f64).tanh()
                        } else {
                            s
                        }
                    })
                    .collect();
                let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                let total: f64 = weights.iter().sum();
                for i in 0..d {
                    let value: f64 = (first..len).map(|t| weights[t] * kv.values[at(t) + i] as f64).sum();
                    out[(row * heads + h) * d + i] = (value / total) as f32;
                }
            }
        }
        out
    }

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    fn case(heads: usize, kv_heads: usize, head_dim: usize, seq_lens: &[i32], threads: usize) {
        case_with(heads, kv_heads, head_dim, seq_lens, threads, 0, 0.0);
    }

    fn case_with(
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        seq_lens: &[i32],
        threads: usize,
        window: usize,
        softcap: f32,
    ) {
        let own: Vec<usize> = (0..seq_lens.len()).collect();
        case_tables(heads, kv_heads, head_dim, seq_lens, &own, threads, window, softcap);
    }

    /// Row r reads table `table_of[r]` (rows sharing one: a sequence's tokens as rows).
    #[allow(clippy::too_many_arguments)]
    fn case_tables(
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        seq_lens: &[i32],
        table_of: &[usize],
        threads: usize,
        window: usize,
        softcap: f32,
    ) {
        let (block_size, num_blocks, width) = (4, 64, 40);
        let block_len = block_size * kv_heads * head_dim;
        let keys = pseudo_random(num_blocks * block_len, 1);
        let values = pseudo_random(num_blocks * block_len, 2);
        let query = pseudo_random(seq_lens.len() * heads * head_dim, 3);
        // Scattered, reversed block ids so that a wrong slot computation shows.
        let tables: Vec<i32> = table_of
            .iter()
            .flat_map(|&t| {
                (t * width..(t + 1) * width).map(|i| (num_blocks - 1 - (i * 5) % num_blocks) as i32)
            })
            .collect();
        let kv = PagedKv { keys: &keys, values: &values, block_size, kv_heads, head_dim };
        let q = DecodeQueries {
            query: &query,
            heads,
            block_tables: &tables,
            table_width: width,
            seq_lens,
            scale: (head_dim as f32).powf(-0.5),
            window,
            softcap,
        };
        let mut out = vec![f32::NAN; query.len()];
        paged_decode_attention(&q, &kv, &mut out, threads).unwrap();
        for (got, want) in out.iter().zip(reference(&q, &kv)) {
            assert!((got - want).abs() < 2e-5, "{got} vs {want}");
        }
    }

    #[test]
    fn matches_reference_for_gqa_shapes_and_ragged_lengths() {
        case(4, 2, 64, &[1, 5, 48, 17, 33], 1);
        case(6, 3, 24, &[7, 1, 2], 1);
        case(8, 1, 128, &[40, 3], 1);
        case(2, 2, 16, &[48; 3], 1);
    }

    #[test]
    fn a_window_attends_to_the_last_positions_only() {
        // Windows inside one block, across block edges, longer than some rows.
        case_with(4, 2, 64, &[1, 5, 48, 17, 33], 1, 3, 0.0);
        case_with(6, 3, 24, &[7, 1, 2, 45], 1, 8, 0.0);
        case_with(8, 1, 128, &[40, 3], 1, 13, 0.0);
        let lens: Vec<i32> = (0..40).map(|i| 1 + (i * 7) % 48).collect();
        case_with(4, 2, 64, &lens, 3, 9, 0.0);
    }

    #[test]
    fn soft_capped_scores_match_the_reference() {
        case_with(4, 2, 64, &[1, 5, 48, 17, 33], 1, 0, 0.5);
        case_with(6, 3, 24, &[7, 1, 2, 45], 2, 10, 2.0);
    }

    #[test]
    fn threads_split_rows_without_changing_results() {
        let lens: Vec<i32> = (0..40).map(|i| 1 + (i * 7) % 48).collect();
        case(4, 2, 64, &lens, 3);
        assert_eq!(balanced_bounds(&[10, 10, 10, 10], 2), vec![0, 2, 4]);
        assert_eq!(balanced_bounds(&[100, 1, 1], 3), vec![0, 1, 2, 3]);
        assert_eq!(balanced_bounds(&[5], 4), vec![0, 1]);
    }

    #[test]
    fn threads_split_a_rows_kv_heads_when_rows_are_fewer() {
        // One row on two threads, an uneven split of 3 KV heads, two rows on four.
        case(16, 4, 32, &[160], 2);
        case(12, 3, 16, &[160], 2);
        case(16, 8, 16, &[150, 140], 4);
        case_with(16, 4, 32, &[157], 2, 100, 0.0);
    }

    #[test]
    fn a_sequences_tokens_as_rows_read_its_kv_once_and_match_the_reference() {
        // Rows 1-5 one sequence's tokens (lengths 20..=24), row 0 another sequence, rows 6-7
        // a third of 2 tokens; then a run that breaks where the lengths stop growing by one.
        const LENS: [i32; 8] = [9, 20, 21, 22, 23, 24, 40, 41];
        let lens = LENS;
        let table_of = [0, 1, 1, 1, 1, 1, 2, 2];
        assert_eq!(sequence_runs(&queries_of(&LENS, &table_of), 0..8), vec![0..1, 1..6, 6..8]);
        for threads in [1, 2, 3] {
            case_tables(4, 2, 64, &lens, &table_of, threads, 0, 0.0);
            case_tables(6, 3, 24, &lens, &table_of, threads, 7, 0.0); // windows inside the run
            case_tables(4, 2, 64, &lens, &table_of, threads, 0, 1.5);
        }
        const BROKEN: [i32; 4] = [30, 31, 31, 32];
        let broken = BROKEN;
        assert_eq!(sequence_runs(&queries_of(&BROKEN, &[0; 4]), 0..4), vec![0..2, 2..4]);
        case_tables(8, 1, 128, &broken, &[0; 4], 1, 0, 0.0);
        // The same lengths over different tables are not a run.
        assert_eq!(sequence_runs(&queries_of(&[5, 6], &[0, 1]), 0..2), vec![0..1, 1..2]);
    }

    /// Queries over `table_of`'s tables (as `case_tables` lays them out) for `sequence_runs`.
    fn queries_of(seq_lens: &'static [i32], table_of: &[usize]) -> DecodeQueries<'static> {
        let tables: Vec<i32> = table_of.iter().flat_map(|&t| [t as i32, 100 + t as i32]).collect();
        DecodeQueries {
            query: &[],
            heads: 1,
            block_tables: Vec::leak(tables),
            table_width: 2,
            seq_lens,
            scale: 1.0,
            window: 0,
            softcap: 0.0,
        }
    }

    #[test]
    fn bad_arguments_are_refused() {
        let (keys, values) = (vec![0f32; 2 * 4 * 2 * 8], vec![0f32; 2 * 4 * 2 * 8]);
        let kv = PagedKv { keys: &keys, values: &values, block_size: 4, kv_heads: 2, head_dim: 8 };
        let query = vec![0f32; 4 * 8];
        let mut out = vec![0f32; 4 * 8];
        let q = |seq_lens: &'static [i32], tables: &'static [i32]| DecodeQueries {
            query: &query,
            heads: 4,
            block_tables: tables,
            table_width: 2,
            seq_lens,
            scale: 1.0,
            window: 0,
            softcap: 0.0,
        };
        assert!(paged_decode_attention(&q(&[8], &[0, 1]), &kv, &mut out, 1).is_ok());
        let error = paged_decode_attention(&q(&[9], &[0, 1]), &kv, &mut out, 1).unwrap_err();
        assert!(error.to_string().contains("sequence length 9"), "{error}");
        let error = paged_decode_attention(&q(&[5], &[0, 7]), &kv, &mut out, 1).unwrap_err();
        assert!(error.to_string().contains("block id 7"), "{error}");
        let error = paged_decode_attention(&q(&[0], &[0, 1]), &kv, &mut out, 1).unwrap_err();
        assert!(error.to_string().contains("outside 1..=8"), "{error}");
    }
}
