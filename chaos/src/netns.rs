//! Network namespaces for simulated nodes: every node gets a network of its own, with a real
//! address on a private bridge, so that a partition cuts it off from its peers' collectives
//! (gloo, the workers' TCPStore), not only from etcd.
//!
//! ```text
//!   hub namespace:  br0 ── n0 ─┐      ┌─ n1 ── ...      (the bridge, one veth end per node)
//!                              │      │
//!   node0 namespace:      eth0 10.77.0.1/24        node1: eth0 10.77.0.2/24, lo, ...
//! ```
//!
//! The bridge lives in a namespace of its own, so the host's network is never touched and runs
//! may overlap (each has its own hub; the subnet repeats). Services stay on the host's loopback:
//! the harness opens the listening sockets a node needs (its etcd proxy, its store forwarder, its
//! preemption-notice server) inside the node's namespace and forwards from there. A partition
//! takes the node's veth down at the hub, which drops its packets both ways, like a cut cable.
//!
//! Needs `ip` (iproute2) and the right to create namespaces (root, or `CAP_SYS_ADMIN`).

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result, bail};

/// The node's interface inside its namespace (for `GLOO_SOCKET_IFNAME`).
pub const NODE_IF: &str = "eth0";
/// Prefix of every namespace this module creates (`/run/netns/erchaos-PID-SEQ-...`).
const PREFIX: &str = "erchaos";
/// The first three octets of the node subnet, a /24 that exists only inside the hub.
const SUBNET: [u8; 3] = [10, 77, 0];
/// Node addresses are `.1` to `.NODES_MAX` of the subnet.
pub const NODES_MAX: usize = 250;
/// How long one `ip` command may take.
const IP_TIMEOUT_MS: u64 = 10_000;

static SEQ: AtomicU32 = AtomicU32::new(0);

/// One run's namespaces; dropping it deletes them (the kernel frees a namespace once its last
/// process is gone).
pub struct Network {
    tag: String,
    hub: String,
    nodes: Vec<Option<NodeNs>>,
}

/// A node's namespace.
pub struct NodeNs {
    pub name: String,
    pub addr: Ipv4Addr,
    /// The veth end in the hub (taken down for a partition).
    hub_link: String,
    /// `/run/netns/NAME`, open for `setns`.
    file: std::fs::File,
}

impl Network {
    /// Creates the hub namespace with its bridge. Namespaces left by a harness that died are
    /// deleted first.
    pub fn create() -> Result<Network> {
        sweep_stale();
        let tag = format!(
            "{PREFIX}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        );
        let hub = format!("{tag}-hub");
        ip(&["netns", "add", &hub]).context(
            "create a network namespace (scenarios with network = \"netns\" need root or \
             CAP_SYS_ADMIN, and iproute2)",
        )?;
        // From here on, drop deletes what exists.
        let net = Network {
            tag,
            hub,
            nodes: Vec::new(),
        };
        ip(&["-n", &net.hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &net.hub, "link", "set", "br0", "up"])?;
        Ok(net)
    }

    /// The namespace of node `index`, created (with its veth on the bridge, its address and
    /// its loopback up) the first time.
    pub fn node(&mut self, index: usize) -> Result<&NodeNs> {
        if index >= NODES_MAX {
            bail!("node {index}: at most {NODES_MAX} nodes have addresses");
        }
        if self.nodes.len() <= index {
            self.nodes.resize_with(index + 1, || None);
        }
        if self.nodes[index].is_none() {
            let ns = self.create_node(index)?;
            self.nodes[index] = Some(ns);
        }
        Ok(self.nodes[index].as_ref().expect("just created"))
    }

    fn create_node(&self, index: usize) -> Result<NodeNs> {
        let name = format!("{}-n{index}", self.tag);
        let hub_link = format!("n{index}");
        let addr = node_addr(index);
        ip(&["netns", "add", &name])?;
        let made = (|| -> Result<std::fs::File> {
            ip(&[
                "-n", &self.hub, "link", "add", &hub_link, "type", "veth", "peer", "name", NODE_IF,
                "netns", &name,
            ])?;
            ip(&["-n", &self.hub, "link", "set", &hub_link, "master", "br0"])?;
            ip(&["-n", &self.hub, "link", "set", &hub_link, "up"])?;
            ip(&[
                "-n",
                &name,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                NODE_IF,
            ])?;
            ip(&["-n", &name, "link", "set", NODE_IF, "up"])?;
            ip(&["-n", &name, "link", "set", "lo", "up"])?;
            let path = format!("/run/netns/{name}");
            std::fs::File::open(&path).with_context(|| format!("open {path}"))
        })();
        match made {
            Ok(file) => Ok(NodeNs {
                name,
                addr,
                hub_link,
                file,
            }),
            Err(e) => {
                let _ = ip(&["netns", "del", &name]);
                Err(e.context(format!("set up the namespace of node {index}")))
            }
        }
    }

    /// Node `index`'s namespace, if it was created.
    pub fn get(&self, index: usize) -> Option<&NodeNs> {
        self.nodes.get(index).and_then(Option::as_ref)
    }

    /// Connects (`up`) or cuts node `index` from the bridge.
    pub fn set_link(&self, index: usize, up: bool) -> Result<()> {
        let Some(n) = self.get(index) else {
            bail!("node {index} has no namespace");
        };
        link_command(&self.hub, &n.hub_link, up)
    }

    /// What [`set_link`](Self::set_link) needs, to run later without the network at hand.
    pub fn link_switch(&self, index: usize) -> Option<LinkSwitch> {
        self.get(index).map(|n| LinkSwitch {
            hub: self.hub.clone(),
            link: n.hub_link.clone(),
        })
    }
}

/// Takes one node's link up or down later (from a spawned task).
#[derive(Debug, Clone)]
pub struct LinkSwitch {
    hub: String,
    link: String,
}

impl LinkSwitch {
    pub fn set(&self, up: bool) -> Result<()> {
        link_command(&self.hub, &self.link, up)
    }
}

fn link_command(hub: &str, link: &str, up: bool) -> Result<()> {
    ip(&[
        "-n",
        hub,
        "link",
        "set",
        link,
        if up { "up" } else { "down" },
    ])
}

impl Drop for Network {
    fn drop(&mut self) {
        for n in self.nodes.iter().flatten() {
            let _ = ip(&["netns", "del", &n.name]);
        }
        let _ = ip(&["netns", "del", &self.hub]);
    }
}

impl NodeNs {
    /// A listening TCP socket on the node's own loopback (`127.0.0.1`, a free port): what
    /// processes in the namespace reach as `127.0.0.1:PORT`, served by the harness.
    pub fn listen_loopback(&self) -> io::Result<std::net::TcpListener> {
        self.listen(Ipv4Addr::LOCALHOST)
    }

