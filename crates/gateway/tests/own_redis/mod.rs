//! `redis-server` processes of a test's own (the machine's Redis is left alone): one server, a
//! TLS server with an ACL user, a three-master Cluster, a master with a replica and a Sentinel,
//! each on free loopback ports with its files in a temporary directory, stopped when dropped.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::common::free_port;

const INSTALL: &str = "install it with: apt-get install -y redis-server redis-tools";

/// A directory of this process's own under the system's temporary one, removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir =
            std::env::temp_dir().join(format!("onedoor-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One `redis-server` started with `args` from `dir`, answering on `port`.
pub struct OwnRedis {
    child: Option<Child>,
    pub port: u16,
    args: Vec<String>,
    dir: PathBuf,
    /// For a TLS-only server: the CA `redis-cli` checks it with.
    tls_ca: Option<PathBuf>,
}

pub fn answers_ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let mut reply = [0u8; 7];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}

fn listens(port: u16) -> bool {
    TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// Polls `check` every 20 ms for up to `within`.
pub fn wait_for(within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if check() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(check(), "{what} within {within:?}");
}

impl OwnRedis {
    /// A plain server on `port` that keeps nothing on disk.
    pub fn start(port: u16) -> OwnRedis {
        let args = vec![
            "--port".to_owned(),
            port.to_string(),
            "--bind".to_owned(),
            "127.0.0.1".to_owned(),
        ];
        OwnRedis::spawn(&std::env::temp_dir(), args, port, answers_ping)
    }

    /// A server on `dir` with `args` (by default keeping nothing on disk); ready once
    /// `ready(port)`.
    pub fn spawn(dir: &Path, args: Vec<String>, port: u16, ready: fn(u16) -> bool) -> OwnRedis {
        let mut redis = OwnRedis {
            child: None,
            port,
            args,
            dir: dir.to_owned(),
            tls_ca: None,
        };
        redis.run(ready);
        redis
    }

    fn run(&mut self, ready: fn(u16) -> bool) {
        // A config file comes first; the test's own arguments override the defaults.
        let file = self.args.first().filter(|a| !a.starts_with("--"));
        let args = &self.args[usize::from(file.is_some())..];
        let child = Command::new("redis-server")
            .current_dir(&self.dir)
            .args(file)
            .args(["--save", "", "--appendonly", "no"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run redis-server ({e}); {INSTALL}"));
        self.child = Some(child);
        let port = self.port;
        wait_for(
            Duration::from_secs(5),
            &format!("redis-server answers on port {port}"),
            || ready(port),
        );
    }

    /// Kills it (SIGKILL: no chance to save anything on the way out).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        assert!(!listens(self.port), "redis-server still answers after kill");
    }

    /// Starts it again after [`OwnRedis::stop`], same port and arguments (empty unless its
    /// arguments keep an append-only file).
    pub fn start_again(&mut self) {
        self.run(answers_ping);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// `redis-cli` against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        match &self.tls_ca {
            Some(ca) => {
                let ca = ca.display().to_string();
                let tls = ["--tls", "--cacert", &ca];
                cli(self.port, &[&tls[..], args].concat())
            }
            None => cli(self.port, args),
        }
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `redis-cli -p PORT ARGS...`, its output (trimmed; its errors when it printed nothing else).
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run redis-cli ({e}); {INSTALL}"));
    let said = if out.stdout.is_empty() {
        &out.stderr
    } else {
        &out.stdout
    };
    String::from_utf8_lossy(said).trim().to_owned()
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| (*a).to_owned()).collect()
}

/// A CA made for the test and a certificate it signed for 127.0.0.1, as PEM files in `dir`.
pub struct TestCa {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    pub fn new(dir: &Scratch) -> TestCa {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        // Names of their own: a leaf named like its issuer reads as self-signed to OpenSSL.
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "onedoor test CA");
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let server_key = rcgen::KeyPair::generate().unwrap();
        let mut server_params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
        server_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "127.0.0.1");
        let server = server_params.signed_by(&server_key, &ca, &ca_key).unwrap();
        TestCa {
            ca: dir.file("ca.pem", &ca.pem()),
            cert: dir.file("server.pem", &server.pem()),
            key: dir.file("server.key", &server_key.serialize_pem()),
        }
    }
}

/// A TLS-only server (no plain port) whose ACL user `user` logs in with `password`.
pub fn tls_server(dir: &Scratch, ca: &TestCa, user: &str, password: &str) -> OwnRedis {
    let port = free_port();
    let mut args = tls_only(port, ca);
    args.extend(strings(&["--bind", "127.0.0.1", "--user", user, "on"]));
    args.push(format!(">{password}"));
    args.extend(strings(&["~*", "&*", "+@all"]));
    OwnRedis::spawn(&dir.0, args, port, listens)
}

/// The arguments that make a server on `port` TLS-only with `ca`'s certificate.
fn tls_only(port: u16, ca: &TestCa) -> Vec<String> {
    let mut args = strings(&["--port", "0", "--tls-auth-clients", "no"]);
    for (flag, value) in [
        ("--tls-port", port.to_string()),
        ("--tls-cert-file", ca.cert.display().to_string()),
        ("--tls-key-file", ca.key.display().to_string()),
        ("--tls-ca-cert-file", ca.ca.display().to_string()),
    ] {
        args.extend([flag.to_owned(), value]);
    }
    args
}

/// Three masters (no replicas) joined by `redis-cli --cluster create`, slots all assigned.
pub struct OwnCluster {
    pub nodes: Vec<OwnRedis>,
    tls: bool,
    _dir: Scratch,
}

impl OwnCluster {
    pub fn start() -> OwnCluster {
        OwnCluster::start_with(Scratch::new("cluster"), None)
    }

