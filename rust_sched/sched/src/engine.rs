//! The scheduler thread (`pyengine-sched`) and the handle the other threads talk to.
//!
//! Commands (add, abort, finish, step result, step failure, stats, shutdown) arrive on one
//! bounded channel. Plans leave on a channel whose capacity is the pipeline depth, output
//! events on a bounded channel to the output thread. The thread never polls: it blocks on
//! the command channel when it has nothing to plan, and a blocked send gives way at once
//! to shutdown.

use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, select, Receiver, RecvTimeoutError, Sender, TrySendError};

use crate::attachment::Attachment;
use crate::config::SchedulerConfig;
use crate::error::{panic_message, SchedError, SchedResult};
use crate::plan::{FinishReason, OutputEvent, StepPlan};
use crate::request::{RequestSpec, SeqId};
use crate::scheduler::{Scheduler, SchedulerSnapshot, SpecResult};

/// Name of the scheduler's OS thread (at most 15 bytes, the Linux limit).
pub const THREAD_NAME: &str = "pyengine-sched";
/// Capacity of the command channel; senders block (back-pressure) when it is full.
const COMMAND_CAPACITY: usize = 65_536;
/// Capacity of the output-event channel.
const OUTPUT_CAPACITY: usize = 1024;
/// How long [`EngineHandle::start`] waits for the new thread to run under its name.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

enum Command {
    Add(Box<RequestSpec>, SeqId),
    Abort(String),
    Finish(SeqId, FinishReason),
    Result {
        step_id: u64,
        sampled: Vec<i64>,
        attachment: Option<Attachment>,
        drafts: DraftResult,
    },
    Fail {
        step_id: u64,
        attachment: Option<Attachment>,
    },
    Stats(Sender<SchedulerSnapshot>),
    /// The published hashes of every cached block (`BlockPool::cached_hashes`).
    CachedHashes(Sender<Vec<u64>>),
    /// Test hook: panic on the scheduler thread.
    Panic,
    Shutdown,
}

/// The speculative part of a step result, owned (see [`crate::scheduler::SpecResult`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftResult {
    /// `[S]` drafts accepted per sampled sequence; None when the plan had no drafts.
    pub num_accepted: Option<Vec<i32>>,
    /// `[S]` counts and flat tokens of the executor's drafts for the next step.
    pub next_drafts: Option<(Vec<i32>, Vec<i64>)>,
}

/// Figures of the scheduler thread and its scheduler, for `engine.stats()` (the bindings
/// turn them into a dict; the Python `pyengine.EngineStats` is a different type).
#[derive(Debug, Clone, Default)]
pub struct SchedulerThreadStats {
    pub scheduler: SchedulerSnapshot,
    /// Seconds the scheduler thread spent working (commands, planning, results).
    pub busy_seconds: f64,
    /// Seconds it spent blocked waiting for a command.
    pub idle_seconds: f64,
    /// Plans made and not yet taken by the executor.
    pub plan_queue_depth: usize,
    /// Output events not yet taken by the output thread.
    pub output_queue_depth: usize,
    /// Commands not yet handled by the scheduler thread.
    pub command_queue_depth: usize,
    /// Mean and worst time to plan one step, in microseconds.
    pub plan_us_mean: f64,
    pub plan_us_max: f64,
}

/// The ids the handle hands out, shared with the thread: the request ids now live (a new
/// request may not reuse one) and the next sequence id to issue.
#[derive(Default)]
struct LiveIds {
    request_ids: HashSet<String>,
    next_seq_id: SeqId,
}

#[derive(Default)]
struct Shared {
    live_ids: Mutex<LiveIds>,
    death: Mutex<Option<String>>,
    /// Set when the thread's loop is over (shut down or panicked), before its channel ends
    /// close: once a call sees a closed channel, `is_alive` is false too.
    stopped: AtomicBool,
    busy_ns: AtomicU64,
    idle_ns: AtomicU64,
    plan_ns_total: AtomicU64,
    plan_ns_max: AtomicU64,
    plans: AtomicU64,
}