    /// A listening TCP socket on `ip` (a free port) inside the namespace; non-blocking.
    pub fn listen(&self, ip: Ipv4Addr) -> io::Result<std::net::TcpListener> {
        in_namespace(self.file.as_raw_fd(), || {
            let l = std::net::TcpListener::bind((ip, 0))?;
            l.set_nonblocking(true)?;
            Ok(l)
        })?
    }

    /// Makes `cmd` start inside this namespace. The namespace's file must stay open until the
    /// command is spawned (it does: it lives with the [`Network`]).
    pub fn enter_on_spawn(&self, cmd: &mut Command) {
        let fd = self.file.as_raw_fd();
        // SAFETY: setns is async-signal-safe; the closure touches nothing but `fd`.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

/// The address of node `index`: `10.77.0.(index + 1)`.
pub fn node_addr(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], (index + 1) as u8)
}

/// Runs `f` on a thread of its own that first enters the namespace `fd` (a network namespace
/// is a property of the thread; sockets stay in the namespace they were made in).
fn in_namespace<T: Send>(fd: RawFd, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns on this thread only; fd is an open namespace file.
            if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(f())
        })
        .join()
        .map_err(|_| io::Error::other("namespace thread panicked"))?
    })
}

/// Whether namespaces can be made here: `Err` says why not.
pub fn available() -> Result<()> {
    Network::create().map(drop)
}

/// Runs `ip ARGS`, bounded by [`IP_TIMEOUT_MS`]; an error carries its stderr.
fn ip(args: &[&str]) -> Result<()> {
    let mut child = Command::new("ip")
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("run `ip` (iproute2)")?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(IP_TIMEOUT_MS);
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("`ip {}` took over {IP_TIMEOUT_MS} ms", args.join(" "));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    if !status.success() {
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = io::Read::read_to_string(&mut e, &mut err);
        }
        bail!("`ip {}` failed ({status}): {}", args.join(" "), err.trim());
    }
    Ok(())
}

/// Deletes `erchaos-PID-...` namespaces whose harness process is gone.
fn sweep_stale() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|r| r.strip_prefix('-'))
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!(namespace = %name, "deleting a namespace a dead harness left");
            let _ = ip(&["netns", "del", &name]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_addresses_are_distinct_and_in_the_subnet() {
        assert_eq!(node_addr(0), Ipv4Addr::new(10, 77, 0, 1));
        assert_eq!(node_addr(NODES_MAX - 1), Ipv4Addr::new(10, 77, 0, 250));
    }
}
