//! Object-store side of the root benchmark suite (`bench/run.sh`): the raw `object_store`
//! baselines, and resharded restore with a count of the bytes it read. One measurement per
//! invocation, one JSON object on stdout; `bench/suite.py` alternates, repeats and takes medians.
//!
//!     bench_store raw-put URL FILE... [--chunk-mib 32] [--concurrency 4]
//!         Uploads FILEs cut into chunks (one object per chunk, like a checkpoint save) and, on
//!         file://, fsyncs each object and its directory: the same durability a save gives.
//!     bench_store raw-get URL [--stream] [--concurrency 8]
//!         Reads every object under URL (whole objects, several at a time), each into one
//!         buffer (`GetResult::bytes`); with `--stream`, counting its body's pieces as they
//!         arrive and keeping none: the least a GET can cost.
//!     bench_store restore URL DEST --rank R --world W [--step N] [--concurrency 8]
//!         `Store::restore` of the newest committed step (or N) for rank R of W into DEST, with
//!         the bytes it read and the requests that read them (`Store::read_stats`: every GET
//!         and local read of an object, manifests included; HEADs; listings), and the peak
//!         resident size it rose to over the start (`VmHWM` after it, over `VmRSS` before).
//!     bench_store agent-restore URL ROOT --step N --rank R --world W [--no-copy] [--concurrency 8]
//!         The agent's own restore (`runtime::pipeline::StoreSink::restore`, as `elastic-run`
//!         restores a resume step) of rank R of W into `ROOT/step-N/rank-R/`; with `--no-copy`,
//!         as `elastic-run --restore-no-copy` does it (`sources.json` in place of the state file,
//!         where the store allows it).
//!
//! URLs: `file:///abs/dir` or `s3://bucket/prefix` (S3 settings from `AWS_*`, as the agent reads
//! them). Defaults match the agent's: 32 MiB chunks, 4 uploads and 8 reads in flight.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjPath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt, PutPayload};

const CHUNK_MIB_DEFAULT: usize = 32;
const PUT_CONCURRENCY_DEFAULT: usize = 4;
const GET_CONCURRENCY_DEFAULT: usize = 8;
/// Largest number of objects `raw-get` reads (a checkpoint of a few GiB has a few hundred).
const OBJECTS_MAX: usize = 100_000;

