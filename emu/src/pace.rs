//! A device's bandwidth cap (`EFA_EMU_BANDWIDTH`): a token bucket in front of its send path.
//!
//! Every send, RDMA write and RDMA read a queue pair of the device posts pays its payload bytes
//! at the device's rate. A post the bucket can pay now goes to the wire at once; a later one
//! waits, in posting order, on the device's pacing thread, which posts it when its bytes are
//! paid for. Posting never blocks the program (one thread can keep several capped devices busy
//! at once, as it can several NICs), and a queue pair that is closed meanwhile gets its waiting
//! work back to complete as flushed. The bucket holds [`BURST`] worth of bytes, so short
//! exchanges see no delay; a long transfer of N bytes takes at least N / rate − [`BURST`].

use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How far ahead of its rate a device may send: the bucket's depth, in time.
pub const BURST: Duration = Duration::from_millis(1);

/// The pacing thread's longest sleep while idle (it ends when the pacer is dropped).
const IDLE_WAIT: Duration = Duration::from_millis(100);

struct Waiting<T> {
    due: Instant,
    owner: usize,
    job: T,
}

struct State<T> {
    /// When the bytes admitted so far are paid for (the bucket's "theoretical arrival time").
    paid_until: Instant,
    queue: VecDeque<Waiting<T>>,
    thread: bool,
}

struct Inner<T> {
    /// Bytes per second.
    rate: u64,
    run: Box<dyn Fn(T) + Send + Sync>,
    st: Mutex<State<T>>,
    cv: Condvar,
}

/// A token bucket of `rate` bytes per second that admits jobs now or runs them later.
pub struct Pacer<T: Send + 'static> {
    inner: Arc<Inner<T>>,
}

impl<T: Send + 'static> Pacer<T> {
    /// A pacer of `rate` bytes per second; `run` performs a job that had to wait (on the
    /// pacing thread).
    pub fn new(rate: u64, run: impl Fn(T) + Send + Sync + 'static) -> Pacer<T> {
        Pacer {
            inner: Arc::new(Inner {
                rate: rate.max(1),
                run: Box::new(run),
                st: Mutex::new(State {
                    paid_until: Instant::now(),
                    queue: VecDeque::new(),
                    thread: false,
                }),
                cv: Condvar::new(),
            }),
        }
    }

    /// Bytes per second.
    pub fn rate(&self) -> u64 {
        self.inner.rate
    }

    /// Charges `bytes` for `job` of `owner`: `Some(job)` when the caller may perform it now,
    /// `None` when it waits for the pacing thread (behind every job waiting already).
    pub fn admit(&self, bytes: u64, owner: usize, job: T) -> Option<T> {
        let now = Instant::now();
        let cost = Duration::from_secs_f64(bytes as f64 / self.inner.rate as f64);
        let mut st = self.inner.st.lock();
        let start = st.paid_until.max(now);
        st.paid_until = start + cost;
        if st.queue.is_empty() && start <= now + BURST {
            return Some(job);
        }
        let due = start.checked_sub(BURST).unwrap_or(start);
        st.queue.push_back(Waiting { due, owner, job });
        if !st.thread {
            st.thread = true;
            let weak = Arc::downgrade(&self.inner);
            let spawned = std::thread::Builder::new()
                .name("efa-emu-pace".into())
                .spawn(move || pace(weak));
            if let Err(e) = spawned {
                // No thread: run the job here rather than lose it.
                st.thread = false;
                tracing::warn!("efa-emu: no pacing thread ({e}); bandwidth cap not kept");
                return st.queue.pop_back().map(|w| w.job);
            }
        }
        self.inner.cv.notify_one();
        None
    }

    /// Takes back every waiting job of `owner` (a queue pair being closed), in order.
    pub fn take_owned_by(&self, owner: usize) -> Vec<T> {
        let mut st = self.inner.st.lock();
        let (mine, rest): (VecDeque<_>, VecDeque<_>) =
            st.queue.drain(..).partition(|w| w.owner == owner);
        st.queue = rest;
        mine.into_iter().map(|w| w.job).collect()
    }

    /// Jobs waiting now.
    pub fn waiting(&self) -> usize {
        self.inner.st.lock().queue.len()
    }
}

/// The pacing thread: runs each waiting job when it is due, until the pacer is dropped.
fn pace<T: Send + 'static>(weak: Weak<Inner<T>>) {
    loop {
        let Some(inner) = weak.upgrade() else {
            return;
        };
        let job = {
            let mut st = inner.st.lock();
            match st.queue.front().map(|w| w.due) {
                None => {
                    inner.cv.wait_for(&mut st, IDLE_WAIT);
                    None
                }
                Some(due) if due > Instant::now() => {
                    let _ = inner.cv.wait_until(&mut st, due);
                    None
                }
                Some(_) => st.queue.pop_front().map(|w| w.job),
            }
        };
        if let Some(job) = job {
            (inner.run)(job);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Jobs beyond the burst wait their turn, in order, and a capped run of N bytes takes at
    /// least N / rate − BURST (generous bounds: only "not faster than the cap" is asserted).
    #[test]
    fn a_capped_pacer_takes_at_least_the_bytes_over_the_rate() {
        let done: Arc<Mutex<Vec<(usize, Instant)>>> = Arc::default();
        let d = done.clone();
        let rate = 1_000_000; // 1 MB/s
        let p = Pacer::new(rate, move |i: usize| d.lock().push((i, Instant::now())));
        let start = Instant::now();
        let (chunk, n) = (10_000u64, 20usize); // 200 kB: at least 0.199 s
        let mut now_run = Vec::new();
        for i in 0..n {
            if let Some(i) = p.admit(chunk, 1, i) {
                now_run.push(i);
            }
        }
        assert_eq!(now_run, [0], "the first fits the bucket, the rest wait");
        let deadline = start + Duration::from_secs(30);
        while done.lock().len() < n - 1 {
            assert!(Instant::now() < deadline, "the pacer stalled");
            std::thread::sleep(Duration::from_millis(5));
        }
        let done = done.lock();
        assert_eq!(
            done.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            (1..n).collect::<Vec<_>>(),
            "in posting order"
        );
        let took = done.last().unwrap().1 - start;
        let least = Duration::from_secs_f64((chunk * (n as u64 - 1)) as f64 / rate as f64) - BURST;
        assert!(took >= least, "{took:?} < {least:?}");
    }

    #[test]
    fn a_closed_owner_gets_its_waiting_jobs_back() {
        let ran: Arc<Mutex<Vec<u32>>> = Arc::default();
        let r = ran.clone();
        // 1 kB/s: nothing after the first runs during the test.
        let p = Pacer::new(1000, move |j: u32| r.lock().push(j));
        assert_eq!(p.admit(100, 7, 0), Some(0));
        assert_eq!(p.admit(100, 7, 1), None);
        assert_eq!(p.admit(100, 8, 2), None);
        assert_eq!(p.admit(100, 7, 3), None);
        assert_eq!(p.take_owned_by(7), [1, 3]);
        assert_eq!(p.waiting(), 1);
        assert!(ran.lock().is_empty());
    }
}
