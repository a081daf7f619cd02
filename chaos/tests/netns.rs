//! Network namespaces as the harness builds them: each node reaches the others at their
//! addresses and nothing of the host's loopback; a link taken down drops the node's packets
//! (connections time out, they are not refused) until it comes back; nothing is left behind.
//! Needs root (CI runs as root); without it the test fails and says why.

use std::net::{Ipv4Addr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

use chaos::netns::{Network, node_addr};

/// Tries to open a TCP connection from inside node `from`'s namespace, bounded by `timeout_s`.
/// `Ok(())` connected; `Err(true)` timed out; `Err(false)` refused or unreachable at once.
fn connect_from(
    net: &Network,
    from: usize,
    ip: Ipv4Addr,
    port: u16,
    timeout_s: u32,
) -> Result<(), bool> {
    let mut c = Command::new("timeout");
    c.args([
        &timeout_s.to_string(),
        "bash",
        "-c",
        &format!("exec 3<>/dev/tcp/{ip}/{port}"),
    ]);
    net.get(from).expect("node exists").enter_on_spawn(&mut c);
    let status = c
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run bash");
    match status.code() {
        Some(0) => Ok(()),
        Some(124) => Err(true),
        _ => Err(false),
    }
}

#[test]
fn nodes_reach_each_other_not_the_host_and_a_cut_link_drops_packets() {
    let mut net = Network::create()
        .unwrap_or_else(|e| panic!("network namespaces cannot be made here (run as root): {e:#}"));
    let a = net.node(0).unwrap();
    assert_eq!(a.addr, node_addr(0));
    let a_name = a.name.clone();
    let on_a = a.listen(node_addr(0)).unwrap();
    let a_port = on_a.local_addr().unwrap().port();
    let a_loopback = a.listen_loopback().unwrap();
    let a_lo_port = a_loopback.local_addr().unwrap().port();
    net.node(1).unwrap();
    let host = TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let host_port = host.local_addr().unwrap().port();

    // Node 1 reaches node 0's address over the bridge...
    assert_eq!(connect_from(&net, 1, node_addr(0), a_port, 5), Ok(()));
    // ...but not the host's loopback, nor node 0's loopback: 127.0.0.1 is its own.
    assert_eq!(
        connect_from(&net, 1, Ipv4Addr::LOCALHOST, host_port, 5),
        Err(false)
    );
    assert_eq!(
        connect_from(&net, 1, Ipv4Addr::LOCALHOST, a_lo_port, 5),
        Err(false)
    );
    // Node 0 reaches its own loopback socket (where the harness serves its etcd proxy).
    assert_eq!(
        connect_from(&net, 0, Ipv4Addr::LOCALHOST, a_lo_port, 5),
        Ok(())
    );

    // A cut link: packets vanish, so the connection attempt hangs until the timeout.
    net.set_link(0, false).unwrap();
    let t = Instant::now();
    assert_eq!(connect_from(&net, 1, node_addr(0), a_port, 2), Err(true));
    assert!(t.elapsed() >= Duration::from_secs(2), "{:?}", t.elapsed());
    net.set_link(0, true).unwrap();
    assert_eq!(connect_from(&net, 1, node_addr(0), a_port, 5), Ok(()));

    drop((on_a, a_loopback));
    drop(net);
    assert!(
        !std::path::Path::new(&format!("/run/netns/{a_name}")).exists(),
        "{a_name} was not deleted"
    );
}
