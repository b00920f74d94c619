//! How a kernel spreads its parts over threads.
//!
//! PyTorch's CPU operators run on an OpenMP team whose workers spin for milliseconds after
//! each operator before they sleep. A kernel that starts threads of its own between two
//! operators competes with those spinning workers for the same cores and gains nothing.
//! So when the process has libgomp loaded (PyTorch's Linux wheels do), the parts run as an
//! OpenMP parallel region on that same team, whose workers pick them up at once; otherwise
//! on scoped threads.

/// Frees the OpenMP worker threads of the calling thread's team (OpenMP 5.0
/// `omp_pause_resource_all`, soft); a later parallel region on this thread starts them
/// again. Returns whether libgomp is loaded and did so.
///
/// Why an engine wants this: libgomp counts the workers of every thread's team, idle or
/// not, and once they outnumber the CPUs it cuts its spin-wait to about a hundred
/// iterations. The thread that loaded the model keeps an idle team of its own, so the
/// executor thread's team then went to sleep on a futex after every PyTorch operator and
/// woke for the next: on 2 cores a decode step's matmuls took 1.4-1.9x as long and its
/// reductions up to 10x. Freeing the idle team lifts the throttle.
pub fn release_calling_thread_workers() -> bool {
    #[cfg(target_os = "linux")]
    if let Some(pause) = openmp::loaded().and_then(|openmp| openmp.pause_all) {
        // SAFETY: `omp_pause_resource_all(omp_pause_soft)` takes an int and returns an int;
        // libgomp refuses (returns non-zero) when called inside a parallel region.
        return unsafe { pause(OMP_PAUSE_SOFT) } == 0;
    }
    false
}

/// `omp_pause_soft` of `omp_pause_resource_t` (OpenMP 5.0).
#[cfg(target_os = "linux")]
const OMP_PAUSE_SOFT: std::ffi::c_int = 1;

/// Runs `work(part)` once for every part in `0..parts`, possibly concurrently, and
/// returns when all are done. A panic in a part is raised again here.
pub fn for_each_part(parts: usize, work: &(dyn Fn(usize) + Sync)) {
    if parts <= 1 {
        (0..parts).for_each(work);
        return;
    }
    #[cfg(target_os = "linux")]
    if let Some(openmp) = openmp::loaded() {
        openmp.for_each_part(parts, work);
        return;
    }
    std::thread::scope(|scope| {
        for part in 1..parts {
            scope.spawn(move || work(part));
        }
        work(0);
    });
}

#[cfg(target_os = "linux")]
mod openmp {
    use std::ffi::{c_int, c_uint, c_void, CString};
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::OnceLock;

    /// A part's panic, caught on the thread that ran it (unwinding must not cross OpenMP's
    /// C frames) and raised again by the caller.
    struct PanicFlag(AtomicBool);

    impl PanicFlag {
        fn run(&self, work: impl FnOnce()) {
            if catch_unwind(AssertUnwindSafe(work)).is_err() {
                self.0.store(true, Ordering::Relaxed);
            }
        }
    }

    type ParallelFn = unsafe extern "C" fn(unsafe extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
    type QueryFn = unsafe extern "C" fn() -> c_int;
    type PauseFn = unsafe extern "C" fn(c_int) -> c_int;

    /// The entry points of the libgomp already loaded into the process.
    pub struct OpenMp {
        parallel: ParallelFn,
        thread_num: QueryFn,
        num_threads: QueryFn,
        /// `omp_pause_resource_all`, absent before GCC 9's libgomp.
        pub pause_all: Option<PauseFn>,
    }

    /// libgomp if some library (PyTorch) loaded it before the first kernel call; looked up
    /// once, never loaded by us.
    pub fn loaded() -> Option<&'static OpenMp> {
        static FOUND: OnceLock<Option<OpenMp>> = OnceLock::new();
        FOUND.get_or_init(find).as_ref()
    }

    fn find() -> Option<OpenMp> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let path = maps
            .lines()
            .filter_map(|line| line.split_whitespace().nth(5))
            .find(|path| path.rsplit('/').next().is_some_and(|name| name.starts_with("libgomp")))?;
        let path = CString::new(path).ok()?;
        // SAFETY: RTLD_NOLOAD only returns a handle to a library that is already loaded; the
        // symbols are libgomp's documented entry points, with these C signatures.
        unsafe {
            let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            if handle.is_null() {
                return None;
            }
            let symbol = |name: &str| {
                let name = CString::new(name).expect("no NUL in symbol names");
                let address = libc::dlsym(handle, name.as_ptr());
                (!address.is_null()).then_some(address)
            };
            Some(OpenMp {
                parallel: std::mem::transmute::<*mut c_void, ParallelFn>(symbol("GOMP_parallel")?),
                thread_num: std::mem::transmute::<*mut c_void, QueryFn>(symbol("omp_get_thread_num")?),
                num_threads: std::mem::transmute::<*mut c_void, QueryFn>(symbol("omp_get_num_threads")?),
                pause_all: symbol("omp_pause_resource_all")
                    .map(|address| std::mem::transmute::<*mut c_void, PauseFn>(address)),
            })
        }
    }

    struct Job<'a> {
        work: &'a (dyn Fn(usize) + Sync),
        parts: usize,
        thread_num: QueryFn,
        num_threads: QueryFn,
        panicked: PanicFlag,
    }

    /// Runs on every member of the team; the team may be smaller than asked for, so each
    /// member takes every `team`-th part.
    unsafe extern "C" fn run_parts(data: *mut c_void) {
        // SAFETY: `data` is the `Job` that `for_each_part` keeps alive until GOMP_parallel returns.
        let job = unsafe { &*(data as *const Job<'_>) };
        let (me, team) = unsafe { ((job.thread_num)(), (job.num_threads)()) };
        let (me, team) = (me.max(0) as usize, team.max(1) as usize);
        for part in (me..job.parts).step_by(team) {
            job.panicked.run(|| (job.work)(part));
        }
    }

    impl OpenMp {
        pub fn for_each_part(&self, parts: usize, work: &(dyn Fn(usize) + Sync)) {
            let job = Job {
                work,
                parts,
                thread_num: self.thread_num,
                num_threads: self.num_threads,
                panicked: PanicFlag(AtomicBool::new(false)),
            };
            let threads = c_uint::try_from(parts).unwrap_or(c_uint::MAX);
            // SAFETY: GOMP_parallel runs `run_parts(&job)` on a team of at most `threads` and
            // returns after all of them finished; `run_parts` does not unwind.
            unsafe { (self.parallel)(run_parts, &job as *const Job<'_> as *mut c_void, threads, 0) };
            assert!(!job.panicked.0.load(Ordering::Relaxed), "a kernel part panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_part_runs_once() {
        let done: Vec<AtomicUsize> = (0..5).map(|_| AtomicUsize::new(0)).collect();
        for_each_part(5, &|part| {
            done[part].fetch_add(1, Ordering::Relaxed);
        });
        assert!(done.iter().all(|d| d.load(Ordering::Relaxed) == 1));
    }
}
