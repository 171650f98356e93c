//! A persistent thread pool for the token loop.
//!
//! A decoded token is about a hundred short parallel sections (one per fused
//! mat-vec), each a few hundred microseconds. What matters is how fast idle
//! workers start on the next one, so workers spin on an epoch counter for a
//! while before sleeping, and every section runs the same closure on every
//! thread (`f(thread, n_threads)`, like an OpenMP parallel region): each thread
//! derives its own share of rows, with no queue and no allocation per call.
//! The calling thread is thread 0 and does its share too.

use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Spins before a worker sleeps: long enough to bridge the gap between two
/// mat-vecs of one token (tens of microseconds of norms and RoPE), short
/// enough not to burn a core while the caller samples or waits for input.
const SPIN_ITERATIONS: u32 = 1 << 17;

/// Spinning threads yield the CPU this often, so an oversubscribed machine
/// still makes progress.
const YIELD_EVERY: u32 = 1 << 10;

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    /// Bumped once per parallel section; workers run the job when it changes.
    epoch: AtomicUsize,
    /// The current section's closure. Written by the caller before bumping
    /// `epoch`, read by workers after seeing the new epoch.
    job: UnsafeCell<Option<*const Job>>,
    /// Workers that have not finished the current section.
    remaining: AtomicUsize,
    /// Workers asleep on `wake`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    /// A worker's closure panicked during the current section.
    panicked: AtomicBool,
}

// SAFETY: `job` is written only by the thread inside `run` while no worker is
// reading it (all finished the previous section), and read by workers only
// between the epoch bump and their `remaining` decrement, while `run` waits.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// A fixed set of worker threads that run parallel sections.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
    /// Serialises callers: one parallel section at a time.
    running: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `threads` threads in all (the caller plus `threads - 1` workers).
    pub fn new(threads: usize) -> ThreadPool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            remaining: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        let workers = (1..threads)
            .map(|index| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("ember-worker-{index}"))
                    .spawn(move || worker(&shared, index, threads))
                    .expect("spawning a worker thread")
            })
            .collect();
        ThreadPool { shared, workers, threads, running: Mutex::new(()) }
    }

    /// Threads in the pool, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(thread, threads)` once on every thread of the pool and returns
    /// when all have finished. Panics if any of them panicked.
    pub fn run<F: Fn(usize, usize) + Sync>(&self, f: F) {
        let start = SECTION_TIMES.with(Cell::get).map(|_| Instant::now());
        if self.threads == 1 {
            f(0, 1);
            return add_section_time(start, None);
        }
        let _guard = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let job: &(dyn Fn(usize, usize) + Sync + '_) = &f;
        // SAFETY: erase the closure's lifetime; this function does not return
        // until every worker has finished with it (`remaining` reaches 0).
        let job: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync + '_), &'static Job>(job) };
        unsafe { *s.job.get() = Some(job) };
        s.remaining.store(self.threads - 1, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0, self.threads)));
        let own_done = start.map(|_| Instant::now());
        spin_until(|| s.remaining.load(Ordering::Acquire) == 0);
        add_section_time(start, own_done);
        unsafe { *s.job.get() = None };
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a worker thread panicked in a parallel section");
        }
    }
}

/// Where the parallel sections a thread starts spend their time
/// ([`time_sections`]): a decoded token's phases split into the sections'
/// time and the serial work between them, and the caller's wait at each
/// section's end for the threads still on their shares.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SectionTimes {
    /// Sections run.
    pub sections: u64,
    /// Time from the start of each section to its end (every thread done).
    pub inside: Duration,
    /// Of `inside`, the calling thread's wait after its own share for the
    /// other threads to finish theirs.
    pub waiting: Duration,
}

thread_local! {
    /// The calling thread's section times, while it times them.
    static SECTION_TIMES: Cell<Option<SectionTimes>> = const { Cell::new(None) };
}

/// Starts (`true`, from zero) or stops timing the parallel sections the
/// calling thread starts on any pool ([`section_times`]). Off, a section
/// reads no clock; on, it reads three.
pub fn time_sections(on: bool) {
    SECTION_TIMES.with(|t| t.set(on.then(SectionTimes::default)));
}

/// The calling thread's section times since [`time_sections`] turned
/// timing on, or `None` when it is off.
pub fn section_times() -> Option<SectionTimes> {
    SECTION_TIMES.with(Cell::get)
}

