//! The ledger: a memory-mapped file every record is copied into when it is recorded (before its
//! answer's last byte goes out) and released from once the store or the spill journal holds it.
//! The pages of a shared file mapping belong to the page cache, not to the process, so a gateway
//! killed with SIGKILL leaves every recorded record in the file; the next start moves what was
//! never released to the journal, which the writer replays. Recording costs a copy into memory,
//! no system call.
//!
//! The file is one region per recording slot, each a ring of records:
//! `[len u32][seq u32][JSON][padding to 8]`, the `[len][seq]` word written after the JSON, so a
//! record whose word carries the sequence number the reader expects is whole. A region's header holds the offset and sequence number of its oldest record
//! not yet released (its tail), in one 8-byte word; recovery reads records from the tail while
//! their sequence numbers follow on, so stale records of earlier laps end the scan.

use std::collections::{HashSet, VecDeque};
use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use memmap2::{MmapMut, MmapOptions};

use crate::record::UsageRecord;

/// Bytes of one region: at about 600 bytes a record, some 14,000 records not yet in the store,
/// more than a slot holds waiting (4,096) and being written (as many again).
const REGION: usize = 8 << 20;
/// The region header: a magic word, then the tail word.
const DATA: usize = 64;
const MAGIC: &[u8; 8] = b"ODLEDG01";
/// The `len` of a marker that sends the reader back to the region's first record.
const WRAP: u32 = u32::MAX;
/// A record longer than this goes to the journal instead (an attempt trail of many backends).
const LONGEST: usize = REGION / 16;

/// The ledger file beside a journal: `onedoor-usage.journal.jsonl` → `onedoor-usage.journal.ledger`.
pub fn path_beside(journal: &Path) -> PathBuf {
    journal.with_extension("ledger")
}

/// Maps `regions` regions of the ledger at `path` (created when missing) and reads back every
/// record a previous process recorded and never released. The caller makes the records safe
/// elsewhere, then calls [`Region::restart`] on each region. A ledger this process has open
/// already (a reload moved to another store but kept the journal directory) is refused.
pub fn open(path: &Path, regions: usize) -> io::Result<(Vec<Region>, Vec<UsageRecord>)> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    let held = Arc::new(Held::claim(std::fs::canonicalize(path)?)?);
    let size = (REGION * regions) as u64;
    if file.metadata()?.len() < size {
        file.set_len(size)?;
    }
    let mut mapped = Vec::with_capacity(regions);
    let mut recovered = Vec::new();
    for index in 0..regions {
        let map = map_region(&file, index)?;
        let region = Region::recover(map, held.clone(), &mut recovered);
        mapped.push(region);
    }
    Ok((mapped, recovered))
}

/// One region of the file, mapped shared and writable.
#[allow(unsafe_code)]
fn map_region(file: &std::fs::File, index: usize) -> io::Result<MmapMut> {
    // SAFETY: the mapping is undefined behaviour only if the file is truncated or written
    // through another mapping while mapped. The file belongs to this recorder alone: no other
    // recorder of the process holds it ([`Held`]), other processes have journal directories of
    // their own (docs/usage.md); it is never truncated, only grown before mapping, and each
    // region is mapped once.
    unsafe {
        MmapOptions::new()
            .offset((index * REGION) as u64)
            .len(REGION)
            .map_mut(file)
    }
}

/// The ledgers this process has mapped, by their canonical paths.
static OPEN: Mutex<Option<HashSet<PathBuf>>> = Mutex::new(None);

/// A ledger path held by one recorder of this process, until its last region goes.
struct Held(PathBuf);

impl Held {
    fn claim(path: PathBuf) -> io::Result<Held> {
        let mut open = OPEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !open.get_or_insert_with(HashSet::new).insert(path.clone()) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} is in use by another usage store of this gateway (give each store a journal_dir of its own)", path.display()),
            ));
        }
        Ok(Held(path))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut open = OPEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(open) = open.as_mut() {
            open.remove(&self.0);
        }
    }
}

/// One ring of records; its owner (a recording slot) holds it under its lock.
pub struct Region {
    map: MmapMut,
    /// Declared after `map`, so the path is given up only once the mapping is gone.
    _held: Arc<Held>,
    /// Where the next record goes, and its sequence number.
    head: usize,
    head_seq: u32,
    /// The oldest record not released.
    tail: usize,
    tail_seq: u32,
    /// Where each record not released ends, oldest first.
    ends: VecDeque<usize>,
    scratch: Vec<u8>,
}

