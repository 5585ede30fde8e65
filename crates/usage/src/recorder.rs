//! The hand-off from the request path to the store. [`Recorder::record`] puts the record in the
//! recording thread's own slot and copies it into that slot's region of the [`ledger`] (memory
//! that outlives a killed process), nothing more; a writer on its own thread takes every slot's
//! records in batches into the store, then releases them from the ledger. When the store is down
//! or slow (or a slot is full) records go to the [`Journal`] instead, and the writer replays the
//! journal into the store once it answers again; a start first moves what a killed process left
//! in the ledger to the journal.
//! [`Recorder::close`] (shutdown) writes out what is buffered before it returns.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::journal::Journal;
use crate::ledger::{self, Region};
use crate::postgres::PostgresStore;
use crate::record::UsageRecord;
use crate::sqlite::SqliteStore;
use crate::store::{Destination, StoreUrl, UsageError};

/// Records waiting for the writer, at most, before `record` spills to the journal itself.
const BUFFERED: usize = 32_768;
/// Slots records wait in; each recording thread uses one (threads beyond share them).
const SLOTS: usize = 8;
/// Messages to the writer waiting at once: a few wake-ups, flushes and a close.
const CHANNEL: usize = 64;
/// Records written in one transaction, at most.
const BATCH: usize = 512;
/// How long the writer waits for more records before it writes a batch that is not full.
const LINGER: Duration = Duration::from_millis(20);
/// Journal files one replay works through before the writer looks at its channel again.
const REPLAY_ROUNDS: usize = 16;
/// The first and the longest wait before the store is tried again after a failure.
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// The handle requests record through; cheap to clone, shared by every runtime of a gateway.
#[derive(Clone)]
pub struct Recorder {
    inner: Option<Arc<Inner>>,
    /// Recorders this one replaced (a reload changed the store): they keep taking the records of
    /// requests that started before, and close with this one.
    retired: Arc<Mutex<Vec<Recorder>>>,
}

struct Inner {
    destination: Destination,
    sender: mpsc::Sender<Message>,
    slots: Arc<Slots>,
    journal: Arc<Journal>,
    counters: Arc<Counters>,
}

enum Message {
    /// A slot received its first record since the writer last took them.
    Ready,
    /// Write out everything sent before; answers whether the journal is empty (all in the store).
    Flush(oneshot::Sender<bool>),
    /// [`Message::Flush`], then stop the writer.
    Close(oneshot::Sender<bool>),
}

#[derive(Default)]
struct Counters {
    written: AtomicU64,
    spilled: AtomicU64,
    replayed: AtomicU64,
    lost: AtomicU64,
}

/// What a recorder has done so far (for metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecorderStats {
    /// Records the store accepted straight from the recording threads.
    pub written: u64,
    /// Records that went to the journal (store down or slow, channel full, or shutting down).
    pub spilled: u64,
    /// Journal records replayed into the store.
    pub replayed: u64,
    /// Records neither the store nor the journal could take (the journal's disk failed).
    pub lost: u64,
    /// Records waiting for the writer.
    pub buffered: usize,
}

impl Recorder {
    /// A recorder that keeps nothing (`usage.store: off`).
    pub fn off() -> Recorder {
        Recorder {
            inner: None,
            retired: Arc::default(),
        }
    }

    /// Starts the writer thread for `destination`. It does not wait for the store: a store that
    /// cannot be reached yet is tried again and again while records wait in the journal.
    pub fn start(destination: Destination) -> Result<Recorder, UsageError> {
        let (Some(store), Some(journal)) = (Store::new(&destination.store), &destination.journal)
        else {
            return Ok(Recorder::off());
        };
        let ledger = ledger::path_beside(journal);
        let journal = Arc::new(Journal::new(journal.clone()));
        let (sender, inbox) = mpsc::channel(CHANNEL);
        let counters = Arc::new(Counters::default());
        let slots = Arc::new(Slots::new(open_ledger(&ledger, &journal)));
        let writer = Writer {
            slots: slots.clone(),
            store,
            journal: journal.clone(),
            counters: counters.clone(),
            retry_at: Instant::now(),
            backoff: RETRY_MIN,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| UsageError::Io("cannot start the usage writer".into(), e))?;
        std::thread::Builder::new()
            .name("onedoor-usage".into())
            .spawn(move || runtime.block_on(writer.run(inbox)))
            .map_err(|e| UsageError::Io("cannot start the usage writer".into(), e))?;
        tracing::info!(store = %destination.store, journal = %journal.path().display(), "usage recording started");
        Ok(Recorder {
            inner: Some(Arc::new(Inner {
                destination,
                sender,
                slots,
                journal,
                counters,
            })),
            retired: Arc::default(),
        })
    }

