//! The tiny HTTP/1.1 server behind every metadata service: one accept thread, a thread per
//! connection, bounded in connections, request size and wait time; one request per
//! connection (`Connection: close`).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result};

/// Connections served at once; more get 503.
const CONNECTIONS_MAX: usize = 64;
/// Longest request head read.
const HEAD_BYTES_MAX: usize = 16 * 1024;
/// Longest request body read.
const BODY_BYTES_MAX: usize = 64 * 1024;
/// Socket read and write timeout per connection.
const IO_TIMEOUT_MS: u64 = 5_000;

/// One parsed request.
#[derive(Debug)]
pub(super) struct Request {
    pub(super) method: String,
    pub(super) path: String,
    pub(super) query: Vec<(String, String)>,
    /// Names lowercased.
    pub(super) headers: Vec<(String, String)>,
    pub(super) body: Vec<u8>,
}

impl Request {
    pub(super) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub(super) fn query(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One answer.
pub(super) struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: String,
}

impl Reply {
    pub(super) fn new(status: u16, body: impl Into<String>) -> Self {
        Reply {
            status,
            headers: vec![],
            body: body.into(),
        }
    }

    pub(super) fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }
}

/// The reason phrase of a status.
pub(super) fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Other",
    }
}

/// What a server answers each request with.
pub(super) type Handler = dyn Fn(&Request) -> Reply + Send + Sync;

/// The accept thread and its stop switch.
pub(super) struct Server {
    port: u16,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl Server {
    pub(super) fn start(handler: Arc<Handler>) -> Result<Server> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .context("binding a loopback port for a metadata server")?;
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let live = Arc::new(AtomicUsize::new(0));
        let stop2 = stop.clone();
        let accept = std::thread::Builder::new()
            .name(format!("metadata-{port}"))
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(stream) = conn else {
                        // Out of descriptors, say: do not spin.
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    };
                    let handler = handler.clone();
                    let live = live.clone();
                    if live.fetch_add(1, Ordering::SeqCst) >= CONNECTIONS_MAX {
                        live.fetch_sub(1, Ordering::SeqCst);
                        let _ = write_reply(stream, Reply::new(503, "too many connections"));
                        continue;
                    }
                    std::thread::spawn(move || {
                        serve_one(stream, &*handler);
                        live.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            })
            .context("spawning a metadata server thread")?;
        Ok(Server {
            port,
            stop,
            accept: Some(accept),
        })
    }

    pub(super) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect_timeout(
            &SocketAddr::from((Ipv4Addr::LOCALHOST, self.port)),
            Duration::from_millis(IO_TIMEOUT_MS),
        );
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn serve_one(mut stream: TcpStream, handler: &Handler) {
    let timeout = Some(Duration::from_millis(IO_TIMEOUT_MS));
    if stream.set_read_timeout(timeout).is_err() || stream.set_write_timeout(timeout).is_err() {
        return;
    }
    let reply = match read_request(&mut stream) {
        Some(req) => handler(&req),
        None => Reply::new(400, "malformed request"),
    };
    let _ = write_reply(stream, reply);
}

fn read_request(stream: &mut TcpStream) -> Option<Request> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() > HEAD_BYTES_MAX {
            return None;
        }
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).ok()?;
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let method = first.next()?.to_string();
    let target = first.next()?;
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, q),
        None => (target, ""),
    };
    let query = query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (kv.to_string(), String::new()),
        })
        .collect();
    let mut headers = Vec::new();
    for line in lines {
        let (k, v) = line.split_once(':')?;
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .map(|(_, v)| v.parse().ok())
        .unwrap_or(Some(0))?;
    if len > BODY_BYTES_MAX {
        return None;
    }
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(len);
    Some(Request {
        method,
        path: path.to_string(),
        query,
        headers,
        body,
    })
}

fn write_reply(mut stream: TcpStream, reply: Reply) -> std::io::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        reply.status,
        reason(reply.status),
        reply.body.len()
    );
    for (k, v) in &reply.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(&reply.body);
    stream.write_all(out.as_bytes())?;
    stream.flush()
}

/// Locks `m`, also when a handler thread panicked while holding it.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
pub(super) mod testing {
    /// The port of a `http://127.0.0.1:PORT` URL.
    pub fn port(url: &str) -> u16 {
        url.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// A request header.
    pub fn h(k: &str, v: &str) -> (String, String) {
        (k.to_string(), v.to_string())
    }
}
