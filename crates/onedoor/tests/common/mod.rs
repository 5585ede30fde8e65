//! The real `onedoor serve` as a child process for the binary's behaviour tests: started on a
//! config file, spoken to over raw HTTP/1.0, signalled, and killed if a test ends without
//! stopping it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A running gateway: the address from its config's `listen:` line and its stderr log.
pub struct Gateway {
    child: Child,
    pub addr: SocketAddr,
    log: PathBuf,
}

impl Gateway {
    /// Starts `onedoor serve --config <config>` from the config's folder, logging to
    /// `gateway-<run>.log` there, and waits until `/healthz` answers 200.
    pub async fn start(config: &Path, run: &str) -> Gateway {
        Gateway::start_with(config, run, &[]).await
    }

    /// [`Gateway::start`] with `env` added to the process's environment.
    pub async fn start_with(config: &Path, run: &str, env: &[(&str, &str)]) -> Gateway {
        let mut command = Command::new(env!("CARGO_BIN_EXE_onedoor"));
        command.args(["serve", "--config"]).arg(config);
        command.envs(env.iter().copied());
        Gateway::spawn(command, config, run).await
    }

    /// [`Gateway::start`] from a shell that first runs `prelude` (`ulimit -Sn 256`, say) and
    /// then becomes the gateway, so the process id is the gateway's.
    pub async fn start_after(config: &Path, run: &str, prelude: &str) -> Gateway {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!("{prelude}; exec \"$0\" serve --config \"$1\""))
            .arg(env!("CARGO_BIN_EXE_onedoor"))
            .arg(config);
        Gateway::spawn(command, config, run).await
    }

    async fn spawn(mut command: Command, config: &Path, run: &str) -> Gateway {
        let text = std::fs::read_to_string(config).unwrap();
        let addr: SocketAddr = text
            .lines()
            .find_map(|l| l.strip_prefix("listen: "))
            .expect("the config has a `listen: ADDR` line")
            .trim()
            .parse()
            .unwrap();
        let dir = config.parent().unwrap();
        let log = dir.join(format!("gateway-{run}.log"));
        let child = command
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let gateway = Gateway { child, addr, log };
        let started = Instant::now();
        while http(addr, "GET /healthz HTTP/1.0\r\n\r\n".into())
            .await
            .ok()
            .map(|(s, _)| s)
            != Some(200)
        {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the gateway did not come up:\n{}",
                gateway.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        gateway
    }

    /// Sends the signal `name` (TERM, HUP, ...) to the process.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([format!("-{name}"), self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{name} failed");
    }

    /// SIGKILL straight from this process (no `kill` command to start first): the moment after
    /// an answer, before the gateway does anything more.
    pub fn kill_at_once(&mut self) {
        self.child.kill().unwrap();
    }

    /// Waits up to `within` for the process to exit.
    pub async fn exit(&mut self, within: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                started.elapsed() < within,
                "the gateway did not exit within {within:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM, then the exit status within 20 s.
    pub async fn terminate(mut self) -> ExitStatus {
        self.signal("TERM");
        self.exit(Duration::from_secs(20)).await
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The CPU time the process has used, user and system, in clock ticks.
    pub fn cpu_ticks(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        onedoor_gateway::process::cpu_ticks(&stat).unwrap()
    }

    /// Where the process's stderr goes; readable after it exits.
    pub fn log_path(&self) -> PathBuf {
        self.log.clone()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A fresh, empty folder of this test process under the system temp dir.
pub fn temp_dir(suite: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("onedoor-{suite}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A loopback address nothing listens on now.
pub fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// One HTTP/1.0 exchange, read to the end of the connection (so a stream's body is all of it,
/// without chunked framing).
pub async fn http(addr: SocketAddr, request: String) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await?;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}