    /// Whether this recorder writes to `destination` (a reload that keeps it keeps the recorder).
    pub fn writes_to(&self, destination: &Destination) -> bool {
        match &self.inner {
            Some(inner) => inner.destination == *destination,
            None => destination.store == StoreUrl::Off,
        }
    }

    /// Hands `record` to the writer without waiting: into this thread's slot, which only the
    /// writer touches besides, once a turn. When the slot is full or the writer has stopped, the
    /// record goes to the journal at once.
    pub fn record(&self, record: UsageRecord) {
        let Some(inner) = &self.inner else {
            return;
        };
        let record = match inner.slots.put(record) {
            Put::First => match inner.sender.try_send(Message::Ready) {
                // Full: wake-ups are already waiting.
                Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => return,
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    let (mut left, mut taken) = (Vec::new(), Taken::default());
                    inner.slots.close(&mut left, &mut taken);
                    spill(&inner.journal, &inner.counters, &left);
                    return inner.slots.release(&taken);
                }
            },
            Put::Added => return,
            Put::Refused(record) => record,
        };
        spill(&inner.journal, &inner.counters, &[*record]);
    }

    /// Waits until every record recorded before is in the store or the journal, trying the
    /// store (and replaying the journal) at once; `true` when the journal is empty afterwards.
    pub async fn flush(&self) -> bool {
        self.ask(Message::Flush).await
    }

    /// Takes over from `old` (a reload changed the store): `old` goes on writing what requests
    /// already under way record to it, and closes when this one does.
    pub fn replaces(&self, old: &Recorder) {
        let mut older = std::mem::take(&mut *lock(&old.retired));
        older.push(old.clone());
        lock(&self.retired).extend(older);
    }

    /// [`Recorder::flush`], then stops the writer (and those of the recorders it replaced);
    /// records after it go to the journal, which the next start replays. Every clone shares the
    /// one writer. `true` when every journal is empty.
    pub async fn close(&self) -> bool {
        let mut empty = self.ask(Message::Close).await;
        let retired = std::mem::take(&mut *lock(&self.retired));
        for old in retired {
            empty &= old.ask(Message::Close).await;
        }
        empty
    }

    async fn ask(&self, message: fn(oneshot::Sender<bool>) -> Message) -> bool {
        let Some(inner) = &self.inner else {
            return true;
        };
        let (answer, answered) = oneshot::channel();
        if inner.sender.send(message(answer)).await.is_err() {
            return !inner.journal.pending();
        }
        answered.await.unwrap_or(false)
    }

    pub fn stats(&self) -> RecorderStats {
        let Some(inner) = &self.inner else {
            return RecorderStats::default();
        };
        let c = &inner.counters;
        RecorderStats {
            written: c.written.load(Ordering::Relaxed),
            spilled: c.spilled.load(Ordering::Relaxed),
            replayed: c.replayed.load(Ordering::Relaxed),
            lost: c.lost.load(Ordering::Relaxed),
            buffered: inner.slots.len(),
        }
    }
}