impl Shared {
    fn closed_error(&self) -> SchedError {
        let death = self.death.lock().unwrap();
        SchedError::Closed(death.clone().unwrap_or_else(|| "it has been shut down".into()))
    }
}

/// Owner of the `pyengine-sched` thread. All methods take `&self` and may be called from
/// any thread.
pub struct EngineHandle {
    config: SchedulerConfig,
    cmd_tx: Sender<Command>,
    plan_rx: Receiver<StepPlan>,
    out_rx: Receiver<OutputEvent>,
    shared: Arc<Shared>,
    /// Dropped on shutdown: a send blocked on a full channel gives up at once.
    stop_tx: Mutex<Option<Sender<()>>>,
    exited_rx: Receiver<()>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl EngineHandle {
    /// Validates `config` and starts the scheduler thread; returns once the thread runs
    /// under its OS name (std names a thread as it starts, not at spawn), so that `ps -T`
    /// sees `pyengine-sched` as soon as the engine is up.
    pub fn start(config: SchedulerConfig) -> SchedResult<Self> {
        let scheduler = Scheduler::new(config.clone())?;
        let (cmd_tx, cmd_rx) = bounded(COMMAND_CAPACITY);
        let (plan_tx, plan_rx) = bounded(config.pipeline_depth);
        let (out_tx, out_rx) = bounded(OUTPUT_CAPACITY);
        let (stop_tx, stop_rx) = bounded::<()>(0);
        let (exited_tx, exited_rx) = bounded::<()>(1);
        let (running_tx, running_rx) = bounded::<()>(1);
        let shared = Arc::new(Shared::default());
        let worker = Worker { scheduler, cmd_rx, plan_tx, out_tx, stop_rx, shared: shared.clone() };
        let thread = std::thread::Builder::new()
            .name(THREAD_NAME.into())
            .spawn(move || {
                let _ = running_tx.send(());
                let shared = worker.shared.clone();
                // Unwinding drops the worker's channel ends; these clones keep the other
                // threads from seeing them close before the death below is recorded, so
                // their errors name the panic rather than a shutdown.
                let channels = (worker.cmd_rx.clone(), worker.plan_tx.clone(), worker.out_tx.clone());
                if let Err(panic) = catch_unwind(AssertUnwindSafe(|| worker.run())) {
                    let msg = panic_message(panic.as_ref());
                    *shared.death.lock().unwrap() = Some(format!("the scheduler thread panicked: {msg}"));
                }
                shared.stopped.store(true, Ordering::SeqCst);
                drop(channels);
                let _ = exited_tx.send(());
            })
            .map_err(|e| SchedError::Closed(format!("could not start the scheduler thread: {e}")))?;
        // On a timeout the handle's channel ends drop with this frame, so the thread, once
        // it runs, finds its command channel closed and ends by itself.
        running_rx.recv_timeout(STARTUP_TIMEOUT).map_err(|_| {
            SchedError::Closed(format!("the scheduler thread did not start within {STARTUP_TIMEOUT:?}"))
        })?;
        Ok(EngineHandle {
            config,
            cmd_tx,
            plan_rx,
            out_rx,
            shared,
            stop_tx: Mutex::new(Some(stop_tx)),
            exited_rx,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    fn send(&self, cmd: Command) -> SchedResult<()> {
        self.cmd_tx.send(cmd).map_err(|_| self.shared.closed_error())
    }

    /// Validates and queues a request; returns its first sequence id.
    pub fn add_request(&self, spec: RequestSpec) -> SchedResult<SeqId> {
        spec.validate(&self.config)?;
        if !self.is_alive() {
            return Err(self.shared.closed_error());
        }
        // Ids are handed out and the command queued under one lock, so the thread sees
        // requests in id order.
        let mut ids = self.shared.live_ids.lock().unwrap();
        if ids.request_ids.contains(&spec.request_id) {
            return Err(SchedError::DuplicateRequest(spec.request_id));
        }
        let first = ids.next_seq_id;
        ids.next_seq_id += spec.n as u64;
        ids.request_ids.insert(spec.request_id.clone());
        let request_id = spec.request_id.clone();
        let result = self.send(Command::Add(Box::new(spec), first));
        if result.is_err() {
            ids.request_ids.remove(&request_id);
        }
        result.map(|_| first)
    }

    /// Queues an abort of every sample of `request_id` (a no-op for finished requests).
    pub fn abort(&self, request_id: &str) -> SchedResult<()> {
        self.send(Command::Abort(request_id.to_string()))
    }

    /// Queues the end of one sequence (a stop string was found).
    pub fn finish(&self, seq_id: SeqId, reason: FinishReason) -> SchedResult<()> {
        self.send(Command::Finish(seq_id, reason))
    }

    /// The next plan, waiting at most `timeout` (None: until one comes or the thread ends).
    /// Ok(None) on timeout.
    pub fn next_plan(&self, timeout: Option<Duration>) -> SchedResult<Option<StepPlan>> {
        recv(&self.plan_rx, timeout).map_err(|()| self.shared.closed_error())
    }

    /// Hands back the tokens sampled for `step_id`, in `logits_indices` order; the
    /// attachment (the rest of the step's result) reaches the output thread in that
    /// step's event.
    pub fn submit_result(
        &self,
        step_id: u64,
        sampled: Vec<i64>,
        attachment: Option<Attachment>,
    ) -> SchedResult<()> {
        self.send(Command::Result { step_id, sampled, attachment, drafts: DraftResult::default() })
    }

    /// [`submit_result`](Self::submit_result) for a step with drafts, or with the
    /// executor's drafts for the next step: `sampled` holds, per sampled sequence, its
    /// accepted drafts and one more token.
    pub fn submit_spec_result(
        &self,
        step_id: u64,
        sampled: Vec<i64>,
        attachment: Option<Attachment>,
        drafts: DraftResult,
    ) -> SchedResult<()> {
        self.send(Command::Result { step_id, sampled, attachment, drafts })
    }

    /// Reports that the executor could not run `step_id`: its sequences end with `error`,
    /// and the attachment (what went wrong) travels in that step's event.
    pub fn fail_step(&self, step_id: u64, attachment: Option<Attachment>) -> SchedResult<()> {
        self.send(Command::Fail { step_id, attachment })
    }

    /// The next output event, waiting at most `timeout`. Ok(None) on timeout.
    pub fn next_output(&self, timeout: Option<Duration>) -> SchedResult<Option<OutputEvent>> {
        recv(&self.out_rx, timeout).map_err(|()| self.shared.closed_error())
    }

    /// Scheduler figures; waits at most `timeout` for the thread to answer (it answers
    /// between two commands) and falls back to the handle's own figures.
    pub fn stats(&self, timeout: Duration) -> SchedulerThreadStats {
        let (tx, rx) = bounded(1);
        let scheduler = match self.cmd_tx.try_send(Command::Stats(tx)) {
            Ok(()) => rx.recv_timeout(timeout).unwrap_or_default(),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => SchedulerSnapshot::default(),
        };
        let s = &self.shared;
        let plans = s.plans.load(Ordering::Relaxed).max(1) as f64;
        SchedulerThreadStats {
            scheduler,
            busy_seconds: s.busy_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            idle_seconds: s.idle_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            plan_queue_depth: self.plan_rx.len(),
            output_queue_depth: self.out_rx.len(),
            command_queue_depth: self.cmd_tx.len(),
            plan_us_mean: s.plan_ns_total.load(Ordering::Relaxed) as f64 / plans * 1e-3,
            plan_us_max: s.plan_ns_max.load(Ordering::Relaxed) as f64 * 1e-3,
        }
    }

    /// The published hashes of every block in the prefix cache, sorted, as the scheduler
    /// thread sees them between two commands (what a KV-event subscriber that saw every
    /// event up to then holds). None when the thread did not answer within `timeout`.
    pub fn cached_block_hashes(&self, timeout: Duration) -> Option<Vec<u64>> {
        let (tx, rx) = bounded(1);
        self.cmd_tx.try_send(Command::CachedHashes(tx)).ok()?;
        rx.recv_timeout(timeout).ok()
    }

    /// Whether the thread's loop still runs: false from the moment it stops taking
    /// commands (a shutdown or a panic), before its channels close.
    pub fn is_alive(&self) -> bool {
        self.thread.lock().unwrap().is_some() && !self.shared.stopped.load(Ordering::SeqCst)
    }

    /// Why the thread died, if it did.
    pub fn death(&self) -> Option<String> {
        self.shared.death.lock().unwrap().clone()
    }

    /// Stops the thread and joins it. Requests still in flight are dropped. Returns an
    /// error if the thread did not stop within `timeout`.
    pub fn shutdown(&self, timeout: Duration) -> SchedResult<()> {
        let _ = self.cmd_tx.try_send(Command::Shutdown);
        self.stop_tx.lock().unwrap().take();
        let Some(thread) = self.thread.lock().unwrap().take() else {
            return Ok(());
        };
        match self.exited_rx.recv_timeout(timeout) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                let _ = thread.join();
                Ok(())
            }
            Err(RecvTimeoutError::Timeout) => {
                *self.thread.lock().unwrap() = Some(thread);
                Err(SchedError::Closed(format!("the scheduler thread did not stop within {timeout:?}")))
            }
        }
    }

    /// Test hook: makes the scheduler thread panic, to exercise the error path.
    #[doc(hidden)]
    pub fn inject_panic(&self) -> SchedResult<()> {
        self.send(Command::Panic)
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        let _ = self.shutdown(Duration::from_secs(5));
    }
}

/// Blocks on `rx` for at most `timeout`; Err(()) when the sender is gone and nothing is left.
fn recv<T>(rx: &Receiver<T>, timeout: Option<Duration>) -> Result<Option<T>, ()> {
    match timeout {
        None => rx.recv().map(Some).map_err(|_| ()),
        Some(t) => match rx.recv_timeout(t) {
            Ok(v) => Ok(Some(v)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(()),
        },
    }
}

/// The state the scheduler thread owns.
struct Worker {
    scheduler: Scheduler,
    cmd_rx: Receiver<Command>,
    plan_tx: Sender<StepPlan>,
    out_tx: Sender<OutputEvent>,
    stop_rx: Receiver<()>,
    shared: Arc<Shared>,
}

/// Whether the loop goes on.
enum Flow {
    Continue,
    Exit,
}

impl Worker {
    fn run(mut self) {
        loop {
            let started = Instant::now();
            // Everything already queued, then a plan if the pipeline has room.
            loop {
                match self.cmd_rx.try_recv() {
                    Ok(cmd) => {
                        if let Flow::Exit = self.handle(cmd) {
                            return;
                        }
                    }
                    Err(crossbeam_channel::TryRecvError::Empty) => break,
                    Err(crossbeam_channel::TryRecvError::Disconnected) => return,
                }
            }
            if let Flow::Exit = self.flush_output() {
                return;
            }
            let planned = self.plan();
            self.shared.busy_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            match planned {
                Some(Flow::Exit) => return,
                Some(Flow::Continue) => continue,
                None => {}
            }
            let waiting = Instant::now();
            let cmd = self.cmd_rx.recv();
            self.shared.idle_ns.fetch_add(waiting.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let started = Instant::now();
            let flow = match cmd {
                Ok(cmd) => self.handle(cmd),
                Err(_) => Flow::Exit,
            };
            self.shared.busy_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if let Flow::Exit = flow {
                return;
            }
        }
    }

    /// Plans and sends one step if possible. None when there was nothing to plan.
    fn plan(&mut self) -> Option<Flow> {
        if !self.scheduler.can_plan() {
            return None;
        }
        let t = Instant::now();
        let plan = self.scheduler.schedule()?;
        let ns = t.elapsed().as_nanos() as u64;
        let s = &self.shared;
        s.plans.fetch_add(1, Ordering::Relaxed);
        s.plan_ns_total.fetch_add(ns, Ordering::Relaxed);
        s.plan_ns_max.fetch_max(ns, Ordering::Relaxed);
        // Never blocks in practice: plans in the channel are in flight, and in-flight
        // steps are fewer than the channel's capacity when we get here.
        let flow = self.send_or_stop(&self.plan_tx.clone(), plan);
        // With no step before it in flight, its grammar mask is computed now, while its
        // forward pass runs.
        self.scheduler.send_front_mask();
        Some(flow)
    }

    fn handle(&mut self, cmd: Command) -> Flow {
        match cmd {
            Command::Add(spec, first) => {
                // Validated by the handle; a rejection here would be a bug in the handle.
                let id = spec.request_id.clone();
                if let Err(e) = self.scheduler.add_request_as(*spec, first) {
                    self.shared.live_ids.lock().unwrap().request_ids.remove(&id);
                    panic!("request {id:?} passed the handle's checks but the scheduler refused it: {e}");
                }
                Flow::Continue
            }
            Command::Abort(id) => {
                self.scheduler.abort(&id);
                self.forget_ended();
                Flow::Continue
            }
            Command::Finish(seq, reason) => {
                // An id from the future is a caller bug, not a reason to stop the engine.
                let _ = self.scheduler.finish(seq, reason);
                self.forget_ended();
                Flow::Continue
            }
            Command::Result { step_id, sampled, attachment, drafts } => {
                if let Flow::Exit = self.flush_output() {
                    return Flow::Exit;
                }
                let spec = SpecResult {
                    num_accepted: drafts.num_accepted.as_deref(),
                    next_drafts: drafts.next_drafts.as_ref().map(|(c, t)| (c.as_slice(), t.as_slice())),
                };
                if let Err(e) = self.scheduler.apply_spec_result(step_id, &sampled, spec) {
                    panic!("{e}");
                }
                // The next step's forward pass is running now: its mask is wanted first.
                self.scheduler.send_front_mask();
                self.forget_ended();
                self.flush_step_output(step_id, attachment)
            }
            Command::Fail { step_id, attachment } => {
                if let Flow::Exit = self.flush_output() {
                    return Flow::Exit;
                }
                if let Err(e) = self.scheduler.fail_step(step_id) {
                    panic!("{e}");
                }
                self.scheduler.send_front_mask();
                self.forget_ended();
                self.flush_step_output(step_id, attachment)
            }
            Command::Stats(reply) => {
                let _ = reply.try_send(self.scheduler.snapshot());
                Flow::Continue
            }
            Command::CachedHashes(reply) => {
                let _ = reply.try_send(self.scheduler.pool().cached_hashes());
                Flow::Continue
            }
            Command::Panic => panic!("injected by inject_panic()"),
            Command::Shutdown => Flow::Exit,
        }
    }

    /// Lets callers reuse the ids of requests that ended, before they hear of the end.
    fn forget_ended(&mut self) {
        let ended = self.scheduler.take_ended_requests();
        if !ended.is_empty() {
            let mut ids = self.shared.live_ids.lock().unwrap();
            for id in ended {
                ids.request_ids.remove(&*id);
            }
        }
    }

    /// Sends what commands changed since the last event, if anything.
    fn flush_output(&mut self) -> Flow {
        let ev = self.scheduler.take_output(None);
        if ev.is_empty() {
            return Flow::Continue;
        }
        let tx = self.out_tx.clone();
        self.send_or_stop(&tx, ev)
    }

    /// Sends the event of an applied step result, always (the output thread sees every
    /// step), with the executor's attachment.
    fn flush_step_output(&mut self, step_id: u64, attachment: Option<Attachment>) -> Flow {
        let mut ev = self.scheduler.take_output(Some(step_id));
        ev.step_attachment = attachment;
        let tx = self.out_tx.clone();
        self.send_or_stop(&tx, ev)
    }

    /// Sends with back-pressure, unless shutdown comes first.
    fn send_or_stop<T>(&self, tx: &Sender<T>, value: T) -> Flow {
        select! {
            send(tx, value) -> res => if res.is_ok() { Flow::Continue } else { Flow::Exit },
            recv(self.stop_rx) -> _ => Flow::Exit,
        }
    }
}