/// Adds a section that started at `start` (timed) and whose caller finished
/// its own share at `own_done` (`None`: it had all the work).
fn add_section_time(start: Option<Instant>, own_done: Option<Instant>) {
    let Some(start) = start else { return };
    let end = Instant::now();
    SECTION_TIMES.with(|t| {
        if let Some(mut times) = t.get() {
            times.sections += 1;
            times.inside += end - start;
            times.waiting += own_done.map_or(Duration::ZERO, |d| end - d);
            t.set(Some(times));
        }
    });
}

fn worker(s: &Shared, index: usize, threads: usize) {
    let mut seen = 0usize;
    loop {
        // Wait for a new section: spin, then sleep.
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let epoch = s.epoch.load(Ordering::Acquire);
            if epoch != seen {
                seen = epoch;
                break;
            }
            if spins < SPIN_ITERATIONS {
                spins += 1;
                if spins.is_multiple_of(YIELD_EVERY) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            let guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            let guard = s
                .wake
                .wait_while(guard, |_| s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst))
                .unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(guard);
            spins = 0;
        }
        // SAFETY: see `Shared`; the job outlives this section.
        let job = unsafe { (*s.job.get()).expect("a section has a job") };
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*job)(index, threads) }));
        if result.is_err() {
            s.panicked.store(true, Ordering::SeqCst);
        }
        s.remaining.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

static GLOBAL: OnceLock<ThreadPool> = OnceLock::new();

/// Sets the size of the process-wide pool. Only the first call (or first use)
/// decides; returns false if the pool already existed with another size.
pub fn init_global(threads: usize) -> bool {
    GLOBAL.get_or_init(|| ThreadPool::new(threads)).threads() == threads.max(1)
}

/// The process-wide pool's size, if it has been started.
pub fn global_threads() -> Option<usize> {
    GLOBAL.get().map(ThreadPool::threads)
}

/// The process-wide pool the dispatching kernels use: as set by
/// [`init_global`], else one thread per available CPU.
pub fn global() -> &'static ThreadPool {
    GLOBAL.get_or_init(|| ThreadPool::new(std::thread::available_parallelism().map_or(1, |n| n.get())))
}

/// Fills `dst`, `items` items of equal size, in parallel over `pool` (or on
/// the calling thread without one): each thread calls `f` once with its
/// contiguous share of the items and the part of `dst` that holds them.
pub fn fill_shares<T: Send>(
    pool: Option<&ThreadPool>,
    dst: &mut [T],
    items: usize,
    f: impl Fn(std::ops::Range<usize>, &mut [T]) + Sync,
) {
    let per = dst.len().checked_div(items).unwrap_or(0);
    assert_eq!(per * items, dst.len(), "dst holds whole items");
    let out = SharedMut::new(dst);
    let work = |th, n| {
        let (a, b) = share(items, th, n, 1);
        // SAFETY: threads take disjoint item ranges.
        f(a..b, unsafe { out.range(a * per, b * per) });
    };
    match pool {
        Some(pool) if items > 1 => pool.run(work),
        _ => work(0, 1),
    }
}

/// Rows handed out in chunks to whichever thread of a section asks next, for
/// work whose threads do not run at the same speed. The mat-vecs use it: on
/// a shared machine one core is often slower (the caller's also runs the
/// serial parts of a token, and neighbours' work lands unevenly), and with
/// fixed halves the other thread waited for it (8.6% of the worker's samples
/// were spent spinning in INT8 decoding, 2 threads).
///
/// Chunks shrink as the rows run out (each is a share of what is left, as
/// OpenMP's `guided` schedule), so the threads finish close together: with
/// equal chunks, one thread often waited for the other's last chunk (about
/// 20 µs a section, 1–3 ms per decoded token, measured at 2 threads).
pub struct Chunks {
    next: AtomicUsize,
    rows: usize,
    threads: usize,
    align: usize,
    min: usize,
}

impl Chunks {
    /// `rows` for `threads` threads, chunks starting on multiples of
    /// `align` and at least `min` rows long (the last excepted). One thread
    /// has nobody to balance with: it takes every row in one chunk.
    pub fn new(rows: usize, threads: usize, align: usize, min: usize) -> Chunks {
        let align = align.max(1);
        let min = if threads <= 1 { rows } else { min };
        Chunks {
            next: AtomicUsize::new(0),
            rows,
            threads: threads.max(1),
            align,
            min: min.max(1).next_multiple_of(align),
        }
    }

