//! A TCP fault proxy on loopback. Put one in front of etcd per node (partitions) and one in
//! front of the object store (outages, slowness, errors). Its [`Mode`] can change at any time:
//!
//! - `Up`: forwards bytes both ways.
//! - `Down`: cuts every open connection and closes new ones at once (a dead host; clients see
//!   connection resets and refusals at once).
//! - `Blackhole`: holds every connection open but moves no byte until the mode changes (a
//!   network partition: clients see nothing and must time out). Bytes in flight resume after.
//! - `Slow { delay_ms }`: forwards, but holds every chunk from the client for `delay_ms`.
//! - `Http503`: answers every HTTP request with `503 Slow Down` (S3's throttling answer) without
//!   forwarding it, and cuts open connections so that pooled ones meet the errors too.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};

/// Connections forwarded at once.
const CONNECTIONS_MAX: usize = 1024;
/// Bytes moved per read.
const CHUNK_BYTES: usize = 64 * 1024;
/// Largest HTTP request head read in `Http503` mode.
const HTTP_HEAD_BYTES_MAX: usize = 64 * 1024;
/// Largest request body drained (so the client reads the answer, not a reset) in `Http503`.
const HTTP_BODY_BYTES_MAX: u64 = 256 * 1024 * 1024;
/// How long an `Http503` exchange may take before the connection is dropped.
const HTTP_EXCHANGE_TIMEOUT_MS: u64 = 10_000;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Up,
    Down,
    Blackhole,
    Slow { delay_ms: u64 },
    Http503,
}

impl Mode {
    /// Whether open connections must be cut when this mode starts.
    fn cuts(self) -> bool {
        matches!(self, Mode::Down | Mode::Http503)
    }
}

/// A running proxy; dropping it stops it (open connections end with it).
pub struct Proxy {
    pub addr: SocketAddr,
    mode: Arc<watch::Sender<Mode>>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        Self::serve_on(listener, target)
    }

    /// Serves on `listener` (non-blocking; for example one opened inside a node's network
    /// namespace, see [`crate::netns`]) and forwards to `target` from this process's network.
    pub fn start_on(listener: std::net::TcpListener, target: SocketAddr) -> std::io::Result<Proxy> {
        Self::serve_on(TcpListener::from_std(listener)?, target)
    }

    fn serve_on(listener: TcpListener, target: SocketAddr) -> std::io::Result<Proxy> {
        let addr = listener.local_addr()?;
        let (mode, mode_rx) = watch::channel(Mode::Up);
        let task = tokio::spawn(serve(listener, target, mode_rx));
        Ok(Proxy {
            addr,
            mode: Arc::new(mode),
            task,
        })
    }

    pub fn set_mode(&self, mode: Mode) {
        let _ = self.mode.send(mode);
    }

    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }

    /// `false`: [`Mode::Down`]; `true`: [`Mode::Up`].
    pub fn set_up(&self, up: bool) {
        self.set_mode(if up { Mode::Up } else { Mode::Down });
    }

    /// A handle that can change the mode later, from another task.
    pub fn handle(&self) -> ModeHandle {
        ModeHandle(self.mode.clone())
    }

    /// Sets `mode` now and `Up` again after `duration`, from a spawned task.
    pub fn fault_for(&self, mode: Mode, duration: Duration) {
        self.set_mode(mode);
        let h = self.handle();
        tokio::spawn(async move {
            tokio::time::sleep(duration).await;
            h.set(Mode::Up);
        });
    }
}

/// Changes a proxy's mode from elsewhere; outlives nothing (a dropped proxy ignores it).
#[derive(Clone)]
pub struct ModeHandle(Arc<watch::Sender<Mode>>);

impl ModeHandle {
    pub fn set(&self, mode: Mode) {
        let _ = self.0.send(mode);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(listener: TcpListener, target: SocketAddr, mode: watch::Receiver<Mode>) {
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    // Connection tasks live in this set: aborting this task (dropping the `Proxy`) ends them.
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        while tasks.try_join_next().is_some() {}
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            drop(client);
            continue;
        };
        let mode = mode.clone();
        tasks.spawn(async move {
            let _permit = permit;
            connection(client, target, mode).await;
        });
    }
}

/// Waits until traffic may pass. `false` when the connection must be cut.
async fn passable(mode: &mut watch::Receiver<Mode>) -> bool {
    loop {
        let m = *mode.borrow_and_update();
        match m {
            Mode::Up | Mode::Slow { .. } => return true,
            Mode::Down | Mode::Http503 => return false,
            Mode::Blackhole => {
                if mode.changed().await.is_err() {
                    return false;
                }
            }
        }
    }
}

