//! N idle keep-alive connections: each is opened, answers one request, and is then held open
//! without traffic, the way a fleet of quiet SDK clients holds a gateway's connections.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::target::{Sender, Target};

pub struct Plan {
    pub connections: usize,
    /// How many connections are being opened at once.
    pub parallel: usize,
}

pub struct Opened {
    pub senders: Vec<Sender>,
    pub errors: usize,
    pub first_error: Option<String>,
}

impl Opened {
    /// Connections the server has not closed (yet).
    pub fn still_open(&self) -> usize {
        self.senders.iter().filter(|s| !s.is_closed()).count()
    }
}

pub async fn open(target: Arc<Target>, plan: &Plan) -> Opened {
    let gate = Arc::new(Semaphore::new(plan.parallel.max(1)));
    let mut tasks = JoinSet::new();
    for _ in 0..plan.connections {
        let (target, gate) = (target.clone(), gate.clone());
        tasks.spawn(async move {
            let _permit = gate.acquire_owned().await.map_err(|e| e.to_string())?;
            one(&target).await
        });
    }
    let mut opened = Opened {
        senders: Vec::with_capacity(plan.connections),
        errors: 0,
        first_error: None,
    };
    while let Some(joined) = tasks.join_next().await {
        match joined.map_err(|e| e.to_string()).and_then(|r| r) {
            Ok(sender) => opened.senders.push(sender),
            Err(e) => {
                opened.errors += 1;
                opened.first_error.get_or_insert(e);
            }
        }
    }
    opened
}

/// Opens a connection, sends one request on it, reads the whole answer, keeps the connection.
async fn one(target: &Target) -> Result<Sender, String> {
    let mut sender = target.connect().await?;
    let response = sender
        .send_request(target.request()?)
        .await
        .map_err(|e| format!("request: {e}"))?;
    let status = response.status();
    response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?;
    if status != 200 {
        return Err(format!("status {status}"));
    }
    // The connection is ready for its next request once the answer is read.
    tokio::time::timeout(Duration::from_secs(5), sender.ready())
        .await
        .map_err(|_| "connection not reusable after 5s".to_owned())?
        .map_err(|e| format!("connection: {e}"))?;
    Ok(sender)
}
