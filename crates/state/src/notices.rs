//! Notices between instances: a short message one instance announces on a topic and every other
//! instance listening on it receives at once, over Redis pub/sub on a connection of their own
//! (the store's connection is never held by a subscription), on the key prefix's channels. A
//! notice may be lost (a listener reconnecting): it only hastens what each listener also learns
//! by itself, more slowly (runtime keys poll their database). The `redis://` and `rediss://`
//! forms of one server carry notices; with the others (Cluster, Sentinel) there are none.

use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;

/// How long a listener waits before subscribing again after its connection dropped.
const RESUBSCRIBE: Duration = Duration::from_secs(1);
/// Notices a listener holds before new ones are dropped (it only needs to know "something").
const BACKLOG: usize = 16;
/// The longest an announcement may take.
const ANNOUNCE_TIMEOUT: Duration = Duration::from_millis(500);

/// One topic's channel on one Redis.
#[derive(Clone)]
pub struct Notices {
    client: redis::Client,
    channel: String,
}

impl Notices {
    /// Notices on `topic` under `prefix` (`state.key_prefix`); `None` for a URL that is not one
    /// server's (`redis://`, `rediss://`).
    pub fn new(url: &str, prefix: &str, topic: &str) -> Option<Notices> {
        let single = url.starts_with("redis://") || url.starts_with("rediss://");
        let client = redis::Client::open(url).ok().filter(|_| single)?;
        Some(Notices {
            client,
            channel: format!("{prefix}:notice:{topic}"),
        })
    }

    /// Tells every listener; a notice that cannot be sent in time is dropped.
    pub async fn announce(&self, message: &str) {
        let publish = async {
            let mut connection = self.client.get_multiplexed_async_connection().await?;
            redis::cmd("PUBLISH")
                .arg(&self.channel)
                .arg(message)
                .query_async::<i64>(&mut connection)
                .await
        };
        match tokio::time::timeout(ANNOUNCE_TIMEOUT, publish).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                tracing::debug!(%error, channel = self.channel, "notices: not announced")
            }
            Err(_) => tracing::debug!(channel = self.channel, "notices: not announced in time"),
        }
    }

    /// Every notice from now on until the receiver is dropped (an empty one each time the
    /// subscription starts, for whatever was announced while it was not); reconnects by itself.
    pub fn listen(&self) -> mpsc::Receiver<String> {
        let (sender, receiver) = mpsc::channel(BACKLOG);
        let notices = self.clone();
        tokio::spawn(async move {
            while !sender.is_closed() {
                if let Err(error) = notices.subscribed(&sender).await {
                    tracing::debug!(%error, channel = notices.channel, "notices: cannot subscribe; trying again");
                }
                tokio::time::sleep(RESUBSCRIBE).await;
            }
        });
        receiver
    }

    async fn subscribed(&self, sender: &mpsc::Sender<String>) -> redis::RedisResult<()> {
        let mut pubsub = self.client.get_async_pubsub().await?;
        pubsub.subscribe(&self.channel).await?;
        let _ = sender.try_send(String::new());
        let mut messages = pubsub.on_message();
        while let Some(message) = messages.next().await {
            let text: String = message.get_payload().unwrap_or_default();
            if sender.try_send(text).is_err() && sender.is_closed() {
                return Ok(());
            }
        }
        Ok(())
    }
}
