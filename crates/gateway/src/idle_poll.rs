//! Idle polling: a lane that has just taken a request or finished an answer keeps polling its
//! sockets for a short window before it sleeps. On a virtual machine whose idle CPUs halt, a
//! sleeping lane is woken through the host for every packet, tens of microseconds a hop; an
//! answer or a request that arrives while the lane still polls is taken at once. The price is
//! CPU: up to one window after each burst of work, yielded to any other thread that wants the
//! CPU. Off unless `ONEDOOR_IDLE_POLL` sets the window.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::sync::OnceLock;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

/// The environment variable that sets the window (`200us`, `1ms`; `0` or unset: off).
pub const WINDOW_VAR: &str = "ONEDOOR_IDLE_POLL";

/// The longest window taken: beyond it a lane would poll through gaps no event is expected in.
const LONGEST: Duration = Duration::from_millis(10);

static WINDOW: OnceLock<Duration> = OnceLock::new();

thread_local! {
    /// The poller of this lane while it sleeps, woken when the lane's thread wakes.
    static SLEEPING: RefCell<Option<Waker>> = const { RefCell::new(None) };
    /// Requests taken and answers finished on this thread.
    static WORK: Cell<u64> = const { Cell::new(0) };
    /// Passes the poller of this thread has made, for the tests.
    #[cfg(test)]
    static PASSES: Cell<u64> = const { Cell::new(0) };
}

/// Reads the window from [`WINDOW_VAR`] for every lane started after; an error names the
/// variable and what it expects. Only the first window set counts.
pub fn configure_from_env() -> Result<(), String> {
    let Ok(text) = std::env::var(WINDOW_VAR) else {
        return Ok(());
    };
    let window = parse(&text)?;
    let _ = WINDOW.set(window);
    Ok(())
}

fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let window = match text {
        "" | "0" | "off" => Duration::ZERO,
        _ => onedoor_config::parse_duration(text).map_err(|error| {
            format!("{WINDOW_VAR}={text:?} is not a duration like \"200us\": {error}")
        })?,
    };
    if window > LONGEST {
        return Err(format!(
            "{WINDOW_VAR}={text:?} is longer than the {}ms a lane may poll",
            LONGEST.as_millis()
        ));
    }
    Ok(window)
}

/// The window lanes poll for, when one is set.
pub fn window() -> Option<Duration> {
    WINDOW.get().copied().filter(|w| !w.is_zero())
}

/// A request was taken or an answer finished on this thread: its poller, if any, polls for a
/// window from now.
pub fn worked() {
    WORK.with(|work| work.set(work.get().wrapping_add(1)));
}

/// The lane's thread woke from sleep: its poller, asleep with it, polls again. Set as the lane
/// runtime's `on_thread_unpark`.
pub fn woke() {
    if let Some(poller) = SLEEPING.with(|sleeping| sleeping.borrow_mut().take()) {
        poller.wake();
    }
}

/// The poller, spawned once on a lane's runtime. Each pass yields to the runtime, which polls
/// its sockets and timers without blocking and runs what they woke, then offers the CPU to any
/// other thread; once a whole window passes without [`worked`], it sleeps until the lane wakes.
pub async fn keep_polling(window: Duration) {
    let mut watch = Watch::new(window, Instant::now());
    loop {
        tokio::task::yield_now().await;
        #[cfg(test)]
        PASSES.with(|passes| passes.set(passes.get() + 1));
        if watch.polls_on(WORK.with(Cell::get), Instant::now()) {
            std::thread::yield_now();
        } else {
            sleep_until_woken().await;
            watch = Watch::new(window, Instant::now());
        }
    }
}

/// When the poller last saw work, and whether its window is still open.
struct Watch {
    window: Duration,
    seen: u64,
    last_work: Instant,
}

impl Watch {
    /// A window opening `now`: the lane just started or woke.
    fn new(window: Duration, now: Instant) -> Self {
        let seen = WORK.with(Cell::get);
        Watch {
            window,
            seen,
            last_work: now,
        }
    }

    /// Whether to poll on, given the work count at `now`: a changed count reopens the window.
    fn polls_on(&mut self, work: u64, now: Instant) -> bool {
        if work != self.seen {
            (self.seen, self.last_work) = (work, now);
        }
        now.saturating_duration_since(self.last_work) < self.window
    }
}