    /// The same, TLS-only (the cluster bus too), with `ca`'s certificate; its files in `dir`.
    pub fn start_tls(dir: Scratch, ca: &TestCa) -> OwnCluster {
        OwnCluster::start_with(dir, Some(ca))
    }

    fn start_with(dir: Scratch, tls: Option<&TestCa>) -> OwnCluster {
        let nodes: Vec<OwnRedis> = (0..3)
            .map(|_| OwnCluster::node(&dir, free_port(), tls))
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut create = vec!["--cluster", "create"];
        create.extend(addresses.iter().map(String::as_str));
        create.push("--cluster-yes");
        let made = nodes[0].cli(&create);
        assert!(made.contains("All 16384 slots covered"), "{made}");
        for node in &nodes {
            wait_for(
                Duration::from_secs(10),
                "every node sees the cluster ok",
                || node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"),
            );
        }
        OwnCluster {
            nodes,
            tls: tls.is_some(),
            _dir: dir,
        }
    }

    /// One node in a directory of its own; its bus on a free port of its own too (the default,
    /// port + 10000, may not exist for a high ephemeral port).
    fn node(dir: &Scratch, port: u16, tls: Option<&TestCa>) -> OwnRedis {
        let node_dir = dir.0.join(port.to_string());
        std::fs::create_dir_all(&node_dir).unwrap();
        let mut args = match tls {
            Some(ca) => tls_only(port, ca),
            None => strings(&["--port", &port.to_string()]),
        };
        args.extend(strings(&[
            "--bind",
            "127.0.0.1",
            "--cluster-enabled",
            "yes",
        ]));
        args.extend(strings(&["--cluster-config-file", "nodes.conf"]));
        args.extend(strings(&["--cluster-port", &free_port().to_string()]));
        match tls {
            Some(ca) => {
                args.extend(strings(&["--tls-cluster", "yes"]));
                let mut node = OwnRedis::spawn(&node_dir, args, port, listens);
                node.tls_ca = Some(ca.ca.clone());
                node
            }
            None => OwnRedis::spawn(&node_dir, args, port, answers_ping),
        }
    }

    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}+cluster://{}", nodes.join(","))
    }

    /// The port of the master that holds `key`'s slot.
    pub fn owner(&self, key: &str) -> u16 {
        let slot: u16 = self.nodes[0]
            .cli(&["CLUSTER", "KEYSLOT", key])
            .parse()
            .unwrap();
        let owner = self.slot_owner_id(slot);
        self.nodes
            .iter()
            .find(|n| n.cli(&["CLUSTER", "MYID"]) == owner)
            .unwrap()
            .port
    }

    fn slot_owner_id(&self, slot: u16) -> String {
        let nodes = self.nodes[0].cli(&["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let owns = fields
                .iter()
                .skip(8)
                .any(|range| match range.split_once('-') {
                    Some((a, b)) => {
                        a.parse::<u16>().is_ok_and(|a| a <= slot)
                            && b.parse::<u16>().is_ok_and(|b| slot <= b)
                    }
                    None => range.parse::<u16>() == Ok(slot),
                });
            if owns {
                return fields[0].to_owned();
            }
        }
        panic!("no node owns slot {slot}:\n{nodes}");
    }

    /// How many keys matching `pattern` the master on `port` holds itself.
    pub fn keys_on(&self, port: u16, pattern: &str) -> usize {
        let node = self.nodes.iter().find(|n| n.port == port).unwrap();
        node.cli(&["--scan", "--pattern", pattern]).lines().count()
    }
}

/// A master, its replica and one Sentinel watching them under the name `cache`.
pub struct OwnSentinel {
    pub master: OwnRedis,
    pub replica: OwnRedis,
    pub sentinel: OwnRedis,
    _dir: Scratch,
}

impl OwnSentinel {
    pub fn start() -> OwnSentinel {
        let dir = Scratch::new("sentinel");
        let plain = |port: u16| strings(&["--port", &port.to_string(), "--bind", "127.0.0.1"]);
        let master_port = free_port();
        let master = OwnRedis::spawn(&dir.0, plain(master_port), master_port, answers_ping);
        let replica_port = free_port();
        let mut replica_args = plain(replica_port);
        replica_args.extend(strings(&[
            "--replicaof",
            "127.0.0.1",
            &master_port.to_string(),
        ]));
        let replica = OwnRedis::spawn(&dir.0, replica_args, replica_port, answers_ping);
        wait_for(Duration::from_secs(10), "the replica is in sync", || {
            replica
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up")
        });
        let sentinel_port = free_port();
        let conf = dir.file(
            "sentinel.conf",
            &format!(
                "port {sentinel_port}\nbind 127.0.0.1\nsentinel monitor cache 127.0.0.1 {master_port} 1\nsentinel down-after-milliseconds cache 1000\nsentinel failover-timeout cache 5000\n"
            ),
        );
        let args = vec![conf.display().to_string(), "--sentinel".to_owned()];
        let sentinel = OwnRedis::spawn(&dir.0, args, sentinel_port, answers_ping);
        wait_for(
            Duration::from_secs(15),
            "the sentinel knows the replica",
            || {
                sentinel
                    .cli(&["SENTINEL", "REPLICAS", "cache"])
                    .contains(&replica_port.to_string())
            },
        );
        OwnSentinel {
            master,
            replica,
            sentinel,
            _dir: dir,
        }
    }

    pub fn url(&self) -> String {
        format!("redis+sentinel://127.0.0.1:{}/cache", self.sentinel.port)
    }

    /// The port the sentinel names as master now.
    pub fn master_port(&self) -> u16 {
        let answer = self
            .sentinel
            .cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", "cache"]);
        answer
            .lines()
            .nth(1)
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(0)
    }
}
