//! Collectives between the processes of one host through a shared-memory segment: the
//! tensor-parallel ranks that an engine starts on its own machine.
//!
//! Why: gloo's all-reduce goes through loopback TCP. On a busy 2-core host one all-reduce
//! of a decode step's `[32, 256]` float32 activations cost about 0.7 ms, a step has nine,
//! and together they took longer than the model's compute. Here a collective is one copy
//! into the segment, one wait on the peers' arrival words, and a read of every rank's
//! slot: tens of microseconds.
//!
//! The segment (created by rank 0, mapped by every rank, zeroed at creation):
//!
//! - line 0: the abort word: 0, or 1 + the rank that gave up waiting (its peer died or
//!   never came), so that the others stop at once instead of waiting their own timeout;
//!   then the count of ranks asleep on a bell;
//! - lines `1 ..= N`: rank r's arrival word, the last generation it reached (each
//!   collective, or each chunk of one, is one generation: 1, 2, ...), then its bell, a
//!   32-bit counter it rings on each arrival;
//! - lines `N + 1 ..= 2N`: rank r's process id (0 until it attached), watched by the
//!   waiting ranks so that a dead peer fails the collective within milliseconds;
//! - two banks of N slots of `slot_bytes`; generation g uses bank `g % 2`.
//!
//! One wait per generation suffices. A rank writes its slot of bank `g % 2` only at
//! generation g, and again at g + 2, which it reaches only after every rank arrived at
//! g + 1, that is after every rank finished reading generation g's slots.
//!
//! A waiting rank spins briefly, then yields its core for up to 300 us, then sleeps on
//! the awaited rank's bell (a futex on Linux, woken by the rank when it arrives, and
//! only when the sleepers count says someone sleeps). Sleeping in the kernel matters on
//! a host with more runnable threads than cores: a rank that napped and polled instead
//! waited for the scheduler after each nap, and the step's nine all-reduces took three
//! times as long as gloo's (which sleeps in `recv`). Every access of the handshake
//! (arrival, bell, sleepers count) is sequentially consistent: the arriving rank stores
//! its arrival, rings, then reads the count; the sleeper reads the bell, counts itself,
//! then reads the arrival; so either the sleeper sees the arrival or the arriving rank
//! sees the sleeper (and the kernel refuses to sleep on a bell rung since it was read).
//!
//! Every rank sums the slots in rank order (0, 1, ...), from the same bytes, with the same
//! arithmetic: the result is bit-identical on every rank.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;

/// Bytes of one header line (one word each, on its own cache line).
const LINE: usize = 64;
/// Spins before a waiting rank starts yielding its core.
const SPINS: u32 = 256;
/// How long a waiting rank yields its core before it sleeps on the awaited rank's bell.
const YIELD_FOR: Duration = Duration::from_micros(300);
/// How often a waiting rank checks that the ranks it waits for still exist (also the
/// longest it sleeps on a bell at a time).
const LIVENESS_EVERY: Duration = Duration::from_millis(10);
/// Byte offset, inside a rank's arrival line, of its bell (and inside line 0 of the
/// sleepers count): 32-bit words for the kernel's futex.
const BELL: usize = 8;

/// Element types a reduction sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementType {
    F32,
    /// bfloat16, summed in float32 and rounded once (to nearest, ties to even).
    BF16,
}

impl ElementType {
    pub fn size(self) -> usize {
        match self {
            ElementType::F32 => 4,
            ElementType::BF16 => 2,
        }
    }
}

/// Why a collective failed; the group cannot run another one.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum GroupError {
    #[error("{0}")]
    BadArgument(String),
    #[error("rank {rank} (pid {pid}) exited during a shared-memory collective")]
    PeerExited { rank: usize, pid: u64 },
    #[error("rank {rank} did not reach the shared-memory collective within {seconds:.1} s")]
    TimedOut { rank: usize, seconds: f64 },
    #[error("rank {0} abandoned the shared-memory collective (a peer of it died or timed out)")]
    Abandoned(usize),
}

