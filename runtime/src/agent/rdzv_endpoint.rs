//! Where a c10d rendezvous is: its endpoint (`HOST[:PORT]`, torchrun's default port), whether
//! that endpoint names this machine (torchrun's `is_host` rule plus the interfaces'
//! addresses), and the address the served etcd listens on. Pure but for the name lookups and
//! `getifaddrs`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

/// torchrun's c10d port, for an endpoint without one.
pub const C10D_PORT_DEFAULT: u16 = 29400;
/// One name lookup (the endpoint's host, this machine's hostname).
const RESOLVE_TIMEOUT_MS: u64 = 5_000;
/// Interface addresses read at most.
const INTERFACE_ADDRS_MAX: usize = 4096;

/// A c10d rendezvous endpoint, `HOST[:PORT]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// A name or an address (IPv6 without brackets).
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    /// torchrun's c10d endpoint: one `HOST`, `HOST:PORT`, `[IPV6]` or `[IPV6]:PORT` (a bare
    /// IPv6 address too), optionally `http://`; the port defaults to [`C10D_PORT_DEFAULT`].
    /// The error says what is wrong, for a message naming the flag.
    pub fn parse(s: &str) -> std::result::Result<Endpoint, String> {
        let s = s.trim();
        let rest = match s.split_once("://") {
            None => s,
            Some(("http", rest)) => rest,
            Some(("https", _)) => {
                return Err(
                    "c10d serves plain http: for etcd with TLS, run an etcd cluster and \
                            use --rdzv-backend etcd-v3"
                        .into(),
                );
            }
            Some((scheme, _)) => return Err(format!("unknown scheme `{scheme}://`")),
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains(',') {
            return Err(
                "c10d takes one endpoint, HOST[:PORT], on the node that serves the \
                        rendezvous (a list of etcd endpoints is for --rdzv-backend etcd-v3)"
                    .into(),
            );
        }
        if rest.is_empty() {
            return Err("no host: use HOST[:PORT]".into());
        }
        let (host, port) = if let Some(r) = rest.strip_prefix('[') {
            let (h, after) = r
                .split_once(']')
                .ok_or_else(|| "an unclosed `[`: use [IPV6]:PORT".to_string())?;
            if h.parse::<Ipv6Addr>().is_err() {
                return Err(format!("`[{h}]` is not an IPv6 address"));
            }
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| format!("`{after}` after `]`: use [IPV6]:PORT"))?,
                ),
            };
            (h, port)
        } else if rest.parse::<Ipv6Addr>().is_ok() {
            (rest, None)
        } else {
            match rest.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (rest, None),
            }
        };
        let port = match port {
            None => C10D_PORT_DEFAULT,
            Some(p) => match p.parse::<u16>() {
                Ok(p) if p > 0 => p,
                _ => return Err(format!("port `{p}` is not a number in 1..=65535")),
            },
        };
        let name_ok = |h: &str| {
            !h.is_empty()
                && !h.starts_with('-')
                && h.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_')
        };
        if !(host.parse::<Ipv6Addr>().is_ok() || name_ok(host)) {
            return Err(format!(
                "host `{host}` is not a host name, an IPv4 or an IPv6 address"
            ));
        }
        Ok(Endpoint {
            host: host.to_string(),
            port,
        })
    }

    /// `HOST:PORT` (`[IPV6]:PORT`), as clients dial it.
    pub fn host_port(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// What this machine is known as: its hostname, and its addresses (its interfaces', and what
/// its hostname resolves to).
#[derive(Debug, Clone, Default)]
pub struct Machine {
    pub hostname: String,
    pub addrs: Vec<IpAddr>,
}

/// Whether `host` (which resolves to `resolved`) names this machine: `localhost` (and names
/// under `.localhost`), a loopback address, this machine's hostname, an address of this
/// machine, or a name resolving to one (or to a loopback address). torchrun's c10d decides its
/// `is_host` so (`_matches_machine_hostname`); the interfaces' addresses also catch names of
/// secondary interfaces, which torchrun misses.
pub fn names_this_machine(host: &str, resolved: &[IpAddr], machine: &Machine) -> bool {
    let host = host.trim_end_matches('.');
    if is_localhost_name(host) {
        return true;
    }
    let local = |ip: IpAddr| {
        let ip = unmapped(ip);
        ip.is_loopback() || machine.addrs.iter().any(|a| unmapped(*a) == ip)
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        return local(ip);
    }
    if !machine.hostname.is_empty() && host.eq_ignore_ascii_case(&machine.hostname) {
        return true;
    }
    resolved.iter().any(|ip| local(*ip))
}

/// The address the served etcd's clients listen on, for an endpoint `host` resolving to
/// `resolved`: an address as given; loopback for `localhost` (IPv4 when it resolves to an IPv4
/// address or to nothing, else `::1`); every interface for any other name, since peers on other
/// machines may resolve it to another address of this one (etcd listens dual-stack on
/// `0.0.0.0`).
pub fn listen_ip(host: &str, resolved: &[IpAddr]) -> IpAddr {
    let host = host.trim_end_matches('.');
    if let Ok(ip) = host.parse::<IpAddr>() {
        return ip;
    }
    if is_localhost_name(host) {
        let v6_only = !resolved.is_empty() && resolved.iter().all(IpAddr::is_ipv6);
        return if v6_only {
            Ipv6Addr::LOCALHOST.into()
        } else {
            Ipv4Addr::LOCALHOST.into()
        };
    }
    Ipv4Addr::UNSPECIFIED.into()
}

fn is_localhost_name(host: &str) -> bool {
    let h = host.to_ascii_lowercase();
    h == "localhost" || h.ends_with(".localhost")
}

/// An IPv4-mapped IPv6 address as the IPv4 address it maps.
fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

/// `http://IP:PORT`.
pub(super) fn url(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V6(v6) => format!("http://[{v6}]:{port}"),
        IpAddr::V4(v4) => format!("http://{v4}:{port}"),
    }
}