impl Region {
    /// Reads the records a previous process left from the tail on, into `into`.
    fn recover(map: MmapMut, held: Arc<Held>, into: &mut Vec<UsageRecord>) -> Region {
        let last = match map[..8] == MAGIC[..] {
            true => scan(&map, into),
            false => 0,
        };
        let seq = last.wrapping_add(2).max(1);
        Region {
            map,
            _held: held,
            head: DATA,
            head_seq: seq,
            tail: DATA,
            tail_seq: seq,
            ends: VecDeque::new(),
            scratch: Vec::with_capacity(1024),
        }
    }

    /// Forgets what the previous process left (the caller has made it safe): new records start
    /// at the region's beginning, with sequence numbers the stale ones do not have.
    pub fn restart(&mut self) {
        self.map[..8].copy_from_slice(MAGIC);
        self.write_tail();
    }

    /// Copies `record` in; `false` when it does not fit (the ring is full of records the store
    /// has not taken yet, or the record is too long).
    pub fn write(&mut self, record: &UsageRecord) -> bool {
        self.scratch.clear();
        if serde_json::to_writer(&mut self.scratch, record).is_err() || self.scratch.len() > LONGEST
        {
            return false;
        }
        let size = (8 + self.scratch.len()).next_multiple_of(8);
        let Some(at) = self.place(size) else {
            return false;
        };
        if at != self.head && self.head + 8 <= REGION {
            put_header(&mut self.map[self.head..], WRAP, self.head_seq);
        }
        let payload = at + 8..at + 8 + self.scratch.len();
        self.map[payload].copy_from_slice(&self.scratch);
        put_header(
            &mut self.map[at..],
            self.scratch.len() as u32,
            self.head_seq,
        );
        self.head = at + size;
        self.head_seq = self.head_seq.wrapping_add(1);
        self.ends.push_back(self.head);
        true
    }

    /// Where a record of `size` bytes fits: at the head, or back at the beginning (behind a
    /// wrap marker) when the end of the region is too near and the tail has moved on. Once the
    /// head has wrapped, it may go up to the tail and no further (at the tail the ring is full).
    fn place(&self, size: usize) -> Option<usize> {
        let wrapped = self.head < self.tail || (self.head == self.tail && !self.ends.is_empty());
        if wrapped {
            return (self.head + size <= self.tail).then_some(self.head);
        }
        if self.head + size <= REGION {
            return Some(self.head);
        }
        (DATA + size <= self.tail).then_some(DATA)
    }

    /// The `n` oldest records are in the store or the journal: the tail moves past them.
    pub fn release(&mut self, n: usize) {
        let n = n.min(self.ends.len());
        let Some(end) = self.ends.drain(..n).next_back() else {
            return;
        };
        self.tail = end;
        self.tail_seq = self.tail_seq.wrapping_add(n as u32);
        if self.ends.is_empty() {
            // Nothing left: start over at the beginning, so that a gateway under light load
            // keeps touching the same few pages.
            (self.head, self.tail) = (DATA, DATA);
        }
        self.write_tail();
    }

    fn write_tail(&mut self) {
        let word = (self.tail as u64) | (u64::from(self.tail_seq) << 32);
        self.map[8..16].copy_from_slice(&word.to_le_bytes());
    }
}

/// Reads a region's records from its tail on into `into`; returns the sequence number after the
/// last one (the one no record has yet).
fn scan(map: &[u8], into: &mut Vec<UsageRecord>) -> u32 {
    let (mut at, mut seq) = split_word(&map[8..16]);
    if !(DATA..=REGION).contains(&at) {
        return seq;
    }
    let mut wrapped = false;
    while let Some(next) = read(map, at, seq) {
        match next {
            Entry::Wrap if wrapped || at == DATA => break,
            Entry::Wrap => (at, wrapped) = (DATA, true),
            Entry::Record(end, record) => {
                into.extend(record.map(|r| *r));
                (at, seq) = (end, seq.wrapping_add(1));
            }
        }
    }
    seq
}

enum Entry {
    Wrap,
    /// A record's end and the record (`None` when its bytes are not one: a torn page).
    Record(usize, Option<Box<UsageRecord>>),
}

/// The entry at `at` if it carries sequence number `seq`; `None` at the end of the records.
fn read(map: &[u8], at: usize, seq: u32) -> Option<Entry> {
    if at + 8 > REGION {
        return Some(Entry::Wrap);
    }
    let (len, found) = split_word(&map[at..at + 8]);
    if found != seq || len == 0 {
        return None;
    }
    if len == WRAP as usize {
        return Some(Entry::Wrap);
    }
    let payload = map.get(at + 8..at + 8 + len)?;
    let end = (at + 8 + len).next_multiple_of(8);
    Some(Entry::Record(end, serde_json::from_slice(payload).ok()))
}