/// The header and slot bytes of a group of `world` ranks.
pub fn segment_bytes(world: usize, slot_bytes: usize) -> usize {
    header_bytes(world) + 2 * world * slot_bytes
}

fn header_bytes(world: usize) -> usize {
    LINE * (1 + 2 * world)
}

/// One rank's handle on a group's segment (a view; the segment's mapping outlives it).
pub struct HostGroup {
    base: *mut u8,
    rank: usize,
    world: usize,
    slot_bytes: usize,
}

// SAFETY: the segment is shared memory that other processes write too: every word more
// than one rank touches is an atomic, and the slots are written and read only in the
// order the arrival words publish (see the module documentation).
unsafe impl Send for HostGroup {}
unsafe impl Sync for HostGroup {}

impl HostGroup {
    /// A view of `memory` (the whole mapped segment) as `rank` of `world`.
    pub fn new(memory: &mut [u8], rank: usize, world: usize, slot_bytes: usize) -> Result<Self, GroupError> {
        if world == 0 || rank >= world {
            return Err(GroupError::BadArgument(format!("rank {rank} is not in a group of {world}")));
        }
        if slot_bytes == 0 || slot_bytes % LINE != 0 {
            return Err(GroupError::BadArgument(format!(
                "slot_bytes {slot_bytes} must be a positive multiple of {LINE}"
            )));
        }
        if memory.len() < segment_bytes(world, slot_bytes) {
            return Err(GroupError::BadArgument(format!(
                "the segment has {} bytes, a group of {world} with {slot_bytes}-byte slots needs {}",
                memory.len(),
                segment_bytes(world, slot_bytes)
            )));
        }
        if memory.as_ptr() as usize % 8 != 0 {
            return Err(GroupError::BadArgument("the segment is not 8-byte aligned".into()));
        }
        Ok(HostGroup { base: memory.as_mut_ptr(), rank, world, slot_bytes })
    }

    fn word(&self, line: usize) -> &AtomicU64 {
        // SAFETY: `line` is inside the header (checked by the callers' indices), the base is
        // 8-byte aligned and the segment outlives `self`.
        unsafe { &*(self.base.add(line * LINE) as *const AtomicU64) }
    }

    fn bell(&self, rank: usize) -> &AtomicU32 {
        // SAFETY: inside rank's arrival line, 4-byte aligned (lines are 64-byte aligned).
        unsafe { &*(self.base.add((1 + rank) * LINE + BELL) as *const AtomicU32) }
    }

    fn sleepers(&self) -> &AtomicU32 {
        // SAFETY: inside line 0, 4-byte aligned.
        unsafe { &*(self.base.add(BELL) as *const AtomicU32) }
    }

    fn abort_word(&self) -> &AtomicU64 {
        self.word(0)
    }

    fn arrival(&self, rank: usize) -> &AtomicU64 {
        self.word(1 + rank)
    }

    fn pid(&self, rank: usize) -> &AtomicU64 {
        self.word(1 + self.world + rank)
    }

    fn slot(&self, bank: u64, rank: usize) -> *mut u8 {
        let index = (bank as usize % 2) * self.world + rank;
        // SAFETY: inside the segment (its size was checked against this layout).
        unsafe { self.base.add(header_bytes(self.world) + index * self.slot_bytes) }
    }

    /// Records this rank's process id, which the others watch while they wait for it.
    pub fn register(&self, pid: u64) {
        self.pid(self.rank).store(pid, Ordering::Release);
    }

