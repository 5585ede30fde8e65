//! Postgres for tests (feature `testing`): a private server in a temporary directory that a test
//! may stop and start at will (an outage without disturbing anyone else's server), and a fresh
//! database on the machine's own server.

use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// The machine's Postgres (trust auth), as `.ci/run` starts it.
pub const MACHINE_POSTGRES: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// How to start the machine's Postgres, for failure messages.
pub const START_MACHINE_POSTGRES: &str = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start   (what .ci/run does when `pg_isready -h 127.0.0.1 -p 5432` fails)";

/// A Postgres server of its own, listening on 127.0.0.1 at an ephemeral port, with its data in a
/// temporary directory; stopped and removed on drop.
pub struct PrivatePostgres {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
}

impl PrivatePostgres {
    /// `initdb` and start a server; the error says what is missing.
    pub fn start() -> Result<PrivatePostgres, String> {
        let bin = server_binaries()?;
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "onedoor-pg-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        if running_as_root() {
            // initdb refuses to run as root: the server runs as `postgres`, which must own its files.
            let (uid, gid) = postgres_user()?;
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
                .map_err(|e| format!("cannot hand {} to postgres: {e}", dir.display()))?;
        }
        let port = free_port()?;
        let server = PrivatePostgres { bin, dir, port };
        let data = server.data();
        server.run(
            "initdb",
            &[
                "-D",
                &data,
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )?;
        server.resume()?;
        Ok(server)
    }

    /// A URL of the server's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server (fast shutdown: open connections are cut) and waits until it is down.
    pub fn stop(&self) -> Result<(), String> {
        self.run("pg_ctl", &["-D", &self.data(), "-m", "fast", "-w", "stop"])
    }

    /// Starts the stopped server again on the same port and waits until it accepts connections.
    pub fn resume(&self) -> Result<(), String> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("server.log").display().to_string();
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-o",
                &options,
                "-l",
                &log,
                "-w",
                "start",
            ],
        )
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    fn run(&self, program: &str, args: &[&str]) -> Result<(), String> {
        let program = self.bin.join(program);
        let mut command = match running_as_root() {
            true => {
                let mut command = Command::new("runuser");
                command.args(["-u", "postgres", "--"]).arg(&program);
                command
            }
            false => Command::new(&program),
        };
        let output = command
            .args(args)
            .current_dir(&self.dir)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
        match output.status.success() {
            true => Ok(()),
            false => Err(format!(
                "{} {} failed: {}{}",
                program.display(),
                args.join(" "),
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )),
        }
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = self.run(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        );
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The folder with `initdb` and `pg_ctl`: `ONEDOOR_PG_BIN`, else the newest
/// `/usr/lib/postgresql/*/bin` (Debian's layout).
fn server_binaries() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("ONEDOOR_PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin).ok_or_else(|| {
        "initdb and pg_ctl were not found in /usr/lib/postgresql/*/bin (set ONEDOOR_PG_BIN to their folder, or `apt-get install postgresql`)".to_owned()
    })
}

fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn postgres_user() -> Result<(u32, u32), String> {
    let id = |flag: &str| -> Result<u32, String> {
        let output = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .map_err(|e| format!("cannot run id: {e}"))?;
        String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .map_err(|_| "there is no `postgres` user to run a private Postgres as".to_owned())
    };
    Ok((id("-u")?, id("-g")?))
}

fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(listener.local_addr().map_err(|e| e.to_string())?.port())
}

/// A fresh, empty database on the server at `admin_url` (named after `purpose` and this
/// process), and its URL. The error says how to start the machine's Postgres.
pub async fn fresh_database(admin_url: &str, purpose: &str) -> Result<String, String> {
    let (client, connection) = tokio_postgres::connect(admin_url, tokio_postgres::NoTls)
        .await
        .map_err(|e| {
            format!("Postgres is not reachable at {admin_url} ({e}); start it with:\n  {START_MACHINE_POSTGRES}")
        })?;
    let connection = tokio::spawn(connection);
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "onedoor_{purpose}_{}_{}_{}",
        std::process::id(),
        crate::record::now_ms(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .map_err(|e| format!("cannot create database {name}: {e}"))?;
    drop(client);
    let _ = connection.await;
    let base = admin_url
        .rsplit_once('/')
        .map_or(admin_url, |(base, _)| base);
    Ok(format!("{base}/{name}"))
}

/// Removes a database [`fresh_database`] made.
pub async fn drop_database(admin_url: &str, url: &str) {
    let Some((_, name)) = url.rsplit_once('/') else {
        return;
    };
    if let Ok((client, connection)) =
        tokio_postgres::connect(admin_url, tokio_postgres::NoTls).await
    {
        let connection = tokio::spawn(connection);
        let _ = client
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await;
        drop(client);
        let _ = connection.await;
    }
}