/// Writes the `[len][seq]` word in one copy.
fn put_header(at: &mut [u8], len: u32, seq: u32) {
    let word = u64::from(len) | (u64::from(seq) << 32);
    at[..8].copy_from_slice(&word.to_le_bytes());
}

/// A little-endian word as its low half (an offset or a length) and its high half (a sequence).
fn split_word(bytes: &[u8]) -> (usize, u32) {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[..8]);
    let word = u64::from_le_bytes(word);
    ((word & 0xffff_ffff) as usize, (word >> 32) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "onedoor-usage-ledger-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir.join("usage.ledger")
    }

    fn ids(records: &[UsageRecord]) -> Vec<String> {
        records.iter().map(|r| r.request_id.clone()).collect()
    }

    fn reopen(path: &Path) -> (Vec<Region>, Vec<UsageRecord>) {
        let (mut regions, recovered) = open(path, 2).unwrap();
        regions.iter_mut().for_each(Region::restart);
        (regions, recovered)
    }

    #[test]
    fn records_not_released_are_found_by_the_next_open_and_only_once() {
        let path = ledger("recover");
        let (mut regions, recovered) = reopen(&path);
        assert!(recovered.is_empty());
        for id in ["a", "b", "c"] {
            assert!(regions[0].write(&crate::testing_record(id)));
        }
        assert!(regions[1].write(&crate::testing_record("d")));
        regions[0].release(1);
        assert!(regions[1].write(&crate::testing_record("e")));
        regions[1].release(2);
        assert_eq!(regions[1].head, DATA, "an empty ring starts over");
        assert!(regions[1].write(&crate::testing_record("f")));
        drop(regions);
        let (regions, recovered) = reopen(&path);
        assert_eq!(ids(&recovered), ["b", "c", "f"]);
        assert_eq!(recovered[0], crate::testing_record("b"));
        drop(regions);
        let (_, recovered) = reopen(&path);
        assert!(recovered.is_empty(), "{:?}", ids(&recovered));
    }

    #[test]
    fn the_ring_wraps_around_released_records_and_refuses_when_full() {
        let path = ledger("wrap");
        let (mut regions, _) = reopen(&path);
        let region = &mut regions[0];
        let mut written = 0;
        while region.write(&crate::testing_record(&format!("r{written}"))) {
            written += 1;
        }
        assert!(written > 1000, "{written} records filled a region");
        region.release(written - 2);
        for id in ["x", "y", "z"] {
            assert!(
                region.write(&crate::testing_record(id)),
                "{id} after wrapping"
            );
        }
        assert!(
            region.head < region.tail,
            "the head wrapped behind the tail"
        );
        drop(regions);
        let (_, recovered) = reopen(&path);
        let last = [format!("r{}", written - 2), format!("r{}", written - 1)];
        assert_eq!(ids(&recovered), [&last[0], &last[1], "x", "y", "z"]);
    }

    #[test]
    fn a_head_that_wrapped_up_to_the_tail_refuses_rather_than_overwrite_it() {
        let path = ledger("full");
        let (mut regions, _) = reopen(&path);
        let region = &mut regions[0];
        let id = |n: usize| format!("r{n:06}");
        let mut written = 0;
        while region.write(&crate::testing_record(&id(written))) {
            written += 1;
        }
        // One record's room at the beginning: the next one wraps and fills the ring exactly.
        region.release(1);
        assert!(region.write(&crate::testing_record(&id(written))));
        assert_eq!(region.head, region.tail, "the ring is exactly full");
        assert!(!region.write(&crate::testing_record(&id(written + 1))));
        drop(regions);
        let (_, recovered) = reopen(&path);
        let expected: Vec<String> = (1..=written).map(id).collect();
        assert_eq!(ids(&recovered), expected);
    }

    #[test]
    fn a_ledger_open_in_this_process_is_refused_until_it_is_dropped() {
        let path = ledger("held");
        let (regions, _) = reopen(&path);
        assert!(open(&path, 2).is_err());
        drop(regions);
        assert!(open(&path, 2).is_ok());
    }

    #[test]
    fn a_record_without_its_header_ends_the_records() {
        let path = ledger("torn");
        let (mut regions, _) = reopen(&path);
        assert!(regions[0].write(&crate::testing_record("a")));
        assert!(regions[0].write(&crate::testing_record("b")));
        let second = regions[0].ends[0];
        regions[0].map[second..second + 8].fill(0);
        drop(regions);
        let (_, recovered) = reopen(&path);
        assert_eq!(ids(&recovered), ["a"]);
    }
}
