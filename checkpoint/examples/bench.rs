//! Save/restore throughput against raw `object_store` on `file://`, and compression ratios.
//!
//! `cargo run --release -p checkpoint --example bench -- [TOTAL_MIB] [DIR] [RESTORE_DIR]`
//! (defaults: 2048 MiB of state and the `file://` store under the system temp dir, restores
//! into `/dev/shm` like elastic-run's staging; `BENCH_REPS` repetitions, default 3, each
//! running every method in an order rotated by one). Prints a Markdown table of medians to
//! stdout. `bench codec` prints the compression rows only.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use checkpoint::{
    CancellationToken, CommitRequest, PartInput, PartSource, ReadOptions, SaveOptions, Store,
};
use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, PutPayload};
use rand::{RngExt, SeedableRng};

const CHUNK_BYTES: usize = 32 * 1024 * 1024;
const CONCURRENCY: usize = 4;
const FILES: usize = 4;

/// N(0, 0.02) weights as f32 (Box-Muller).
fn gaussian_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let u1: f32 = rng.random::<f32>().max(f32::MIN_POSITIVE);
            let u2: f32 = rng.random();
            0.02 * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
        })
        .collect()
}

fn bytes_of(v: &[f32], bf16: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * if bf16 { 2 } else { 4 });
    for x in v {
        if bf16 {
            out.extend_from_slice(&x.to_bits().to_le_bytes()[2..]);
        } else {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    out
}

fn status_mib(field: &str) -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

/// Starts a peak-memory window: resets the high-water mark to the current RSS, which it
/// returns.
fn rss_window_start() -> f64 {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    status_mib("VmRSS:")
}

/// How far RSS rose above `start` since [`rss_window_start`].
fn rss_window_growth(start: f64) -> f64 {
    (status_mib("VmHWM:") - start).max(0.0)
}

/// Writes FILES safetensors files (half bf16, half fp32 tensors), streaming, no big buffers.
fn write_state(dir: &Path, total: usize) -> u64 {
    std::fs::create_dir_all(dir).unwrap();
    let per_file = total / FILES;
    let tensor_bytes = (64 * 1024 * 1024).min(per_file) / 4 * 4;
    let mut written = 0;
    for f in 0..FILES {
        let n_tensors = per_file.div_ceil(tensor_bytes);
        let mut header = serde_json::Map::new();
        let mut off = 0u64;
        let mut specs = Vec::new();
        for t in 0..n_tensors {
            let bf16 = t % 2 == 0;
            let elem = if bf16 { 2 } else { 4 };
            let n = tensor_bytes / elem;
            header.insert(
                format!("layer.{t}.weight"),
                serde_json::json!({"dtype": if bf16 {"BF16"} else {"F32"}, "shape": [n], "data_offsets": [off, off + tensor_bytes as u64]}),
            );
            specs.push((bf16, n, (f * 1000 + t) as u64));
            off += tensor_bytes as u64;
        }
        // safetensors orders data by offset, so write tensors in insertion order.
        let mut h = serde_json::Value::Object(header).to_string().into_bytes();
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut file = std::io::BufWriter::new(
            std::fs::File::create(dir.join(format!("rank-{f}.safetensors"))).unwrap(),
        );
        file.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
        file.write_all(&h).unwrap();
        for (bf16, n, seed) in specs {
            file.write_all(&bytes_of(&gaussian_f32(n, seed), bf16))
                .unwrap();
        }
        file.flush().unwrap();
        written += off;
    }
    written
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

struct SaveRestore {
    save_s: f64,
    restore_s: f64,
    ratio: f64,
    save_peak_mib: f64,
    restore_peak_mib: f64,
}

/// One save (every chunk durable, then the manifest) and one restore of the staged state.
async fn save_restore(
    base: &Path,
    staging: &Path,
    restore_dir: &Path,
    compress: bool,
    cancel: &CancellationToken,
) -> SaveRestore {
    let dir = base.join(format!("ckpt-{compress}"));
    let _ = std::fs::remove_dir_all(&dir);
    let store = Store::open(&format!("file://{}", dir.display())).unwrap();
    let rss_start = rss_window_start();
    let t = Instant::now();
    let opts = SaveOptions {
        chunk_bytes_max: CHUNK_BYTES,
        concurrency: CONCURRENCY,
        compress,
        progress: None,
    };
    let input = PartInput {
        writer: "bench".into(),
        source: PartSource::Dir(staging.to_path_buf()),
        shards: Default::default(),
    };
    store.save_part(1, input, &opts, cancel).await.unwrap();
    let req = CommitRequest {
        world_size: 1,
        writers: vec!["bench".into()],
        metadata: serde_json::Value::Null,
    };
    let m = store
        .commit(1, req, cancel)
        .await
        .unwrap()
        .manifest()
        .clone();
    let save_s = t.elapsed().as_secs_f64();
    let save_peak_mib = rss_window_growth(rss_start);
    let rss_start = rss_window_start();
    let t = Instant::now();
    let out = restore_dir.join(format!("restore-{compress}"));
    let ropts = ReadOptions {
        concurrency: CONCURRENCY,
        progress: None,
        ..Default::default()
    };
    store
        .restore(Some(1), 0, 1, &out, &ropts, cancel)
        .await
        .unwrap();
    let restore_s = t.elapsed().as_secs_f64();
    let restore_peak_mib = rss_window_growth(rss_start);
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&dir);
    SaveRestore {
        save_s,
        restore_s,
        ratio: m.raw_bytes() as f64 / m.stored_bytes() as f64,
        save_peak_mib,
        restore_peak_mib,
    }
}

fn mib_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / 1048576.0 / secs
}

