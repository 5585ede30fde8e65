//! Keeping an instance's runtime keys current: the store is opened (and tried again each second
//! while it cannot be), then its change number is polled four times a second, so a key created,
//! changed or disabled on any instance takes effect on every other within a second; with a Redis
//! state store (one server's URL), the instance that made a change also announces it over Redis
//! pub/sub (`onedoor_state::Notices`), and the others read the store at once. The uses seen here
//! are written every few seconds and at shutdown.

use std::sync::Arc;
use std::time::Duration;

use onedoor_usage::KeyStore;
use tokio::sync::{mpsc, watch};

use super::ClientKeys;

const POLL: Duration = Duration::from_millis(250);
/// Polls between two writes of the keys' last uses.
const POLLS_PER_FLUSH: u32 = 20;
const REOPEN: Duration = Duration::from_secs(1);
/// The state store topic of key changes.
pub const TOPIC: &str = "client-keys";

pub async fn run(keys: Arc<ClientKeys>, mut shutdown: watch::Receiver<bool>) {
    let Some(destination) = keys.destination.clone() else {
        return;
    };
    loop {
        match KeyStore::open(&destination).await {
            Ok(Some(store)) => {
                keys.open(store).await;
                break;
            }
            Ok(None) => return,
            Err(error) => {
                tracing::warn!(%error, store = %destination, "runtime keys: the store cannot be opened; trying again")
            }
        }
        if stopped(&mut shutdown, REOPEN).await {
            return;
        }
    }
    let mut notices = keys.notices.as_ref().map(onedoor_state::Notices::listen);
    let mut polls = 0u32;
    loop {
        if let Err(error) = keys.refresh(false).await {
            tracing::warn!(%error, "runtime keys: the store cannot be read; the keys known stay");
        }
        polls += 1;
        if polls.is_multiple_of(POLLS_PER_FLUSH) {
            keys.flush_last_used().await;
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            () = notice(&mut notices) => {}
            _ = shutdown.changed() => {}
        }
        if *shutdown.borrow() || shutdown.has_changed().is_err() {
            break;
        }
    }
    keys.flush_last_used().await;
}

/// The next notice of a change; never, without a shared store (or once its listener is gone).
async fn notice(notices: &mut Option<mpsc::Receiver<String>>) {
    let Some(receiver) = notices else {
        return std::future::pending().await;
    };
    if receiver.recv().await.is_none() {
        *notices = None;
        std::future::pending::<()>().await;
    }
}

/// Waits `pause`; `true` when the gateway is stopping.
async fn stopped(shutdown: &mut watch::Receiver<bool>, pause: Duration) -> bool {
    if *shutdown.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(pause) => *shutdown.borrow(),
        changed = shutdown.changed() => changed.is_err() || *shutdown.borrow(),
    }
}