/// Pending until [`woke`] runs on this thread.
async fn sleep_until_woken() {
    let mut asleep = false;
    poll_fn(|cx| {
        if asleep {
            return Poll::Ready(());
        }
        asleep = true;
        SLEEPING.with(|sleeping| *sleeping.borrow_mut() = Some(cx.waker().clone()));
        Poll::Pending
    })
    .await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn passes() -> u64 {
        PASSES.with(Cell::get)
    }

    fn lane_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .on_thread_unpark(woke)
            .build()
            .unwrap()
    }

    #[test]
    fn the_window_reads_as_a_duration_and_zero_or_off_turns_it_off() {
        assert_eq!(parse("200us"), Ok(Duration::from_micros(200)));
        assert_eq!(parse(" 1ms "), Ok(Duration::from_millis(1)));
        for off in ["0", "off", ""] {
            assert_eq!(parse(off), Ok(Duration::ZERO));
        }
        assert!(parse("fast").unwrap_err().contains("ONEDOOR_IDLE_POLL"));
        assert!(parse("1s").unwrap_err().contains("longer than the 10ms"));
    }

    #[test]
    fn work_reopens_the_window_and_a_window_without_work_closes_it() {
        let start = Instant::now();
        let at = |us| start + Duration::from_micros(us);
        let mut watch = Watch::new(Duration::from_micros(200), start);
        let work = WORK.with(Cell::get);
        assert!(watch.polls_on(work, at(150)));
        assert!(watch.polls_on(work + 1, at(190)), "work at 190 µs");
        assert!(
            watch.polls_on(work + 1, at(350)),
            "still open 160 µs after it"
        );
        assert!(!watch.polls_on(work + 1, at(400)), "closed 210 µs after it");
        worked();
        assert_eq!(
            WORK.with(Cell::get),
            work + 1,
            "worked() counts on this thread"
        );
    }

    /// CPU time of thread `tid` of this process, in clock ticks (user and system).
    fn cpu_ticks(tid: &str) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
        crate::process::cpu_ticks(&stat).unwrap()
    }

    /// Within the window after the lane wakes, the poller polls; after a window without work it
    /// sleeps, and the next event wakes it: here a timer, after 20 ms of sleep.
    #[test]
    fn a_lane_polls_for_its_window_after_it_wakes() {
        let runtime = lane_runtime();
        runtime.block_on(async {
            tokio::spawn(keep_polling(Duration::from_millis(5)));
            assert!(
                polls_soon(0).await,
                "the poller polls after the lane starts"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
            let before = passes();
            assert!(
                polls_soon(before).await,
                "the poller polls again after the lane woke from sleep"
            );
        });
    }

    /// Whether the poller passes more than ten times beyond `before` within 50 ms, looked at
    /// each millisecond: each look wakes the lane, and on a loaded machine the lane's thread
    /// may wait for a CPU longer than one millisecond.
    async fn polls_soon(before: u64) -> bool {
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(1)).await;
            if passes() > before + 10 {
                return true;
            }
        }
        false
    }

    /// A lane with nothing to do spends no CPU once its window has passed.
    #[test]
    fn an_idle_lane_sleeps_once_its_window_passes() {
        let (told, tid) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let lane = std::thread::spawn(move || {
            let me = std::fs::read_link("/proc/thread-self").unwrap();
            told.send(me.file_name().unwrap().to_string_lossy().into_owned())
                .unwrap();
            lane_runtime().block_on(async {
                tokio::spawn(keep_polling(Duration::from_millis(2)));
                let _ = stopped.await;
            });
        });
        let tid = tid.recv().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let settled = cpu_ticks(&tid);
        std::thread::sleep(Duration::from_millis(400));
        let spent = cpu_ticks(&tid) - settled;
        stop.send(()).unwrap();
        lane.join().unwrap();
        // A poller that never slept would spend most of the 400 ms: about 40 ticks.
        assert!(
            spent <= 3,
            "an idle lane spent {spent} ticks of CPU in 400 ms"
        );
    }

    /// What the lane serves is served while the poller runs: a timer and a socket both fire.
    #[test]
    fn tasks_and_sockets_are_served_while_the_lane_polls() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let runtime = lane_runtime();
        runtime.block_on(async {
            tokio::spawn(keep_polling(Duration::from_millis(5)));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let address = listener.local_addr().unwrap();
            let peer = std::thread::spawn(move || {
                use std::io::{Read, Write};
                let mut stream = std::net::TcpStream::connect(address).unwrap();
                stream.write_all(b"ping").unwrap();
                let mut answer = [0; 4];
                stream.read_exact(&mut answer).unwrap();
                answer
            });
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut asked = [0; 4];
            stream.read_exact(&mut asked).await.unwrap();
            stream.write_all(b"pong").await.unwrap();
            assert_eq!(&asked, b"ping");
            assert_eq!(&peer.join().unwrap(), b"pong");
            tokio::time::sleep(Duration::from_millis(1)).await;
        });
    }
}
