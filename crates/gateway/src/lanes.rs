//! Lanes: one thread per CPU, each running a single-threaded tokio runtime that serves the client
//! connections handed to it, start to end. A request never moves between threads: its socket,
//! its tasks, its timers and the pooled upstream connection it borrows (each lane has its own
//! pool, see [`current`]) all belong to one lane, so a request costs no cross-thread wake-ups,
//! as in nginx's worker processes. The accept loop hands each new connection to the lane with
//! the fewest open ones. A lane may poll a while before it sleeps ([`idle_poll`]).

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::idle_poll;

/// A connection's future, built on its lane from the socket registered there.
pub type Serve = Arc<dyn Fn(TcpStream) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

struct Job {
    stream: std::net::TcpStream,
    serve: Serve,
}

struct Lane {
    jobs: mpsc::UnboundedSender<Job>,
    open: Arc<AtomicUsize>,
}

/// The lanes of one gateway; dropping the last handle ends their threads (and whatever still
/// runs on them).
pub struct Lanes {
    lanes: Vec<Lane>,
}

/// What each lane runs once every [`HOUSEKEEPING_EVERY`] (the binary returns freed memory to the
/// system with it); set once, before the first lane starts.
static HOUSEKEEPING: OnceLock<fn()> = OnceLock::new();
const HOUSEKEEPING_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Sets what every lane runs once a second, on its own thread; only the first call counts.
pub fn set_housekeeping(hook: fn()) {
    let _ = HOUSEKEEPING.set(hook);
}

thread_local! {
    /// 1 + the index of the lane this thread runs; 0 off the lanes.
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// How many lanes a gateway runs: one per CPU.
pub fn count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Which per-lane resource this thread uses: 1 + its lane's index, 0 off the lanes (so a
/// resource kept per lane has `count() + 1` slots).
pub fn current() -> usize {
    CURRENT.with(Cell::get)
}

impl Lanes {
    /// Starts [`count`] lanes; fewer when a thread cannot be started (none: the caller serves
    /// connections on its own runtime).
    pub fn start() -> Lanes {
        let lanes = (0..count()).filter_map(start_lane).collect();
        Lanes { lanes }
    }

    /// Hands `stream` to the least busy lane, to be served by `serve`; gives it back when there
    /// is no lane to take it.
    pub fn hand_over(&self, stream: TcpStream, serve: &Serve) -> Result<(), TcpStream> {
        let Some(lane) = self
            .lanes
            .iter()
            .min_by_key(|lane| lane.open.load(Ordering::Relaxed))
        else {
            return Err(stream);
        };
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(error) => {
                tracing::debug!(%error, "an accepted socket could not be handed to a lane");
                return Ok(());
            }
        };
        let job = Job {
            stream,
            serve: serve.clone(),
        };
        // Counted now, not when the lane gets to it: a burst of accepts spreads over the lanes.
        lane.open.fetch_add(1, Ordering::Relaxed);
        let Err(rejected) = lane.jobs.send(job) else {
            return Ok(());
        };
        lane.open.fetch_sub(1, Ordering::Relaxed);
        // The lane's thread is gone: the caller serves the socket after all.
        TcpStream::from_std(rejected.0.stream).map_or(Ok(()), Err)
    }
}

fn start_lane(index: usize) -> Option<Lane> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_unpark(idle_poll::woke)
        .build()
        .map_err(|error| tracing::error!(%error, "a lane's runtime cannot start"))
        .ok()?;
    let (jobs, mut inbox) = mpsc::unbounded_channel::<Job>();
    let open = Arc::new(AtomicUsize::new(0));
    let counted = open.clone();
    std::thread::Builder::new()
        .name(format!("onedoor-lane-{index}"))
        .spawn(move || {
            CURRENT.with(|current| current.set(index + 1));
            runtime.block_on(async move {
                if let Some(&hook) = HOUSEKEEPING.get() {
                    tokio::spawn(housekeeping(hook));
                }
                if let Some(window) = idle_poll::window() {
                    tokio::spawn(idle_poll::keep_polling(window));
                }
                while let Some(job) = inbox.recv().await {
                    run(job, &counted);
                }
            });
        })
        .map_err(|error| tracing::error!(%error, "a lane's thread cannot start"))
        .ok()?;
    Some(Lane { jobs, open })
}

async fn housekeeping(hook: fn()) {
    let mut every = tokio::time::interval(HOUSEKEEPING_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        hook();
    }
}

/// Registers the job's socket with this lane's runtime and spawns its connection there; the
/// lane's count of open connections goes down when it ends.
fn run(job: Job, open: &Arc<AtomicUsize>) {
    let stream = match TcpStream::from_std(job.stream) {
        Ok(stream) => stream,
        Err(error) => {
            tracing::debug!(%error, "a handed-over socket could not be registered");
            open.fetch_sub(1, Ordering::Relaxed);
            return;
        }
    };
    let connection = (job.serve)(stream);
    let open = open.clone();
    tokio::spawn(async move {
        connection.await;
        open.fetch_sub(1, Ordering::Relaxed);
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::collections::BTreeSet;
    use std::sync::Mutex;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    #[tokio::test]
    async fn connections_spread_over_every_lane_and_run_on_it() {
        let lanes = Lanes::start();
        assert_eq!(lanes.lanes.len(), count());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (done, mut finished) = mpsc::unbounded_channel();
        let serve: Serve = {
            let seen = seen.clone();
            Arc::new(move |mut stream: TcpStream| {
                let seen = seen.clone();
                let done = done.clone();
                Box::pin(async move {
                    seen.lock().unwrap().push(current());
                    stream.write_all(b"served").await.unwrap();
                    done.send(()).unwrap();
                    // Open until the client closes.
                    let mut rest = Vec::new();
                    let _ = stream.read_to_end(&mut rest).await;
                })
            })
        };
        // Held open, so each lane's count stays up while the next ones are handed over.
        let mut clients = Vec::new();
        for _ in 0..2 * count() {
            clients.push(std::net::TcpStream::connect(address).unwrap());
            let (accepted, _) = listener.accept().await.unwrap();
            lanes.hand_over(accepted, &serve).unwrap();
            finished.recv().await.unwrap();
        }
        let seen = seen.lock().unwrap().clone();
        assert!(
            seen.iter().all(|&lane| lane >= 1 && lane <= count()),
            "{seen:?}"
        );
        let distinct: BTreeSet<_> = seen.iter().collect();
        assert_eq!(
            distinct.len(),
            count(),
            "every lane takes connections: {seen:?}"
        );
        assert_eq!(current(), 0, "the test's own thread is no lane");
    }
}