async fn connection(mut client: TcpStream, target: SocketAddr, mut mode: watch::Receiver<Mode>) {
    let now = *mode.borrow_and_update();
    match now {
        Mode::Down => return,
        Mode::Http503 => {
            let _ = tokio::time::timeout(
                Duration::from_millis(HTTP_EXCHANGE_TIMEOUT_MS),
                answer_503(&mut client),
            )
            .await;
            return;
        }
        _ => {}
    }
    // A new connection in a black hole waits, unanswered, like a SYN into a partition.
    if !passable(&mut mode).await {
        return;
    }
    let Ok(server) = TcpStream::connect(target).await else {
        return;
    };
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = pump(cr, sw, mode.clone(), true);
    let down = pump(sr, cw, mode.clone(), false);
    // Either direction ending (EOF, error or a cut) ends both.
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// Moves bytes from `r` to `w` under the proxy's mode. Returns when either side ends or the
/// mode cuts the connection.
async fn pump(
    mut r: impl AsyncRead + Unpin,
    mut w: impl AsyncWrite + Unpin,
    mut mode: watch::Receiver<Mode>,
    from_client: bool,
) {
    let mut buf = vec![0u8; CHUNK_BYTES];
    loop {
        if !passable(&mut mode).await {
            return;
        }
        let n = tokio::select! {
            r = r.read(&mut buf) => match r {
                Ok(n) => n,
                Err(_) => return,
            },
            changed = mode.changed() => {
                if changed.is_err() || mode.borrow().cuts() {
                    return;
                }
                continue;
            }
        };
        if n == 0 {
            let _ = w.shutdown().await;
            return;
        }
        // Data read just before a black hole opened is held until it closes.
        if !passable(&mut mode).await {
            return;
        }
        let now = *mode.borrow();
        if from_client && let Mode::Slow { delay_ms } = now {
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Reads one HTTP request (head, and a `Content-Length` body up to a bound) and answers it
/// with S3's `503 SlowDown`.
async fn answer_503(client: &mut TcpStream) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(4096);
    let mut buf = [0u8; 4096];
    let end = loop {
        let n = client.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(i) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if head.len() > HTTP_HEAD_BYTES_MAX {
            return Ok(());
        }
    };
    let text = String::from_utf8_lossy(&head[..end]).to_ascii_lowercase();
    let body_len: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
        .min(HTTP_BODY_BYTES_MAX);
    let mut left = body_len.saturating_sub((head.len() - end) as u64);
    while left > 0 {
        let want = (left as usize).min(buf.len());
        let n = client.read(&mut buf[..want]).await?;
        if n == 0 {
            break;
        }
        left -= n as u64;
    }
    let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
                <Message>Please reduce your request rate. (elastic-chaos)</Message></Error>";
    let resp = format!(
        "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    client.write_all(resp.as_bytes()).await?;
    client.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    async fn echo_server() -> SocketAddr {
        let echo = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let target = echo.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = echo.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        target
    }

    async fn roundtrip(c: &mut TcpStream, msg: &[u8; 2]) {
        c.write_all(msg).await.unwrap();
        let mut buf = [0u8; 2];
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, msg);
    }

    #[tokio::test]
    async fn down_cuts_open_connections_and_refuses_new_ones_until_up() {
        let p = Proxy::start(echo_server().await).await.unwrap();
        let mut c = TcpStream::connect(p.addr).await.unwrap();
        roundtrip(&mut c, b"hi").await;
        p.set_up(false);
        // The open connection is cut...
        let mut rest = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut rest))
            .await
            .unwrap()
            .unwrap_or(0);
        assert_eq!(n, 0);
        // ...and a new one is closed at once.
        let mut c2 = TcpStream::connect(p.addr).await.unwrap();
        let _ = c2.write_all(b"x").await;
        let mut buf = [0u8; 2];
        let n = c2.read(&mut buf).await.unwrap_or(0);
        assert_eq!(n, 0);
        p.set_up(true);
        let mut c3 = TcpStream::connect(p.addr).await.unwrap();
        roundtrip(&mut c3, b"ok").await;
    }

    #[tokio::test]
    async fn blackhole_holds_bytes_silently_then_delivers_them() {
        let p = Proxy::start(echo_server().await).await.unwrap();
        let mut c = TcpStream::connect(p.addr).await.unwrap();
        roundtrip(&mut c, b"hi").await;
        p.set_mode(Mode::Blackhole);
        c.write_all(b"zz").await.unwrap();
        let mut buf = [0u8; 2];
        let silent = tokio::time::timeout(Duration::from_millis(300), c.read_exact(&mut buf)).await;
        assert!(silent.is_err(), "a black hole answered");
        p.set_mode(Mode::Up);
        tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf, b"zz");
    }

    #[tokio::test]
    async fn slow_delays_every_request() {
        let p = Proxy::start(echo_server().await).await.unwrap();
        p.set_mode(Mode::Slow { delay_ms: 200 });
        let mut c = TcpStream::connect(p.addr).await.unwrap();
        let t = Instant::now();
        roundtrip(&mut c, b"s1").await;
        roundtrip(&mut c, b"s2").await;
        assert!(
            t.elapsed() >= Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );
    }

    #[tokio::test]
    async fn http503_answers_slow_down_and_drains_the_body() {
        let p = Proxy::start(echo_server().await).await.unwrap();
        p.set_mode(Mode::Http503);
        let mut c = TcpStream::connect(p.addr).await.unwrap();
        c.write_all(b"PUT /b/k HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
            .await
            .unwrap();
        let mut resp = String::new();
        tokio::time::timeout(Duration::from_secs(5), c.read_to_string(&mut resp))
            .await
            .unwrap()
            .unwrap();
        assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
        assert!(resp.contains("SlowDown"));
        p.fault_for(Mode::Http503, Duration::from_millis(100));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(p.mode(), Mode::Up);
        let mut c = TcpStream::connect(p.addr).await.unwrap();
        roundtrip(&mut c, b"ok").await;
    }
}