/// The ledger's regions, after moving what a previous process left in them to the journal;
/// none (records then wait in memory only) when the ledger cannot be used.
fn open_ledger(path: &std::path::Path, journal: &Journal) -> Vec<Region> {
    let opened = ledger::open(path, SLOTS).and_then(|(regions, left)| {
        if !left.is_empty() {
            journal.append(&left)?;
            journal.sync()?;
            tracing::warn!(records = left.len(), ledger = %path.display(), "usage records of a gateway that did not stop cleanly go to the journal");
        }
        Ok(regions)
    });
    match opened {
        Ok(mut regions) => {
            regions.iter_mut().for_each(Region::restart);
            regions
        }
        Err(error) => {
            tracing::error!(%error, ledger = %path.display(), "the usage ledger cannot be used: records recorded shortly before a crash may be lost");
            Vec::new()
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Where records wait for the writer: one slot a recording thread (the gateway's lanes), each on
/// its own cache lines, so that lanes recording at once share no counter and wake the writer once
/// a turn, not once a record.
struct Slots {
    slots: [Slot; SLOTS],
}

/// How many records the writer took from each slot (to release from its ledger region once they
/// are in the store or the journal).
type Taken = [usize; SLOTS];

#[derive(Default)]
#[repr(align(128))]
struct Slot(Mutex<Waiting>);

#[derive(Default)]
struct Waiting {
    records: Vec<UsageRecord>,
    /// The writer stopped: records go to the journal.
    closed: bool,
    /// This slot's part of the ledger; every record in `records` is in it too.
    ledger: Option<Region>,
}

/// What [`Slots::put`] did with a record.
enum Put {
    /// Took it into a slot that was empty: the writer should be told.
    First,
    Added,
    /// The slot is full or closed, or its ledger region is full.
    Refused(Box<UsageRecord>),
}

impl Slots {
    fn new(regions: Vec<Region>) -> Slots {
        let slots: [Slot; SLOTS] = Default::default();
        for (slot, region) in slots.iter().zip(regions) {
            lock(&slot.0).ledger = Some(region);
        }
        Slots { slots }
    }

    fn mine(&self) -> &Slot {
        use std::sync::atomic::AtomicUsize;
        static THREADS: AtomicUsize = AtomicUsize::new(0);
        thread_local! {
            static INDEX: usize = THREADS.fetch_add(1, Ordering::Relaxed);
        }
        let index = INDEX.try_with(|i| *i).unwrap_or(0);
        &self.slots[index % SLOTS]
    }

    fn put(&self, record: UsageRecord) -> Put {
        let mut waiting = lock(&self.mine().0);
        if waiting.closed || waiting.records.len() >= BUFFERED / SLOTS {
            return Put::Refused(Box::new(record));
        }
        if let Some(region) = waiting.ledger.as_mut() {
            if !region.write(&record) {
                return Put::Refused(Box::new(record));
            }
        }
        waiting.records.push(record);
        match waiting.records.len() {
            1 => Put::First,
            _ => Put::Added,
        }
    }

    /// Moves every waiting record to the end of `batch`, each slot locked once, counting them in
    /// `taken`.
    fn take(&self, batch: &mut Vec<UsageRecord>, taken: &mut Taken) {
        for (slot, taken) in self.slots.iter().zip(taken) {
            let mut waiting = lock(&slot.0);
            *taken += waiting.records.len();
            batch.append(&mut waiting.records);
        }
    }

    /// Refuses records from now on; moves those still waiting to `batch`, as [`Slots::take`].
    fn close(&self, batch: &mut Vec<UsageRecord>, taken: &mut Taken) {
        for slot in &self.slots {
            lock(&slot.0).closed = true;
        }
        self.take(batch, taken);
    }

    /// The records counted in `taken` are in the store or the journal: their ledger space is
    /// free again.
    fn release(&self, taken: &Taken) {
        for (slot, &n) in self.slots.iter().zip(taken).filter(|(_, &n)| n > 0) {
            if let Some(region) = lock(&slot.0).ledger.as_mut() {
                region.release(n);
            }
        }
    }

    fn len(&self) -> usize {
        self.slots.iter().map(|s| lock(&s.0).records.len()).sum()
    }
}

fn spill(journal: &Journal, counters: &Counters, records: &[UsageRecord]) {
    let n = records.len() as u64;
    match journal.append(records) {
        Ok(()) => counters.spilled.fetch_add(n, Ordering::Relaxed),
        Err(error) => {
            tracing::error!(%error, journal = %journal.path().display(), records = n, "usage records lost: the journal cannot be written");
            counters.lost.fetch_add(n, Ordering::Relaxed)
        }
    };
}

/// The store the writer talks to, connected on first use and again after a failure.
enum Store {
    Sqlite {
        path: std::path::PathBuf,
        open: Option<SqliteStore>,
    },
    Postgres {
        url: String,
        open: Option<PostgresStore>,
    },
}

impl Store {
    fn new(store: &StoreUrl) -> Option<Store> {
        match store {
            StoreUrl::Sqlite(path) => Some(Store::Sqlite {
                path: path.clone(),
                open: None,
            }),
            StoreUrl::Postgres(url) => Some(Store::Postgres {
                url: url.clone(),
                open: None,
            }),
            StoreUrl::Off => None,
        }
    }

    async fn insert(&mut self, records: &[UsageRecord]) -> Result<(), UsageError> {
        match self {
            Store::Sqlite { path, open } => {
                if open.is_none() {
                    *open = Some(SqliteStore::open(path)?);
                }
                let result = match open.as_mut() {
                    Some(store) => store.insert(records).map(drop),
                    None => Ok(()),
                };
                if result.is_err() {
                    *open = None;
                }
                result
            }
            Store::Postgres { url, open } => {
                if open.as_ref().is_none_or(PostgresStore::is_closed) {
                    *open = None;
                    *open = Some(PostgresStore::connect(url).await?);
                }
                let result = match open.as_ref() {
                    Some(store) => store.insert(records).await.map(drop),
                    None => Ok(()),
                };
                if result.is_err() {
                    *open = None;
                }
                result
            }
        }
    }
}

/// What the writer took from its channel in one turn.
struct Gathered {
    batch: Vec<UsageRecord>,
    taken: Taken,
    answers: Vec<oneshot::Sender<bool>>,
    closing: bool,
}

/// `first` and what follows it: after a wake-up, [`LINGER`] for company, then every record
/// waiting and every message; on a flush, at once; on close (or when every sender is gone)
/// everything left, the slots closed behind it.
async fn gather(
    inbox: &mut mpsc::Receiver<Message>,
    slots: &Slots,
    first: Option<Message>,
) -> Gathered {
    let mut gathered = Gathered {
        batch: Vec::new(),
        taken: Taken::default(),
        answers: Vec::new(),
        closing: first.is_none(),
    };
    if let Some(message) = first {
        gathered.take(message);
    }
    gathered.take_waiting(inbox);
    if gathered.answers.is_empty() && !gathered.closing {
        // A transaction per record costs more than the record. Asleep rather than in `recv`,
        // so records recorded meanwhile wake nobody.
        tokio::time::sleep(LINGER).await;
        gathered.take_waiting(inbox);
    }
    if gathered.closing {
        inbox.close();
        gathered.take_waiting(inbox);
        slots.close(&mut gathered.batch, &mut gathered.taken);
    } else {
        slots.take(&mut gathered.batch, &mut gathered.taken);
    }
    gathered
}

impl Gathered {
    fn take_waiting(&mut self, inbox: &mut mpsc::Receiver<Message>) {
        while let Ok(message) = inbox.try_recv() {
            self.take(message);
        }
    }

    fn take(&mut self, message: Message) {
        match message {
            Message::Ready => {}
            Message::Flush(answer) => self.answers.push(answer),
            Message::Close(answer) => {
                self.answers.push(answer);
                self.closing = true;
            }
        }
    }
}

/// The writer thread's loop.
struct Writer {
    slots: Arc<Slots>,
    store: Store,
    journal: Arc<Journal>,
    counters: Arc<Counters>,
    /// Until then the store is not tried: it failed recently.
    retry_at: Instant,
    backoff: Duration,
}

impl Writer {
    async fn run(mut self, mut inbox: mpsc::Receiver<Message>) {
        loop {
            let message = match self.journal.pending() {
                true => tokio::select! {
                    message = inbox.recv() => message,
                    _ = tokio::time::sleep_until(self.retry_at) => {
                        self.replay().await;
                        continue;
                    }
                },
                false => inbox.recv().await,
            };
            let Gathered {
                batch,
                taken,
                answers,
                closing,
            } = gather(&mut inbox, &self.slots, message).await;
            let asked = !answers.is_empty();
            if asked {
                // Someone waits: try the store now rather than at the next retry.
                self.retry_at = Instant::now();
            }
            self.write(batch).await;
            self.slots.release(&taken);
            if closing {
                if let Err(error) = self.journal.sync() {
                    tracing::error!(%error, "the usage journal could not be synced");
                }
            }
            let empty = !self.journal.pending();
            for answer in answers {
                let _ = answer.send(empty);
            }
            if closing {
                tracing::info!(journal_empty = empty, "usage recording stopped");
                return;
            }
        }
    }

    fn failed(&mut self, error: &UsageError) {
        tracing::warn!(%error, retry_in = ?self.backoff, "the usage store cannot take records; they go to the journal");
        self.retry_at = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(RETRY_MAX);
    }

    fn recovered(&mut self) {
        if self.backoff > RETRY_MIN {
            tracing::info!("the usage store takes records again");
        }
        self.backoff = RETRY_MIN;
    }

    /// Writes a batch to the store, or to the journal while the store is failing; then replays
    /// the journal if it holds records and the store may be tried.
    async fn write(&mut self, mut batch: Vec<UsageRecord>) {
        while !batch.is_empty() {
            let rest = batch.split_off(batch.len().min(BATCH));
            if Instant::now() < self.retry_at {
                spill(&self.journal, &self.counters, &batch);
            } else {
                match self.store.insert(&batch).await {
                    Ok(()) => {
                        self.recovered();
                        let n = batch.len() as u64;
                        self.counters.written.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(error) => {
                        self.failed(&error);
                        spill(&self.journal, &self.counters, &batch);
                    }
                }
            }
            batch = rest;
        }
        if self.journal.pending() && Instant::now() >= self.retry_at {
            self.replay().await;
        }
    }

    /// Moves the journal's records into the store: the file being replayed, then what was
    /// appended meanwhile, up to [`REPLAY_ROUNDS`] files (the rest waits for the next turn).
    async fn replay(&mut self) {
        for _ in 0..REPLAY_ROUNDS {
            if !self.replay_one().await {
                return;
            }
        }
    }

    /// Replays one journal file, a batch at a time; `false` when there was none or it failed.
    async fn replay_one(&mut self) -> bool {
        let mut backlog = match self.journal.backlog() {
            Ok(Some(backlog)) => backlog,
            Ok(None) => return false,
            Err(error) => {
                tracing::error!(%error, "the usage journal cannot be read");
                self.retry_at = Instant::now() + RETRY_MAX;
                return false;
            }
        };
        let mut replayed = 0u64;
        loop {
            let batch = match backlog.next_batch(BATCH) {
                Ok(batch) => batch,
                Err(error) => {
                    tracing::error!(%error, "the usage journal cannot be read");
                    self.retry_at = Instant::now() + RETRY_MAX;
                    return false;
                }
            };
            if batch.is_empty() {
                break;
            }
            if let Err(error) = self.store.insert(&batch).await {
                self.failed(&error);
                return false;
            }
            self.recovered();
            replayed += batch.len() as u64;
        }
        if backlog.skipped > 0 {
            tracing::warn!(
                lines = backlog.skipped,
                "skipped journal lines that were not records"
            );
        }
        self.counters
            .replayed
            .fetch_add(replayed, Ordering::Relaxed);
        if let Err(error) = self.journal.replayed(backlog) {
            tracing::error!(%error, "a replayed usage journal could not be removed; it will be replayed again");
            self.retry_at = Instant::now() + RETRY_MAX;
            return false;
        }
        tracing::info!(records = replayed, "usage journal replayed into the store");
        true
    }
}