async fn raw_put_get(
    files: &[PathBuf],
    root: &Path,
    restore_dir: &Path,
    fsync: bool,
) -> (f64, f64, f64, u64) {
    let _ = std::fs::remove_dir_all(root);
    std::fs::create_dir_all(root).unwrap();
    let root = root.to_path_buf();
    let store = Arc::new(object_store::local::LocalFileSystem::new_with_prefix(&root).unwrap());
    let mut jobs = Vec::new();
    for (fi, f) in files.iter().enumerate() {
        let len = std::fs::metadata(f).unwrap().len();
        for (ci, start) in (0..len).step_by(CHUNK_BYTES).enumerate() {
            jobs.push((
                fi,
                ci,
                f.clone(),
                start,
                (len - start).min(CHUNK_BYTES as u64),
            ));
        }
    }
    let total: u64 = jobs.iter().map(|j| j.4).sum();
    let t = Instant::now();
    futures::stream::iter(jobs.clone())
        .map(|(fi, ci, f, start, len)| {
            let store = store.clone();
            let root = root.clone();
            async move {
                let data = tokio::task::spawn_blocking(move || {
                    use std::os::unix::fs::FileExt;
                    let mut buf = vec![0u8; len as usize];
                    std::fs::File::open(f)
                        .unwrap()
                        .read_exact_at(&mut buf, start)
                        .unwrap();
                    buf
                })
                .await
                .unwrap();
                let p = object_store::path::Path::from(format!("raw/{fi}/{ci}.bin"));
                store.put(&p, PutPayload::from(data)).await?;
                if fsync {
                    // The durability a checkpoint save gives: fsync the file and its directory.
                    let f = root.join(p.as_ref());
                    tokio::task::spawn_blocking(move || {
                        std::fs::File::open(&f).unwrap().sync_all().unwrap();
                        std::fs::File::open(f.parent().unwrap())
                            .unwrap()
                            .sync_all()
                            .unwrap();
                    })
                    .await
                    .unwrap();
                }
                Ok::<_, object_store::Error>(())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    let put_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    futures::stream::iter(jobs.clone())
        .map(|(fi, ci, ..)| {
            let store = store.clone();
            async move {
                let p = object_store::path::Path::from(format!("raw/{fi}/{ci}.bin"));
                let b = store.get(&p).await?.bytes().await?;
                Ok::<_, object_store::Error>(b.len())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    let get_s = t.elapsed().as_secs_f64();
    // What a restore does with the bytes: every get written at its offset into one output
    // file in the restore directory, then the file and the directory fsynced.
    let out_dir = restore_dir.join("raw-out");
    let _ = std::fs::remove_dir_all(&out_dir);
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = Arc::new(std::fs::File::create(out_dir.join("state.bin")).unwrap());
    out.set_len(total).unwrap();
    let mut at = 0u64;
    let placed: Vec<(usize, usize, u64)> = jobs
        .iter()
        .map(|j| {
            let here = at;
            at += j.4;
            (j.0, j.1, here)
        })
        .collect();
    let t = Instant::now();
    futures::stream::iter(placed)
        .map(|(fi, ci, offset)| {
            let (store, out) = (store.clone(), out.clone());
            async move {
                let p = object_store::path::Path::from(format!("raw/{fi}/{ci}.bin"));
                let b = store.get(&p).await?.bytes().await?;
                tokio::task::spawn_blocking(move || {
                    use std::os::unix::fs::FileExt;
                    out.write_all_at(&b, offset).unwrap();
                })
                .await
                .unwrap();
                Ok::<_, object_store::Error>(())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    out.sync_all().unwrap();
    std::fs::File::open(&out_dir).unwrap().sync_all().unwrap();
    let get_write_s = t.elapsed().as_secs_f64();
    drop(out);
    let _ = std::fs::remove_dir_all(&out_dir);
    (put_s, get_s, get_write_s, total)
}

fn compression_rows() -> Vec<String> {
    let n = 32 * 1024 * 1024;
    let w = gaussian_f32(n / 2, 7);
    let mut rows = Vec::new();
    for (name, bf16, width) in [("bf16", true, 2u8), ("fp32", false, 4u8)] {
        let data = bytes_of(&w, bf16);
        let data = &data[..n.min(data.len())];
        let t = Instant::now();
        let plain = zstd::bulk::compress(data, checkpoint::codec::ZSTD_LEVEL).unwrap();
        let plain_s = t.elapsed().as_secs_f64();
        let mut row = format!(
            "| {name} N(0,0.02), {} MiB | zstd-1: {:.3}x at {:.0} MiB/s |",
            data.len() >> 20,
            data.len() as f64 / plain.len() as f64,
            mib_s(data.len() as u64, plain_s),
        );
        // This build's encoder (zstd-blocks), then format 2's (zstd-planes), side by side.
        for encode in [checkpoint::codec::encode, checkpoint::codec::encode_format2] {
            let t = Instant::now();
            let (stored, codec) = encode(data, Some(width), true);
            let enc_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let back = checkpoint::codec::decode(&stored, &codec, data.len() as u64).unwrap();
            let dec_s = t.elapsed().as_secs_f64();
            assert_eq!(back, data);
            row.push_str(&format!(
                " {}: {:.3}x at {:.0} MiB/s (decode {:.0} MiB/s) |",
                codec.name(),
                data.len() as f64 / stored.len() as f64,
                mib_s(data.len() as u64, enc_s),
                mib_s(data.len() as u64, dec_s),
            ));
        }
        rows.push(row);
    }
    rows
}

#[tokio::main]
async fn main() {
    // As in elastic-run and elastic-ckpt (`BENCH_GLIBC_DEFAULT=1` measures without it).
    if std::env::var_os("BENCH_GLIBC_DEFAULT").is_none() {
        checkpoint::alloc::release_freed_buffers_eagerly();
    }
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).is_some_and(|a| a == "codec") {
        // Compression rows only: `bench codec`.
        println!(
            "| data | plain zstd | byte planes in blocks (written) | byte planes, whole chunk (format 2) |\n|---|---|---|---|"
        );
        compression_rows().iter().for_each(|r| println!("{r}"));
        return;
    }
    let total_mib: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2048);
    let base = args
        .get(2)
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("ckpt-bench-{}", std::process::id()));
    let staging = base.join("staging");
    // Restores land where elastic-run puts them: its staging directory, /dev/shm by default.
    let restore_dir = args
        .get(3)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let shm = Path::new("/dev/shm");
            if shm.is_dir() {
                shm.to_path_buf()
            } else {
                base.clone()
            }
        })
        .join(format!("ckpt-bench-restore-{}", std::process::id()));
    std::fs::create_dir_all(&restore_dir).unwrap();
    let bytes = write_state(&staging, total_mib * 1024 * 1024);
    let files: Vec<PathBuf> = (0..FILES)
        .map(|f| staging.join(format!("rank-{f}.safetensors")))
        .collect();
    eprintln!("state written: {} MiB", bytes >> 20);

    let reps: usize = std::env::var("BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let (nosync_s, _, _, raw_total) =
        raw_put_get(&files, &base.join("raw"), &restore_dir, false).await;
    let cancel = CancellationToken::new();
    // Each repetition runs raw puts/gets, save/restore of raw chunks and of compressed chunks,
    // in an order rotated by one each time; the table gives medians and ranges.
    let mut raw_put = Vec::new();
    let mut raw_get = Vec::new();
    let mut raw_get_write = Vec::new();
    let mut runs: [Vec<SaveRestore>; 2] = [Vec::new(), Vec::new()];
    for rep in 0..reps {
        for k in 0..3 {
            match (rep + k) % 3 {
                0 => {
                    let (put_s, get_s, get_write_s, _) =
                        raw_put_get(&files, &base.join("raw"), &restore_dir, true).await;
                    raw_put.push(put_s);
                    raw_get.push(get_s);
                    raw_get_write.push(get_write_s);
                }
                which => {
                    let compress = which == 2;
                    let r = save_restore(&base, &staging, &restore_dir, compress, &cancel).await;
                    runs[usize::from(compress)].push(r);
                }
            }
        }
        eprintln!("repetition {} of {reps} done", rep + 1);
    }
    let (put_s, get_s, get_write_s) = (median(&raw_put), median(&raw_get), median(&raw_get_write));
    let range = |v: &[f64]| {
        let (lo, hi) = v
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        format!("{:.0}-{:.0}", mib_s(raw_total, hi), mib_s(raw_total, lo))
    };
    let mut rows = vec![
        format!(
            "| raw object_store put ({CONCURRENCY}×32 MiB), no fsync | {:.0} MiB/s | not durable (one run) |",
            mib_s(raw_total, nosync_s)
        ),
        format!(
            "| raw object_store put + fsync | {:.0} MiB/s ({} MiB/s, n={reps}) | baseline for save |",
            mib_s(raw_total, put_s),
            range(&raw_put)
        ),
        format!(
            "| raw object_store get | {:.0} MiB/s ({} MiB/s, n={reps}) | into memory only |",
            mib_s(raw_total, get_s),
            range(&raw_get)
        ),
        format!(
            "| raw object_store get + write + fsync | {:.0} MiB/s ({} MiB/s, n={reps}) | into one file in the restore directory, fsynced: baseline for restore |",
            mib_s(raw_total, get_write_s),
            range(&raw_get_write)
        ),
    ];
    for (compress, rs) in [(false, &runs[0]), (true, &runs[1])] {
        let label = if compress { "compressed" } else { "raw chunks" };
        let save: Vec<f64> = rs.iter().map(|r| r.save_s).collect();
        let restore: Vec<f64> = rs.iter().map(|r| r.restore_s).collect();
        let (save_s, restore_s) = (median(&save), median(&restore));
        let peak = |f: fn(&SaveRestore) -> f64| rs.iter().map(f).fold(0f64, f64::max);
        rows.push(format!(
            "| save, {label} (ratio {:.3}x) | {:.0} MiB/s ({} MiB/s, n={reps}; {:.0}% of raw put) | peak RSS +{:.0} MiB |",
            rs[0].ratio,
            mib_s(bytes, save_s),
            range(&save),
            100.0 * put_s / save_s,
            peak(|r| r.save_peak_mib)
        ));
        rows.push(format!(
            "| restore, {label} | {:.0} MiB/s ({} MiB/s, n={reps}; {:.0}% of raw get + write + fsync, {:.0}% of raw get) | peak RSS +{:.0} MiB |",
            mib_s(bytes, restore_s),
            range(&restore),
            100.0 * get_write_s / restore_s,
            100.0 * get_s / restore_s,
            peak(|r| r.restore_peak_mib)
        ));
    }
    rows.extend(compression_rows());
    let _ = std::fs::remove_dir_all(&base);
    let _ = std::fs::remove_dir_all(&restore_dir);
    println!(
        "| {} MiB state, {} files, file:// | throughput | notes |",
        bytes >> 20,
        FILES
    );
    println!("|---|---|---|");
    for r in rows {
        println!("{r}");
    }
}
