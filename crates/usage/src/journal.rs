//! The spill journal: an append-only file of JSON lines, one record a line, that holds records
//! while the store cannot take them (down, slow, or the channel to the writer full). The writer
//! replays it when the store is back: it renames the journal aside (appends go on into a fresh
//! one), inserts what it holds, and deletes it. A replay cut short leaves the renamed file for the
//! next try, also after a restart; the request id keeps a record that is inserted twice single.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::record::UsageRecord;

pub struct Journal {
    /// The file appends go to.
    active: PathBuf,
    /// The file being replayed (the active one, renamed).
    replaying: PathBuf,
    file: Mutex<Option<File>>,
    /// Whether either file may hold records; set by every append, cleared by a finished replay.
    pending: AtomicBool,
}

impl Journal {
    pub fn new(active: PathBuf) -> Journal {
        let mut name = active.file_name().unwrap_or_default().to_os_string();
        name.push(".replaying");
        let replaying = active.with_file_name(name);
        let pending = replaying.exists() || non_empty(&active);
        Journal {
            active,
            replaying,
            file: Mutex::new(None),
            pending: AtomicBool::new(pending),
        }
    }

    pub fn path(&self) -> &Path {
        &self.active
    }

    fn lock(&self) -> MutexGuard<'_, Option<File>> {
        self.file
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Appends `records`, each as one whole line.
    pub fn append(&self, records: &[UsageRecord]) -> io::Result<()> {
        let mut text = String::with_capacity(records.len() * 512);
        for record in records {
            text.push_str(&serde_json::to_string(record)?);
            text.push('\n');
        }
        let mut file = self.lock();
        if file.is_none() {
            if let Some(dir) = self.active.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            let opened = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.active)?;
            *file = Some(opened);
        }
        if let Some(file) = file.as_mut() {
            file.write_all(text.as_bytes())?;
        }
        self.pending.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether records wait in the journal.
    pub fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Makes what was appended so far durable (on shutdown).
    pub fn sync(&self) -> io::Result<()> {
        match self.lock().as_ref() {
            Some(file) => file.sync_data(),
            None => Ok(()),
        }
    }

    /// The file to replay: one left from a replay cut short, else the active journal renamed
    /// aside; `None` when nothing waits.
    pub fn backlog(&self) -> io::Result<Option<Backlog>> {
        if self.replaying.exists() {
            return Ok(Some(Backlog::open(&self.replaying)?));
        }
        let mut file = self.lock();
        if !non_empty(&self.active) {
            self.pending.store(false, Ordering::Release);
            return Ok(None);
        }
        *file = None;
        std::fs::rename(&self.active, &self.replaying)?;
        Ok(Some(Backlog::open(&self.replaying)?))
    }

    /// A replayed backlog is in the store: it goes, and the journal is pending again only if
    /// records were appended meanwhile.
    pub fn replayed(&self, backlog: Backlog) -> io::Result<()> {
        drop(backlog.reader);
        std::fs::remove_file(&backlog.path)?;
        let _file = self.lock();
        self.pending
            .store(non_empty(&self.active), Ordering::Release);
        Ok(())
    }
}

fn non_empty(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.len() > 0)
}

/// A journal file being replayed, read a batch at a time.
pub struct Backlog {
    path: PathBuf,
    reader: BufReader<File>,
    /// Lines that were not a record (a line cut short by a crash mid-write), skipped.
    pub skipped: u64,
}

impl Backlog {
    fn open(path: &Path) -> io::Result<Backlog> {
        Ok(Backlog {
            path: path.to_path_buf(),
            reader: BufReader::new(File::open(path)?),
            skipped: 0,
        })
    }

    /// Up to `limit` more records; empty at the end of the file.
    pub fn next_batch(&mut self, limit: usize) -> io::Result<Vec<UsageRecord>> {
        let mut batch = Vec::new();
        let mut line = String::new();
        while batch.len() < limit {
            line.clear();
            if self.reader.read_line(&mut line)? == 0 {
                break;
            }
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str(&line) {
                Ok(record) => batch.push(record),
                Err(_) => self.skipped += 1,
            }
        }
        Ok(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn journal(name: &str) -> Journal {
        let dir = std::env::temp_dir().join(format!(
            "onedoor-usage-journal-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Journal::new(dir.join("usage.journal.jsonl"))
    }

    fn drain(backlog: &mut Backlog) -> Vec<String> {
        let mut ids = Vec::new();
        loop {
            let batch = backlog.next_batch(2).unwrap();
            if batch.is_empty() {
                return ids;
            }
            ids.extend(batch.into_iter().map(|r| r.request_id));
        }
    }

    #[test]
    fn appends_made_during_a_replay_wait_for_the_next_one() {
        let journal = journal("rotate");
        assert!(!journal.pending());
        let ids = ["a", "b", "c"];
        let records: Vec<_> = ids.iter().map(|id| crate::testing_record(id)).collect();
        journal.append(&records).unwrap();
        assert!(journal.pending());
        let mut backlog = journal.backlog().unwrap().unwrap();
        journal.append(&[crate::testing_record("d")]).unwrap();
        assert_eq!(drain(&mut backlog), ids);
        journal.replayed(backlog).unwrap();
        assert!(journal.pending());
        let mut backlog = journal.backlog().unwrap().unwrap();
        assert_eq!(drain(&mut backlog), ["d"]);
        journal.replayed(backlog).unwrap();
        assert!(!journal.pending());
        assert!(journal.backlog().unwrap().is_none());
    }

    #[test]
    fn a_replay_cut_short_is_found_again_after_a_restart_and_torn_lines_are_skipped() {
        let journal = journal("restart");
        journal
            .append(&[crate::testing_record("a"), crate::testing_record("b")])
            .unwrap();
        let backlog = journal.backlog().unwrap().unwrap();
        drop(backlog);
        let mut torn = OpenOptions::new()
            .append(true)
            .open(&journal.replaying)
            .unwrap();
        torn.write_all(b"{\"request_id\":\"c\",\"at_").unwrap();
        let restarted = Journal::new(journal.active.clone());
        assert!(restarted.pending());
        let mut backlog = restarted.backlog().unwrap().unwrap();
        assert_eq!(drain(&mut backlog), ["a", "b"]);
        assert_eq!(backlog.skipped, 1);
    }
}