/// An `object_store` backend, the key prefix inside it and, for `file://`, its root directory.
fn open(url: &str) -> Result<(Arc<dyn ObjectStore>, String, Option<PathBuf>)> {
    if let Some(path) = url.strip_prefix("file://") {
        let dir = PathBuf::from(path);
        if !dir.is_absolute() {
            bail!("{url}: not an absolute path");
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let fs = object_store::local::LocalFileSystem::new_with_prefix(&dir)?;
        Ok((Arc::new(fs), String::new(), Some(dir)))
    } else if let Some(rest) = url.strip_prefix("s3://") {
        let s = object_store::aws::AmazonS3Builder::from_env()
            .with_url(url)
            .build()?;
        let prefix = rest.split_once('/').map_or("", |(_, p)| p);
        Ok((Arc::new(s), prefix.trim_matches('/').to_string(), None))
    } else {
        bail!("unsupported URL {url:?} (file:///abs/dir or s3://bucket/prefix)")
    }
}

fn key(prefix: &str, rel: &str) -> ObjPath {
    if prefix.is_empty() {
        ObjPath::from(rel)
    } else {
        ObjPath::from(format!("{prefix}/{rel}"))
    }
}

fn fsync(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(path)?.sync_all()
}

async fn raw_put(
    url: &str,
    files: &[PathBuf],
    chunk_bytes: u64,
    concurrency: usize,
) -> Result<serde_json::Value> {
    let (store, prefix, root) = open(url)?;
    let mut jobs = Vec::new();
    for (fi, f) in files.iter().enumerate() {
        let len = std::fs::metadata(f)
            .with_context(|| format!("{}", f.display()))?
            .len();
        for (ci, start) in (0..len).step_by(chunk_bytes as usize).enumerate() {
            jobs.push((fi, ci, f.clone(), start, (len - start).min(chunk_bytes)));
        }
    }
    let total: u64 = jobs.iter().map(|j| j.4).sum();
    let objects = jobs.len();
    let run = format!("raw-{}", std::process::id());
    let t = Instant::now();
    futures::stream::iter(jobs)
        .map(|(fi, ci, f, start, len)| {
            let (store, root) = (store.clone(), root.clone());
            let k = key(&prefix, &format!("{run}/{fi}/{ci}.bin"));
            async move {
                // Read the chunk like a save does: off the staged file, on a blocking thread.
                let data = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u8>> {
                    use std::os::unix::fs::FileExt;
                    let mut buf = vec![0u8; len as usize];
                    std::fs::File::open(f)?.read_exact_at(&mut buf, start)?;
                    Ok(buf)
                })
                .await??;
                store.put(&k, PutPayload::from(data)).await?;
                if let Some(root) = root {
                    // S3 is durable when the PUT returns; a local file needs its fsyncs.
                    let p = root.join(k.as_ref());
                    tokio::task::spawn_blocking(move || -> std::io::Result<()> {
                        fsync(&p)?;
                        fsync(p.parent().expect("object has a directory"))
                    })
                    .await??;
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(concurrency.max(1))
        .try_collect::<Vec<_>>()
        .await?;
    let secs = t.elapsed().as_secs_f64();
    Ok(
        serde_json::json!({"op": "raw-put", "seconds": secs, "bytes": total, "objects": objects, "prefix": run}),
    )
}

async fn raw_get(url: &str, stream: bool, concurrency: usize) -> Result<serde_json::Value> {
    let (store, prefix, _) = open(url)?;
    let p = (!prefix.is_empty()).then(|| ObjPath::from(prefix.as_str()));
    let t = Instant::now();
    let metas: Vec<ObjectMeta> = store
        .list(p.as_ref())
        .take(OBJECTS_MAX)
        .try_collect()
        .await?;
    let objects = metas.len();
    let sizes: Vec<u64> = futures::stream::iter(metas)
        .map(|m| {
            let store = store.clone();
            async move {
                let r = store.get(&m.location).await?;
                if !stream {
                    return anyhow::Ok(r.bytes().await?.len() as u64);
                }
                let mut body = r.into_stream();
                let mut n = 0u64;
                while let Some(piece) = body.next().await {
                    n += piece?.len() as u64;
                }
                Ok(n)
            }
        })
        .buffer_unordered(concurrency.max(1))
        .try_collect()
        .await?;
    let secs = t.elapsed().as_secs_f64();
    Ok(
        serde_json::json!({"op": "raw-get", "stream": stream, "seconds": secs, "bytes": sizes.iter().sum::<u64>(), "objects": objects}),
    )
}

/// A `kB` field of `/proc/self/status` (`VmRSS`: resident now; `VmHWM`: the peak so far), in
/// bytes; 0 where it cannot be read.
fn proc_status_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

async fn restore(
    url: &str,
    dest: &Path,
    step: Option<u64>,
    rank: u32,
    world: u32,
    concurrency: usize,
) -> Result<serde_json::Value> {
    let store = checkpoint::Store::open(url)?;
    let cancel = checkpoint::CancellationToken::new();
    let opts = checkpoint::ReadOptions {
        concurrency: concurrency.max(1),
        progress: None,
        ..Default::default()
    };
    let _ = std::fs::remove_dir_all(dest);
    // The restore's memory: the peak resident size after it, over the resident size before.
    let rss_start = proc_status_bytes("VmRSS");
    let t = Instant::now();
    let report = store
        .restore(step, rank, world, dest, &opts, &cancel)
        .await?;
    let secs = t.elapsed().as_secs_f64();
    let rss_peak = proc_status_bytes("VmHWM");
    let read = store.read_stats();
    // Outside the timed part: the step's sizes, for "read vs stored vs needed".
    let m = store.read_manifest(report.step, &cancel).await?;
    Ok(serde_json::json!({
        "op": "restore", "seconds": secs, "step": report.step, "rank": rank, "world": world,
        "saved_world": m.world_size, "tensors": report.tensors,
        "bytes_needed": report.bytes, "bytes_read": read.bytes, "gets": read.gets, "heads": read.heads, "lists": read.lists,
        "step_stored_bytes": m.stored_bytes(), "step_raw_bytes": m.raw_bytes(),
        "rss_start_bytes": rss_start, "rss_peak_bytes": rss_peak,
        "rss_rise_bytes": rss_peak.saturating_sub(rss_start), "concurrency": opts.concurrency,
    }))
}

async fn agent_restore(
    url: &str,
    root: &Path,
    step: u64,
    rank: u32,
    world: u32,
    no_copy: bool,
    concurrency: usize,
) -> Result<serde_json::Value> {
    let opts = runtime::pipeline::SinkOptions {
        read: checkpoint::ReadOptions {
            concurrency: concurrency.max(1),
            no_copy,
            ..Default::default()
        },
        ..Default::default()
    };
    let _ = std::fs::remove_dir_all(root);
    let sink = runtime::pipeline::StoreSink::open(url, root.to_path_buf(), opts)?;
    let cancel = checkpoint::CancellationToken::new();
    let t = Instant::now();
    let point = sink.restore(step, rank..rank + 1, world, &cancel).await?;
    let secs = t.elapsed().as_secs_f64();
    let mine = point.dir.join(format!("rank-{rank}"));
    Ok(serde_json::json!({
        "op": "agent-restore", "seconds": secs, "step": point.step, "rank": rank, "world": world,
        "dir": point.dir, "bytes_from_store": point.bytes_from_store,
        "copied": mine.join(checkpoint::restore::RESTORE_FILE).is_file(),
    }))
}

fn flag<T: std::str::FromStr>(args: &mut Vec<String>, name: &str) -> Result<Option<T>> {
    let Some(i) = args.iter().position(|a| a == name) else {
        return Ok(None);
    };
    if i + 1 >= args.len() {
        bail!("{name} needs a value");
    }
    let v = args.remove(i + 1);
    args.remove(i);
    v.parse()
        .map(Some)
        .map_err(|_| anyhow::anyhow!("{name}: bad value {v:?}"))
}

#[tokio::main]
async fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let chunk_mib: usize = flag(&mut args, "--chunk-mib")?.unwrap_or(CHUNK_MIB_DEFAULT);
    let concurrency: Option<usize> = flag(&mut args, "--concurrency")?;
    let rank: Option<u32> = flag(&mut args, "--rank")?;
    let world: Option<u32> = flag(&mut args, "--world")?;
    let step: Option<u64> = flag(&mut args, "--step")?;
    let no_copy = args
        .iter()
        .position(|a| a == "--no-copy")
        .map(|i| args.remove(i));
    let stream = args
        .iter()
        .position(|a| a == "--stream")
        .map(|i| args.remove(i));
    let out = match args.first().map(String::as_str) {
        Some("raw-put") if args.len() >= 3 => {
            let files: Vec<PathBuf> = args[2..].iter().map(PathBuf::from).collect();
            raw_put(
                &args[1],
                &files,
                (chunk_mib.max(1) * 1024 * 1024) as u64,
                concurrency.unwrap_or(PUT_CONCURRENCY_DEFAULT),
            )
            .await?
        }
        Some("raw-get") if args.len() == 2 => {
            raw_get(
                &args[1],
                stream.is_some(),
                concurrency.unwrap_or(GET_CONCURRENCY_DEFAULT),
            )
            .await?
        }
        Some("restore") if args.len() == 3 => {
            restore(
                &args[1],
                Path::new(&args[2]),
                step,
                rank.unwrap_or(0),
                world.unwrap_or(1),
                concurrency.unwrap_or(GET_CONCURRENCY_DEFAULT),
            )
            .await?
        }
        Some("agent-restore") if args.len() == 3 => {
            agent_restore(
                &args[1],
                Path::new(&args[2]),
                step.context("agent-restore needs --step")?,
                rank.unwrap_or(0),
                world.unwrap_or(1),
                no_copy.is_some(),
                concurrency.unwrap_or(GET_CONCURRENCY_DEFAULT),
            )
            .await?
        }
        _ => bail!(
            "usage: bench_store raw-put URL FILE... | raw-get URL [--stream] | restore URL DEST --rank R --world W [--step N] | agent-restore URL ROOT --step N --rank R --world W [--no-copy]"
        ),
    };
    println!("{out}");
    Ok(())
}