    /// Sums `data` (elements of `element`) over the ranks, in place; every rank passes the
    /// same length. Each wait for the peers is bounded by `timeout`.
    pub fn all_reduce(
        &self,
        data: &mut [u8],
        element: ElementType,
        timeout: Duration,
    ) -> Result<(), GroupError> {
        if data.len() % element.size() != 0 {
            return Err(GroupError::BadArgument(format!(
                "{} bytes are not whole {element:?} elements",
                data.len()
            )));
        }
        for chunk in data.chunks_mut(self.slot_bytes) {
            let generation = self.publish(chunk)?;
            self.wait_for_all(generation, timeout)?;
            let slots: Vec<&[u8]> = (0..self.world)
                // SAFETY: generation's slots are complete (every rank arrived) and no rank
                // writes them again before this rank arrives at generation + 1.
                .map(|rank| unsafe { std::slice::from_raw_parts(self.slot(generation, rank), chunk.len()) })
                .collect();
            sum_in_rank_order(&slots, chunk, element);
        }
        Ok(())
    }

    /// Gathers every rank's `data` (the same length on every rank) into `out` on rank 0
    /// (`world * data.len()` bytes, rank r's at `r * data.len()`); the other ranks pass None.
    pub fn gather(
        &self,
        data: &[u8],
        mut out: Option<&mut [u8]>,
        timeout: Duration,
    ) -> Result<(), GroupError> {
        let expected = (self.rank == 0).then_some(self.world * data.len());
        if out.as_ref().map(|o| o.len()) != expected {
            return Err(GroupError::BadArgument(format!(
                "gather: rank {} must pass {} output bytes, got {:?}",
                self.rank,
                expected.map_or("no".to_string(), |n| n.to_string()),
                out.as_ref().map(|o| o.len())
            )));
        }
        for (index, chunk) in data.chunks(self.slot_bytes).enumerate() {
            let offset = index * self.slot_bytes;
            let generation = self.publish(chunk)?;
            self.wait_for_all(generation, timeout)?;
            if let Some(out) = out.as_deref_mut() {
                for rank in 0..self.world {
                    let start = rank * data.len() + offset;
                    // SAFETY: as in `all_reduce`.
                    let slot =
                        unsafe { std::slice::from_raw_parts(self.slot(generation, rank), chunk.len()) };
                    out[start..start + chunk.len()].copy_from_slice(slot);
                }
            }
        }
        Ok(())
    }

    /// Copies `chunk` into this rank's slot of the next generation and announces it.
    fn publish(&self, chunk: &[u8]) -> Result<u64, GroupError> {
        let by = self.abort_word().load(Ordering::Acquire);
        if by != 0 {
            return Err(GroupError::Abandoned(by as usize - 1));
        }
        let generation = self.arrival(self.rank).load(Ordering::Relaxed) + 1;
        // SAFETY: this rank's slot of bank `generation % 2`, which no rank reads until this
        // rank's arrival word says `generation` (below), and which the others finished
        // reading at generation - 2 (see the module documentation).
        unsafe {
            std::ptr::copy_nonoverlapping(chunk.as_ptr(), self.slot(generation, self.rank), chunk.len())
        };
        self.arrival(self.rank).store(generation, Ordering::SeqCst);
        self.bell(self.rank).fetch_add(1, Ordering::SeqCst);
        if self.sleepers().load(Ordering::SeqCst) > 0 {
            futex_wake(self.bell(self.rank));
        }
        Ok(generation)
    }

    /// Waits until every rank arrived at `generation`: spins briefly, then yields its core,
    /// then sleeps on the awaited rank's bell, checking that the awaited ranks still exist;
    /// a dead or late rank makes every rank of the group fail (the abort word).
    fn wait_for_all(&self, generation: u64, timeout: Duration) -> Result<(), GroupError> {
        let start = Instant::now();
        let mut next_check = start + LIVENESS_EVERY;
        let mut looks: u32 = 0;
        for rank in 0..self.world {
            while self.arrival(rank).load(Ordering::Acquire) < generation {
                let by = self.abort_word().load(Ordering::Acquire);
                if by != 0 {
                    return Err(GroupError::Abandoned(by as usize - 1));
                }
                looks = looks.saturating_add(1);
                if looks < SPINS {
                    std::hint::spin_loop();
                    continue;
                }
                let now = Instant::now();
                if now >= next_check {
                    next_check = now + LIVENESS_EVERY;
                    let pid = self.pid(rank).load(Ordering::Acquire);
                    if pid != 0 && !process_exists(pid) {
                        return Err(self.abandon(GroupError::PeerExited { rank, pid }));
                    }
                    if now - start >= timeout {
                        return Err(
                            self.abandon(GroupError::TimedOut { rank, seconds: timeout.as_secs_f64() })
                        );
                    }
                }
                if now - start < YIELD_FOR {
                    std::thread::yield_now();
                } else {
                    self.sleep_on_bell(rank, generation);
                }
            }
        }
        Ok(())
    }