/// `host`'s addresses (none when it does not resolve in [`RESOLVE_TIMEOUT_MS`]).
pub(super) async fn resolve(host: &str) -> Vec<IpAddr> {
    if host.is_empty() {
        return Vec::new();
    }
    match tokio::time::timeout(
        Duration::from_millis(RESOLVE_TIMEOUT_MS),
        tokio::net::lookup_host((host, 0)),
    )
    .await
    {
        Ok(Ok(addrs)) => addrs.map(|a| a.ip()).take(INTERFACE_ADDRS_MAX).collect(),
        _ => Vec::new(),
    }
}

/// This machine's hostname and addresses.
pub(super) async fn this_machine() -> Machine {
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let mut addrs = interface_addrs();
    addrs.extend(resolve(&hostname).await);
    Machine { hostname, addrs }
}

/// The addresses of this machine's network interfaces.
pub(super) fn interface_addrs() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifap` with a list it owns until freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return out;
    }
    let mut p = ifap;
    while !p.is_null() && out.len() < INTERFACE_ADDRS_MAX {
        // SAFETY: `p` is a node of the list getifaddrs returned, not freed yet; `ifa_addr`,
        // when set, points to a sockaddr of the family it names.
        unsafe {
            let ifa = &*p;
            if !ifa.ifa_addr.is_null() {
                match i32::from((*ifa.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                        out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                            sin.sin_addr.s_addr,
                        ))));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                        out.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
            p = ifa.ifa_next;
        }
    }
    // SAFETY: the list from getifaddrs above, freed once.
    unsafe { libc::freeifaddrs(ifap) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn endpoints_parse_as_torchrun_reads_them_with_its_default_port() {
        let ep = |s: &str| Endpoint::parse(s).map(|e| (e.host, e.port));
        let ok = |h: &str, p: u16| Ok((h.to_string(), p));
        for (s, want) in [
            ("localhost:1234", ok("localhost", 1234)),
            ("node-0.svc", ok("node-0.svc", C10D_PORT_DEFAULT)),
            ("  10.0.0.7:29500 ", ok("10.0.0.7", 29500)),
            ("http://h_1:5", ok("h_1", 5)),
            ("http://h:5/", ok("h", 5)),
            ("[::1]:7", ok("::1", 7)),
            ("[fe80::1]", ok("fe80::1", C10D_PORT_DEFAULT)),
            ("::1", ok("::1", C10D_PORT_DEFAULT)),
        ] {
            assert_eq!(ep(s), want, "{s}");
        }
        for (s, needle) in [
            ("", "no host"),
            ("h:0", "port `0`"),
            ("h:65536", "port `65536`"),
            ("h:x", "port `x`"),
            (":5", "host ``"),
            ("a:1,b:2", "one endpoint"),
            ("https://h:1", "etcd-v3"),
            ("grpc://h:1", "grpc://"),
            ("[::1", "unclosed"),
            ("[nothost]:1", "not an IPv6"),
            ("[::1]x", "after `]`"),
            ("h/x:1", "host `h/x`"),
            ("-h:1", "host `-h`"),
        ] {
            let e = ep(s).unwrap_err();
            assert!(e.contains(needle), "{s:?}: {e}");
        }
        let e = Endpoint::parse("[::1]:7").unwrap();
        assert_eq!(e.host_port(), "[::1]:7");
        assert_eq!(Endpoint::parse("h").unwrap().host_port(), "h:29400");
    }

    fn machine() -> Machine {
        Machine {
            hostname: "trainer-0".into(),
            addrs: vec![ip("10.1.2.3"), ip("fd00::3"), ip("127.0.1.1")],
        }
    }

    #[test]
    fn the_endpoint_names_this_machine_as_torchrun_decides_is_host() {
        let m = machine();
        let yes = |host: &str, resolved: &[&str]| {
            let r: Vec<IpAddr> = resolved.iter().map(|s| ip(s)).collect();
            names_this_machine(host, &r, &m)
        };
        // Loopback names and addresses, whatever they resolve to.
        assert!(yes("localhost", &[]));
        assert!(yes("LOCALHOST.", &[]));
        assert!(yes("app.localhost", &[]));
        assert!(yes("127.0.0.1", &[]));
        assert!(yes("127.5.5.5", &[]));
        assert!(yes("::1", &[]));
        // This machine's hostname, its addresses, and names that resolve to them.
        assert!(yes("trainer-0", &[]));
        assert!(yes("Trainer-0", &["10.9.9.9"]));
        assert!(yes("10.1.2.3", &[]));
        assert!(yes("::ffff:10.1.2.3", &[]));
        assert!(yes("fd00::3", &[]));
        assert!(yes("trainer-0.job.svc", &["10.1.2.3"]));
        assert!(yes("alias", &["192.168.0.1", "fd00::3"]));
        assert!(yes("debian-style", &["127.0.1.1"]));
        // Others.
        assert!(!yes("trainer-1", &["10.1.2.4"]));
        assert!(!yes("trainer-1", &[]));
        assert!(!yes("10.1.2.4", &["10.1.2.3"]), "an address is itself");
        assert!(
            !yes("trainer", &[]),
            "a prefix of the hostname is another host"
        );
        assert!(!yes("fd00::4", &[]));
        let bare = Machine::default();
        assert!(!names_this_machine("", &[], &bare));
        assert!(!names_this_machine("h", &[ip("10.0.0.1")], &bare));
    }

    #[test]
    fn etcd_listens_where_peers_reach_the_endpoint() {
        let l = |host: &str, resolved: &[&str]| {
            let r: Vec<IpAddr> = resolved.iter().map(|s| ip(s)).collect();
            listen_ip(host, &r).to_string()
        };
        assert_eq!(l("localhost", &["127.0.0.1", "::1"]), "127.0.0.1");
        assert_eq!(l("localhost", &[]), "127.0.0.1");
        assert_eq!(l("localhost", &["::1"]), "::1");
        assert_eq!(l("10.1.2.3", &[]), "10.1.2.3");
        assert_eq!(l("::1", &[]), "::1");
        assert_eq!(l("trainer-0", &["127.0.1.1"]), "0.0.0.0");
        assert_eq!(l("trainer-0.job.svc", &["10.1.2.3"]), "0.0.0.0");
        assert_eq!(url(ip("::1"), 5), "http://[::1]:5");
        assert_eq!(url(ip("0.0.0.0"), 5), "http://0.0.0.0:5");
    }

    #[test]
    fn interface_addresses_include_loopback() {
        assert!(
            interface_addrs().iter().any(IpAddr::is_loopback),
            "{:?}",
            interface_addrs()
        );
    }
}
