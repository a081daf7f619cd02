//! A minimal HTTP/1.1 client over loopback TCP, for readiness checks and service set-up calls.
//! Requests are one-shot (`Connection: close`) and bounded in time and size.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

const IO_TIMEOUT_MS: u64 = 5_000;
const RESPONSE_BYTES_MAX: usize = 16 << 20;

/// `GET path` on `127.0.0.1:port`: the status and the body as text.
pub fn get(port: u16, path: &str) -> Result<(u16, String)> {
    request(port, "GET", path, &[], b"")
}

/// One request on `127.0.0.1:port`; returns the status code and the body as (lossy) text.
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> Result<(u16, String)> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let timeout = Duration::from_millis(IO_TIMEOUT_MS);
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut resp = Vec::new();
    stream
        .take(RESPONSE_BYTES_MAX as u64)
        .read_to_end(&mut resp)
        .with_context(|| format!("reading the answer to {method} {path} from {addr}"))?;
    let text = String::from_utf8_lossy(&resp);
    let status_line = text.lines().next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{addr} answered {method} {path} with {status_line:?}"))?;
    let body = match text.find("\r\n\r\n") {
        Some(i) => text[i + 4..].to_string(),
        None => String::new(),
    };
    Ok((status, body))
}

/// Headers for an Azure Blob request signed with a Shared Key, for a request with no body.
/// `resource_path` is the request path without query (`/account/container`), `query` its
/// parameters.
pub fn azure_shared_key_headers(
    method: &str,
    account: &str,
    key_b64: &str,
    resource_path: &str,
    query: &[(&str, &str)],
) -> Result<Vec<(String, String)>> {
    let date = httpdate::fmt_http_date(SystemTime::now());
    let version = "2021-08-06";
    let canonical_headers = format!("x-ms-date:{date}\nx-ms-version:{version}\n");
    let mut canonical_resource = format!("/{account}{resource_path}");
    let mut q: Vec<_> = query.to_vec();
    q.sort();
    for (k, v) in q {
        canonical_resource.push_str(&format!("\n{}:{v}", k.to_ascii_lowercase()));
    }
    // VERB, then 11 standard headers (all empty here: no body, no conditions), then the rest.
    let string_to_sign =
        format!("{method}\n\n\n\n\n\n\n\n\n\n\n\n{canonical_headers}{canonical_resource}");
    let key = base64::engine::general_purpose::STANDARD
        .decode(key_b64)
        .context("decoding the Azure account key")?;
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).context("building the HMAC")?;
    mac.update(string_to_sign.as_bytes());
    let sig = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    if sig.is_empty() {
        bail!("empty signature");
    }
    Ok(vec![
        ("x-ms-date".into(), date),
        ("x-ms-version".into(), version.into()),
        ("authorization".into(), format!("SharedKey {account}:{sig}")),
    ])
}

/// Percent-encodes everything but unreserved characters (RFC 3986).
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