    /// Sleeps until `rank` rings its bell (or `LIVENESS_EVERY` passed), unless it has
    /// arrived at `generation` already.
    fn sleep_on_bell(&self, rank: usize, generation: u64) {
        let seen = self.bell(rank).load(Ordering::SeqCst);
        self.sleepers().fetch_add(1, Ordering::SeqCst);
        if self.arrival(rank).load(Ordering::SeqCst) < generation {
            futex_wait(self.bell(rank), seen, LIVENESS_EVERY);
        }
        self.sleepers().fetch_sub(1, Ordering::SeqCst);
    }

    fn abandon(&self, error: GroupError) -> GroupError {
        let _ =
            self.abort_word().compare_exchange(0, self.rank as u64 + 1, Ordering::AcqRel, Ordering::Acquire);
        error
    }
}

/// Sleeps while `word` holds `expected`, for at most `timeout` (a shared futex: the word
/// lives in memory mapped by several processes); returns early when woken.
#[cfg(target_os = "linux")]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let timeout = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: FUTEX_WAIT reads the aligned 32-bit word and sleeps while it equals
    // `expected`; the word outlives the call. An error (EAGAIN, EINTR) just returns.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &timeout as *const libc::timespec,
        );
    }
}

/// Wakes every process sleeping on `word`.
#[cfg(target_os = "linux")]
fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only reads the word's address.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// Without futexes: a short nap between looks.
#[cfg(not(target_os = "linux"))]
fn futex_wait(_word: &AtomicU32, _expected: u32, _timeout: Duration) {
    std::thread::sleep(Duration::from_micros(20));
}

#[cfg(not(target_os = "linux"))]
fn futex_wake(_word: &AtomicU32) {}

/// `out = slots[0] + slots[1] + ...`, element by element, in that order.
fn sum_in_rank_order(slots: &[&[u8]], out: &mut [u8], element: ElementType) {
    match element {
        ElementType::F32 => {
            // SAFETY: every bit pattern is a valid f32; `align_to` only reinterprets the aligned middle.
            let aligned: Option<Vec<&[f32]>> =
                slots.iter().map(|s| whole(unsafe { s.align_to::<f32>() })).collect();
            let (pre, target, post) = unsafe { out.align_to_mut::<f32>() };
            if let (Some(aligned), true) = (aligned, pre.is_empty() && post.is_empty()) {
                target.copy_from_slice(aligned[0]);
                for slot in &aligned[1..] {
                    target.iter_mut().zip(slot.iter()).for_each(|(sum, value)| *sum += *value);
                }
                return;
            }
            for (i, target) in out.chunks_exact_mut(4).enumerate() {
                let mut sum = f32_at(slots[0], i);
                for slot in &slots[1..] {
                    sum += f32_at(slot, i);
                }
                target.copy_from_slice(&sum.to_ne_bytes());
            }
        }
        ElementType::BF16 => {
            for (i, target) in out.chunks_exact_mut(2).enumerate() {
                let mut sum = bf16_at(slots[0], i);
                for slot in &slots[1..] {
                    sum += bf16_at(slot, i);
                }
                target.copy_from_slice(&f32_to_bf16(sum).to_ne_bytes());
            }
        }
    }
}