    /// The next chunk of rows, or `None` when all are taken.
    pub fn next_chunk(&self) -> Option<std::ops::Range<usize>> {
        let mut lo = self.next.load(Ordering::Relaxed);
        loop {
            if lo >= self.rows {
                return None;
            }
            let size = ((self.rows - lo) / (2 * self.threads)).next_multiple_of(self.align).max(self.min);
            let hi = (lo + size).min(self.rows);
            match self.next.compare_exchange_weak(lo, hi, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(lo..hi),
                Err(now) => lo = now,
            }
        }
    }
}

/// The rows `[start, end)` of `rows` that thread `t` of `n` takes: contiguous,
/// balanced, and aligned to `align` rows where possible.
pub fn share(rows: usize, t: usize, n: usize, align: usize) -> (usize, usize) {
    let bound = |i: usize| {
        if i >= n {
            return rows;
        }
        let b = rows * i / n;
        (b / align * align).min(rows)
    };
    (bound(t), bound(t + 1))
}

/// A mutable slice written by several threads at disjoint indices.
pub struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _life: std::marker::PhantomData<&'a mut [T]>,
}

unsafe impl<T: Send> Sync for SharedMut<'_, T> {}
unsafe impl<T: Send> Send for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    /// Wraps `slice` for disjoint writes from several threads.
    pub fn new(slice: &'a mut [T]) -> Self {
        SharedMut { ptr: slice.as_mut_ptr(), len: slice.len(), _life: std::marker::PhantomData }
    }

    /// # Safety
    /// Ranges taken concurrently must not overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range(&self, start: usize, end: usize) -> &mut [T] {
        assert!(start <= end && end <= self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(start), end - start)
    }

    /// A raw pointer to element `start`, for kernels that write scattered
    /// lanes of `start..end` (masked stores) without taking a reference to
    /// the whole range, which other threads write between.
    ///
    /// # Safety
    /// Elements written concurrently must not overlap.
    pub unsafe fn ptr(&self, start: usize, end: usize) -> *mut T {
        assert!(start <= end && end <= self.len);
        self.ptr.add(start)
    }
}

