//! Notices between instances: a short message one instance announces on a topic and every other
//! instance listening on it receives at once (Redis pub/sub, on the key prefix's channels). A
//! notice may be lost (a listener reconnecting): it only hastens what each listener also learns
//! by itself, more slowly (runtime keys poll their database).

use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;

/// How long a listener waits before subscribing again after its connection dropped.
const RESUBSCRIBE: Duration = Duration::from_secs(1);
/// Notices a listener holds before the oldest are dropped (it only needs to know "something").
const BACKLOG: usize = 16;

/// The channel of `topic` under `prefix`.
pub(crate) fn channel(prefix: &str, topic: &str) -> String {
    format!("{prefix}:notice:{topic}")
}

/// Every notice on `channel` until the receiver is dropped; reconnects by itself.
pub(crate) fn listen(client: redis::Client, channel: String) -> mpsc::Receiver<String> {
    let (sender, receiver) = mpsc::channel(BACKLOG);
    tokio::spawn(async move {
        while !sender.is_closed() {
            match subscribed(&client, &channel, &sender).await {
                Ok(()) => tracing::debug!(
                    channel,
                    "notices: the subscription ended; subscribing again"
                ),
                Err(error) => {
                    tracing::debug!(%error, channel, "notices: cannot subscribe; trying again")
                }
            }
            tokio::time::sleep(RESUBSCRIBE).await;
        }
    });
    receiver
}

async fn subscribed(
    client: &redis::Client,
    channel: &str,
    sender: &mpsc::Sender<String>,
) -> redis::RedisResult<()> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(channel).await?;
    // Whatever may have been announced while not subscribed.
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