/// The middle of `align_to` when it is the whole slice.
fn whole<'a, T>((pre, middle, post): (&'a [u8], &'a [T], &'a [u8])) -> Option<&'a [T]> {
    (pre.is_empty() && post.is_empty()).then_some(middle)
}

fn f32_at(bytes: &[u8], i: usize) -> f32 {
    f32::from_ne_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}

fn bf16_at(bytes: &[u8], i: usize) -> f32 {
    let bits = u16::from_ne_bytes(bytes[2 * i..2 * i + 2].try_into().expect("2 bytes"));
    f32::from_bits(u32::from(bits) << 16)
}

/// Rounds to the nearest bfloat16, ties to even; NaN stays NaN.
fn f32_to_bf16(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// Whether process `pid` still runs (a zombie, exited but not yet reaped, does not).
pub fn process_exists(pid: u64) -> bool {
    #[cfg(target_os = "linux")]
    {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // The state is the first field after the command name's closing parenthesis.
            Ok(stat) => stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state != "Z" && state != "X"),
            Err(_) => false,
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
        // SAFETY: signal 0 only checks that the process exists.
        unsafe { libc::kill(pid, 0) == 0 || *libc::__error() == libc::EPERM }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const SLOT: usize = 128;

    /// A segment in this process's memory, 8-byte aligned.
    struct Segment(Vec<u64>);

    impl Segment {
        fn new(world: usize) -> Self {
            Segment(vec![0u64; segment_bytes(world, SLOT).div_ceil(8)])
        }

        fn group(&self, rank: usize, world: usize) -> HostGroup {
            let bytes = self.0.len() * 8;
            // SAFETY: the test's threads share the segment as processes would.
            let memory = unsafe { std::slice::from_raw_parts_mut(self.0.as_ptr() as *mut u8, bytes) };
            HostGroup::new(memory, rank, world, SLOT).expect("valid group")
        }
    }

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_ne_bytes()).collect()
    }

    fn f32_values(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks_exact(4).map(|b| f32::from_ne_bytes(b.try_into().unwrap())).collect()
    }

    #[test]
    fn ranks_sum_in_chunks_and_agree_bit_for_bit() {
        let world = 3;
        let segment = Arc::new(Segment::new(world));
        // 100 floats = 400 bytes: four chunks of a 128-byte slot; three rounds reuse both banks.
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| (0..100).map(|i| 0.1 * (i as f32) + 1e7 * (r as f32) - 0.3).collect())
            .collect();
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (segment, input) = (Arc::clone(&segment), inputs[rank].clone());
                    scope.spawn(move || {
                        let group = segment.group(rank, world);
                        (0..3)
                            .map(|_| {
                                let mut data = f32_bytes(&input);
                                group
                                    .all_reduce(&mut data, ElementType::F32, Duration::from_secs(10))
                                    .unwrap();
                                f32_values(&data)
                            })
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let expected: Vec<f32> = (0..100).map(|i| inputs[0][i] + inputs[1][i] + inputs[2][i]).collect();
        for per_rank in &results {
            for round in per_rank {
                assert_eq!(
                    round.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }

    #[test]
    fn a_late_rank_wakes_the_rank_asleep_on_its_bell() {
        let world = 2;
        let segment = Arc::new(Segment::new(world));
        let sums = std::thread::scope(|scope| {
            let late = {
                let segment = Arc::clone(&segment);
                scope.spawn(move || {
                    let group = segment.group(1, world);
                    let mut sums = vec![];
                    for round in 0..3 {
                        // Longer than the yielding phase: rank 0 is asleep on the bell by then.
                        std::thread::sleep(Duration::from_millis(30));
                        let mut data = f32_bytes(&[round as f32]);
                        group.all_reduce(&mut data, ElementType::F32, Duration::from_secs(10)).unwrap();
                        sums.push(f32_values(&data)[0]);
                    }
                    sums
                })
            };
            let group = segment.group(0, world);
            let mine: Vec<f32> = (0..3)
                .map(|_| {
                    let mut data = f32_bytes(&[10.0]);
                    group.all_reduce(&mut data, ElementType::F32, Duration::from_secs(10)).unwrap();
                    f32_values(&data)[0]
                })
                .collect();
            assert_eq!(late.join().unwrap(), mine);
            mine
        });
        assert_eq!(sums, vec![10.0, 11.0, 12.0]);
        assert_eq!(segment.group(0, world).sleepers().load(Ordering::SeqCst), 0);
    }

    #[test]
    fn bf16_sums_round_once_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie: to even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie: to even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert!(f32::from_bits(u32::from(f32_to_bf16(f32::NAN)) << 16).is_nan());
        let segment = Segment::new(1);
        let group = segment.group(0, 1);
        let mut data: Vec<u8> = [0x3f80u16, 0x4000].iter().flat_map(|v| v.to_ne_bytes()).collect();
        group.all_reduce(&mut data, ElementType::BF16, Duration::from_secs(1)).unwrap();
        assert_eq!(data, [0x3f80u16, 0x4000].iter().flat_map(|v| v.to_ne_bytes()).collect::<Vec<u8>>());
    }

    #[test]
    fn gather_puts_each_rank_at_its_offset_on_rank_0() {
        let world = 2;
        let segment = Arc::new(Segment::new(world));
        let gathered = std::thread::scope(|scope| {
            let worker = {
                let segment = Arc::clone(&segment);
                scope.spawn(move || {
                    let data = vec![7u8; 300];
                    segment.group(1, world).gather(&data, None, Duration::from_secs(10)).unwrap();
                })
            };
            let mut out = vec![0u8; 600];
            segment.group(0, world).gather(&[3u8; 300], Some(&mut out), Duration::from_secs(10)).unwrap();
            worker.join().unwrap();
            out
        });
        assert!(gathered[..300].iter().all(|&b| b == 3) && gathered[300..].iter().all(|&b| b == 7));
    }

    #[test]
    fn a_rank_that_never_comes_times_out_and_the_group_is_abandoned() {
        let segment = Segment::new(2);
        let group = segment.group(0, 2);
        let mut data = f32_bytes(&[1.0]);
        let error = group.all_reduce(&mut data, ElementType::F32, Duration::from_millis(50)).unwrap_err();
        assert_eq!(error, GroupError::TimedOut { rank: 1, seconds: 0.05 });
        let peer = segment.group(1, 2);
        assert_eq!(
            peer.all_reduce(&mut data, ElementType::F32, Duration::from_secs(1)),
            Err(GroupError::Abandoned(0))
        );
    }

    #[test]
    fn a_dead_peer_fails_the_wait_naming_it() {
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = u64::from(child.id());
        child.wait().unwrap();
        assert!(!process_exists(pid));
        assert!(process_exists(u64::from(std::process::id())));
        let segment = Segment::new(2);
        segment.group(1, 2).register(pid);
        let group = segment.group(0, 2);
        let mut data = f32_bytes(&[1.0]);
        let error = group.all_reduce(&mut data, ElementType::F32, Duration::from_secs(30)).unwrap_err();
        assert_eq!(error, GroupError::PeerExited { rank: 1, pid });
    }

    #[test]
    fn bad_arguments_are_refused() {
        let segment = Segment::new(2);
        let bytes = segment.0.len() * 8;
        let memory = unsafe { std::slice::from_raw_parts_mut(segment.0.as_ptr() as *mut u8, bytes) };
        assert!(HostGroup::new(memory, 2, 2, SLOT).is_err());
        let group = segment.group(1, 2);
        assert!(group.gather(&[1u8; 8], Some(&mut [0u8; 16]), Duration::from_secs(1)).is_err());
        let mut odd = vec![0u8; 6];
        assert!(group.all_reduce(&mut odd, ElementType::F32, Duration::from_secs(1)).is_err());
    }
}