/// Spins until `done()`. With more threads than free cores, spinning
/// would starve the thread being waited for: it gives way now and then.
#[inline]
fn spin_until(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins += 1;
        if spins.is_multiple_of(YIELD_EVERY) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Round trips per run of [`handoff`].
const HANDOFF_TRIPS: usize = 2000;

/// A cache line of its own for [`handoff`]'s counter.
#[repr(align(128))]
struct Line(AtomicUsize);

/// How long a cache line takes to go from the pool's calling thread to its
/// first worker and back: one thread's store seen by the other, answered
/// by a store seen back. The best of three runs of 2000 round
/// trips (the first handshake, the worker's wake-up, untimed); `None` with
/// one thread.
///
/// Every parallel section pays it a few times (the section's start, the
/// chunks claimed from one counter, the end), and every product's
/// activations and outputs cross between the threads' caches at that
/// latency, so it says where the threads run: on a virtual machine whose
/// two vCPUs move between the cores of one Zen 4 CCD (round trips of
/// 70–170 ns, one CCD's link to memory: reads of 31–37 GB/s) and two
/// CCDs (350–450 ns, two links: 50–68 GB/s), it names which of the two a
/// measurement met.
pub fn handoff(pool: &ThreadPool) -> Option<Duration> {
    if pool.threads() < 2 {
        return None;
    }
    let wait = |line: &Line, want: usize| spin_until(|| line.0.load(Ordering::Acquire) == want);
    (0..3)
        .map(|_| {
            let line = Line(AtomicUsize::new(0));
            let took = Mutex::new(Duration::MAX);
            pool.run(|th, _| match th {
                0 => {
                    line.0.store(1, Ordering::Release);
                    wait(&line, 2);
                    let start = Instant::now();
                    for i in 1..=HANDOFF_TRIPS {
                        line.0.store(2 * i + 1, Ordering::Release);
                        wait(&line, 2 * i + 2);
                    }
                    *took.lock().unwrap_or_else(|e| e.into_inner()) = start.elapsed() / HANDOFF_TRIPS as u32;
                }
                1 => {
                    for i in 0..=HANDOFF_TRIPS {
                        wait(&line, 2 * i + 1);
                        line.0.store(2 * i + 2, Ordering::Release);
                    }
                }
                _ => {}
            });
            took.into_inner().unwrap_or_else(|e| e.into_inner())
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoff_needs_two_threads_and_takes_some_time() {
        assert_eq!(handoff(&ThreadPool::new(1)), None);
        for threads in [2, 3] {
            let took = handoff(&ThreadPool::new(threads)).expect("a round trip with two threads or more");
            // Two stores seen by another thread: more than nothing, and far
            // less than a millisecond even on a loaded machine.
            assert!(took > Duration::ZERO && took < Duration::from_millis(1), "{threads} threads: {took:?}");
        }
    }

    #[test]
    fn section_times_split_the_callers_wait_from_the_section() {
        let pool = ThreadPool::new(2);
        assert_eq!(section_times(), None);
        time_sections(true);
        // The worker takes 30 ms, the caller nothing: the caller waits.
        pool.run(|t, _| {
            if t == 1 {
                std::thread::sleep(Duration::from_millis(30));
            }
        });
        // One thread's pool: a section with no wait.
        ThreadPool::new(1).run(|_, _| std::thread::sleep(Duration::from_millis(5)));
        let times = section_times().expect("timing is on");
        assert_eq!(times.sections, 2);
        assert!(times.waiting >= Duration::from_millis(29), "{times:?}");
        assert!(times.inside >= times.waiting + Duration::from_millis(5), "{times:?}");
        time_sections(false);
        pool.run(|_, _| {});
        assert_eq!(section_times(), None);
    }

    #[test]
    fn every_thread_runs_once_per_section() {
        for threads in [1, 2, 3, 5] {
            let pool = ThreadPool::new(threads);
            let hits: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..1000 {
                pool.run(|t, n| {
                    assert_eq!(n, threads);
                    hits[t].fetch_add(1, Ordering::Relaxed);
                });
            }
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1000));
        }
    }

    #[test]
    fn sleeping_workers_wake_up() {
        let pool = ThreadPool::new(2);
        let sum = AtomicUsize::new(0);
        pool.run(|t, _| {
            sum.fetch_add(t + 1, Ordering::Relaxed);
        });
        // Long enough for the worker to give up spinning and sleep.
        std::thread::sleep(std::time::Duration::from_millis(300));
        pool.run(|t, _| {
            sum.fetch_add(t + 1, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn a_panic_in_a_worker_reaches_the_caller() {
        let pool = ThreadPool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(|t, _| assert!(t != 1, "boom"));
        }));
        assert!(r.is_err());
        // The pool still works afterwards.
        let ok = AtomicUsize::new(0);
        pool.run(|_, _| {
            ok.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(ok.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn chunks_cover_all_rows_once() {
        for (rows, threads, align, min) in
            [(0, 2, 16, 64), (1, 2, 16, 64), (1152, 2, 16, 64), (151936, 3, 32, 64), (100, 1, 1, 1), (4864, 2, 16, 1)]
        {
            let chunks = Chunks::new(rows, threads, align, min);
            let mut seen = vec![0u8; rows];
            while let Some(r) = chunks.next_chunk() {
                assert!(r.start.is_multiple_of(align) && r.start < r.end, "{r:?}");
                for i in r {
                    seen[i] += 1;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "rows {rows}");
            assert_eq!(chunks.next_chunk(), None);
        }
        // Taken from several threads at once, still each row once.
        let pool = ThreadPool::new(3);
        let chunks = Chunks::new(10_000, 3, 16, 16);
        let counts: Vec<AtomicUsize> = (0..10_000).map(|_| AtomicUsize::new(0)).collect();
        pool.run(|_, _| {
            while let Some(r) = chunks.next_chunk() {
                for i in r {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn shares_cover_all_rows_without_overlap() {
        for rows in [0, 1, 7, 128, 896, 4864, 151_936] {
            for n in 1..6 {
                for align in [1, 4, 16] {
                    let mut next = 0;
                    for t in 0..n {
                        let (a, b) = share(rows, t, n, align);
                        assert_eq!(a, next);
                        assert!(b >= a);
                        next = b;
                    }
                    assert_eq!(next, rows);
                }
            }
        }
    }
}
