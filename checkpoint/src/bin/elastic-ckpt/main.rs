//! `elastic-ckpt`: inspect, move and check checkpoints in object storage.
//!
//! - Here: the command line and what each subcommand does.
//! - `output`: what it prints (terminal-safe text, progress bars, sizes, times, JSON).
//! - `reader`: `restore --into-parent`'s answers from the reader on stdin.

mod output;
mod reader;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use checkpoint::export::{EXPORT_KEY_DEFAULT, parse_size_bytes};
use checkpoint::retention::GcCheck;
use checkpoint::{
    CancellationToken, CommitOutcome, CommitRequest, Compression, Manifest, PartInput, PartSource,
    ReadOptions, RetentionPolicy, SaveOptions, Store,
};
use clap::{Parser, Subcommand};

use output::{bar, human_bytes, print_json, printable, shows_bar, utc};
use reader::reader_targets;

/// Default age after which an uncommitted leftover may be deleted.
const LEFTOVER_AGE_SECS_DEFAULT: u64 = 3600;
/// Default chunks in flight.
const CONCURRENCY_DEFAULT: usize = 8;
/// Default chunk size bound.
const CHUNK_MIB_DEFAULT: usize = 32;

#[derive(Parser)]
#[command(
    name = "elastic-ckpt",
    version,
    about = "Sharded checkpoints in object storage"
)]
struct Cli {
    /// Machine-readable JSON output (also hides progress bars).
    #[arg(long, global = true, env = "ELASTIC_CKPT_JSON")]
    json: bool,
    /// Chunks transferred at once.
    #[arg(long, global = true, default_value_t = CONCURRENCY_DEFAULT, env = "ELASTIC_CKPT_CONCURRENCY")]
    concurrency: usize,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Commit every *.safetensors file under DIR as step N (refuses an existing step).
    Push {
        dir: PathBuf,
        url: String,
        #[arg(long)]
        step: u64,
        /// World size recorded in the manifest.
        #[arg(long, default_value_t = 1)]
        world_size: u32,
        /// Trainer metadata (JSON) recorded in the manifest.
        #[arg(long, default_value = "{}")]
        metadata: String,
        /// Upper bound of a chunk, in MiB.
        #[arg(long, default_value_t = CHUNK_MIB_DEFAULT)]
        chunk_mib: usize,
        /// Chunk compression: `auto` compresses on remote object stores (s3, az, gs) and not on
        /// file:// or memory://, where it costs more CPU time than the bytes it saves.
        #[arg(long, value_enum, default_value_t = Compression::Auto)]
        compress: Compression,
        /// Same as `--compress never`.
        #[arg(long, conflicts_with = "compress")]
        no_compress: bool,
    },
    /// Write a step's files under DIR, byte-identical to what was pushed. By default the
    /// newest committed step that reads back whole: a newer one that fails its checks is
    /// skipped with a warning naming the bad object. DIR must be empty or absent.
    Pull {
        url: String,
        dir: PathBuf,
        #[arg(long)]
        step: Option<u64>,
        /// Pull into a DIR that already holds files: files of the same name are replaced
        /// (never written through, and never when a symlink stands there), others are kept.
        #[arg(long)]
        force: bool,
    },
    /// Write one entry of a step's state (a module's weights) under DIR as Hugging Face
    /// safetensors: `model.safetensors`, or, above --max-shard-size,
    /// `model-00001-of-0000N.safetensors`... and `model.safetensors.index.json`. Tensors are
    /// named as in the module's state_dict(), sharded ones written whole. By default the
    /// newest committed step that reads back whole: a newer one that fails its checks is
    /// skipped with a warning naming the bad object. DIR must be empty or absent.
    Export {
        url: String,
        dir: PathBuf,
        #[arg(long)]
        step: Option<u64>,
        /// The entry of the saved state: `model`, `ema`, ... (a module-like one: a flat map of
        /// names to tensors).
        #[arg(long, default_value = EXPORT_KEY_DEFAULT)]
        key: String,
        /// The largest file, as Hugging Face spells it: 5GB (10^9 bytes), 500MB, 2GiB, 100KB,
        /// or bytes. A tensor larger than this gets a file of its own.
        #[arg(long, default_value = "5GB", value_parser = parse_size_bytes)]
        max_shard_size: u64,
    },
    /// Restore what rank R of a world of W needs into DIR, as the agent does for a worker:
    /// DIR/state.safetensors (replicated tensors whole, rows [rows*R/W, rows*(R+1)/W) of
    /// sharded ones) and DIR/metadata.json. By default the newest committed step that
    /// restores, falling back past a corrupt one. DIR must be empty or absent.
    Restore {
        url: String,
        dir: PathBuf,
        #[arg(long)]
        step: Option<u64>,
        #[arg(long)]
        rank: u32,
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        world_size: u32,
        /// Print what is ready as it comes, one JSON object a line on stdout, before the
        /// report: `{"event": "step", "step", "metadata"}` as a step's read begins (the
        /// metadata.json it will have); `{"event": "file", "step", "name", "path", "bytes"}`
        /// once the state file exists at its full length under its temporary PATH, its header
        /// written; `{"event": "ready", "step", "name", "ranges": [[offset, length], ...]}` as
        /// byte ranges of it are written and checked; `{"event": "failed", "step", "error"}`
        /// when that step does not restore (its temporary file is gone; an older step may
        /// follow). A reader may load from PATH while the restore goes on; only a run that
        /// exits 0 has restored the last step named.
        #[arg(long)]
        events: bool,
        /// With --events, from a local directory whose chunks the step needs are all raw: copy
        /// nothing. Each chunk is checked where it lies, and the state file is not written:
        /// `{"event": "header", "step", "name", "bytes", "header"}` gives its safetensors
        /// header instead of the file event, and `{"event": "source", "step", "name", "path",
        /// "bytes", "dev", "ino", "ranges": [[offset, length, offset in path], ...]}`, once
        /// a chunk is checked, where its bytes lie (the chunk's file, as it was checked).
        /// Otherwise the state file is written as without it.
        #[arg(long, requires = "events")]
        no_copy: bool,
        /// With --events, for a step not read with --no-copy: write the state into the memory
        /// of this process's parent (the reader) instead of a file. The header event carries
        /// `"targets": true`, and the reader answers on stdin with one line, `{"step",
        /// "name", "pid", "targets": [[offset, length, address], ...]}`: its own process id,
        /// and the addresses in its memory that bytes [offset, offset + length) of the state
        /// go to (its tensors), or `"targets": null` for the file. Ready events then say
        /// which ranges are there. Where the reader is not the parent, or the system denies
        /// the writes (ptrace access), the file is written as without it. The restore is
        /// killed when the thread that started it exits.
        #[arg(long, requires = "events")]
        into_parent: bool,
        /// Skip the fsyncs of the state file: for a restore that is read once and removed
        /// (`elastic_run.load_from` passes it), on a disk they cost more than the read.
        #[arg(long)]
        no_sync: bool,
    },
    /// List committed steps (with --all, uncommitted leftovers too).
    Ls {
        url: String,
        #[arg(long)]
        all: bool,
    },
    /// Show a step's tensors, files, compression and metadata (newest by default).
    Show {
        url: String,
        #[arg(long)]
        step: Option<u64>,
    },
    /// Read every object of a step and check lengths and checksums.
    Verify {
        url: String,
        #[arg(long)]
        step: Option<u64>,
    },
    /// Delete steps outside the retention policy and old uncommitted leftovers.
    ///
    /// Never deletes the newest step that verifies. Committed steps are checked newest first
    /// until K verify (only those are read, never the ones deleted); a step that does not
    /// verify does not count toward K, and is kept when it is newer than every step that does.
    Gc {
        url: String,
        /// Steps that verify to keep, newest first (at least 1).
        #[arg(long, value_parser = parse_keep_last)]
        keep_last: usize,
        /// Also keep every committed step divisible by N.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        keep_every: Option<u64>,
        #[arg(long, default_value_t = LEFTOVER_AGE_SECS_DEFAULT)]
        leftover_age_secs: u64,
        #[arg(long)]
        dry_run: bool,
        /// Read every object of the steps counted toward --keep-last and check its checksums
        /// (the default; spelled out for scripts).
        #[arg(long, conflicts_with = "fast")]
        verify: bool,
        /// Check the steps counted toward --keep-last only for a valid manifest and objects of
        /// their recorded sizes, reading no data: a flipped bit goes unseen, so a corrupt
        /// newest step can be kept in place of the last good one.
        #[arg(long)]
        fast: bool,
    },
    /// Copy committed steps (all, or --step N) from SRC to DST.
    Cp {
        src: String,
        dst: String,
        #[arg(long)]
        step: Option<u64>,
    },
}

fn main() -> ExitCode {
    checkpoint::alloc::release_freed_buffers_eagerly();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", printable(&format!("{e:#}")));
            ExitCode::FAILURE
        }
    }
}

/// A pull writes into an empty or absent directory unless `--force`: mixing a step's files
/// with whatever was there makes a directory that is neither.
fn check_pull_target(dir: &std::path::Path, force: bool) -> Result<()> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("pull target {}", dir.display())),
    };
    let is_dir = meta.is_dir() || (meta.file_type().is_symlink() && dir.is_dir());
    if !is_dir {
        bail!(
            "pull target {} exists and is not a directory",
            dir.display()
        );
    }
    let mut entries =
        std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    if !force && entries.next().is_some() {
        bail!(
            "pull target {} is not empty; pull into an empty directory, or pass --force to replace files of the same name",
            dir.display()
        );
    }
    Ok(())
}

/// The length of a read's progress bar: `len` of the step asked for, or of the newest
/// committed one (a fallback's bytes carry on past it); 0 when there is none or its manifest
/// does not read (the read itself then says why).
async fn progress_len(
    store: &Store,
    step: Option<u64>,
    cancel: &CancellationToken,
    len: impl Fn(&Manifest) -> u64,
) -> Result<u64> {
    let step = match step {
        Some(s) => Some(s),
        None => store.committed_steps(cancel).await?.last().copied(),
    };
    Ok(match step {
        Some(s) => store.read_manifest(s, cancel).await.map_or(0, |m| len(&m)),
        None => 0,
    })
}

/// `gc --keep-last`: at least 1, since gc never deletes the newest step that verifies.
fn parse_keep_last(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1: gc never deletes the newest step that verifies".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn open(url: &str) -> Result<Store> {
    Store::open(url).with_context(|| format!("opening {url}"))
}

/// The step a command acts on: the one asked for, else the newest with a manifest (valid or
/// not, so `verify` and `show` report on it rather than silently on an older one).
async fn newest_committed(
    store: &Store,
    step: Option<u64>,
    cancel: &CancellationToken,
) -> Result<u64> {
    match step {
        Some(s) => Ok(s),
        None => store
            .committed_steps(cancel)
            .await?
            .last()
            .copied()
            .with_context(|| format!("no committed step in {}", store.url())),
    }
}

async fn run(cli: Cli) -> Result<()> {
    let cancel = CancellationToken::new();
    {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                cancel.cancel();
            }
        });
    }
    let json = cli.json;
    let concurrency = cli.concurrency.max(1);
    match cli.cmd {
        Cmd::Push {
            dir,
            url,
            step,
            world_size,
            metadata,
            chunk_mib,
            compress,
            no_compress,
        } => {
            let metadata: serde_json::Value =
                serde_json::from_str(&metadata).context("--metadata is not JSON")?;
            if !dir.is_dir() {
                bail!("{} is not a directory", dir.display());
            }
            let store = open(&url)?;
            match store.read_manifest(step, &cancel).await {
                Ok(_) => bail!(
                    "step {step} already exists in {}; refusing to push",
                    store.url()
                ),
                Err(checkpoint::Error::StepNotFound { .. }) => {}
                Err(e) => return Err(e).context("checking whether the step exists"),
            }
            let total: u64 = walk_size(&dir);
            let (pb, progress) = bar(json, total, "push");
            let opts = SaveOptions {
                chunk_bytes_max: chunk_mib.max(1) * 1024 * 1024,
                concurrency,
                compress: if no_compress {
                    false
                } else {
                    compress.for_store(&store)
                },
                progress,
            };
            let input = PartInput {
                writer: "push".into(),
                source: PartSource::Dir(dir.clone()),
                shards: Default::default(),
            };
            let part = store
                .save_part(step, input, &opts, &cancel)
                .await
                .with_context(|| format!("uploading {}", dir.display()))?;
            pb.finish_and_clear();
            let req = CommitRequest {
                world_size,
                writers: vec!["push".into()],
                metadata,
            };
            let m = match store.commit(step, req, &cancel).await? {
                CommitOutcome::Committed(m) => m,
                CommitOutcome::AlreadyCommitted(_) => {
                    bail!("step {step} was committed by someone else while pushing")
                }
            };
            let _ = part;
            if json {
                print_json(&serde_json::json!({
                    "step": step, "files": m.files.len(), "tensors": m.tensors.len(),
                    "raw_bytes": m.raw_bytes(), "stored_bytes": m.stored_bytes(),
                }))?;
            } else {
                println!(
                    "committed step {step} to {}: {} files, {} tensors, {} ({} stored)",
                    store.url(),
                    m.files.len(),
                    m.tensors.len(),
                    human_bytes(m.raw_bytes()),
                    human_bytes(m.stored_bytes())
                );
            }
        }
        Cmd::Pull {
            url,
            dir,
            step,
            force,
        } => {
            check_pull_target(&dir, force)?;
            let store = open(&url)?;
            let (m, skipped) = match step {
                Some(step) => {
                    let m = store.read_manifest(step, &cancel).await?;
                    let (pb, progress) = bar(json, m.raw_bytes(), "pull");
                    let opts = ReadOptions {
                        concurrency,
                        progress,
                        ..Default::default()
                    };
                    let m = store.pull(step, &dir, &opts, &cancel).await?;
                    pb.finish_and_clear();
                    (m, Vec::new())
                }
                None => {
                    let len = progress_len(&store, None, &cancel, Manifest::raw_bytes).await?;
                    let (pb, progress) = bar(json, len, "pull");
                    let opts = ReadOptions {
                        concurrency,
                        progress,
                        ..Default::default()
                    };
                    let r = store.pull_newest(&dir, &opts, &cancel).await?;
                    pb.finish_and_clear();
                    r
                }
            };
            for s in &skipped {
                eprintln!(
                    "warning: skipped committed step {s}: it does not read back whole (see the warning above)"
                );
            }
            if json {
                print_json(&serde_json::json!({
                    "step": m.step,
                    "files": m.files.iter().map(|f| &f.name).collect::<Vec<_>>(),
                    "skipped_steps": skipped,
                }))?;
            } else {
                println!(
                    "pulled step {}: {} files into {}",
                    m.step,
                    m.files.len(),
                    dir.display()
                );
            }
        }
        Cmd::Export {
            url,
            dir,
            step,
            key,
            max_shard_size,
        } => {
            checkpoint::restore::check_fresh_dir(&dir, "export target")?;
            let store = open(&url)?;
            let len = progress_len(&store, step, &cancel, |m| {
                checkpoint::export::plan(m, &key, max_shard_size)
                    .map_or(m.raw_bytes(), |p| p.total_bytes)
            })
            .await?;
            let (pb, progress) = bar(json, len, "export");
            let opts = ReadOptions {
                concurrency,
                progress,
                ..Default::default()
            };
            let report = store
                .export(step, &key, &dir, max_shard_size, &opts, &cancel)
                .await?;
            pb.finish_and_clear();
            for s in &report.skipped_steps {
                eprintln!(
                    "warning: skipped committed step {s}: it does not read back whole (see the warning above)"
                );
            }
            if json {
                print_json(&report)?;
            } else {
                println!(
                    "exported {:?} of step {}: {} tensors, {} in {} file{} into {}",
                    printable(&report.key),
                    report.step,
                    report.tensors,
                    human_bytes(report.bytes),
                    report.files.len(),
                    if report.files.len() == 1 { "" } else { "s" },
                    dir.display()
                );
            }
        }
        Cmd::Restore {
            url,
            dir,
            step,
            rank,
            world_size,
            events,
            no_sync,
            no_copy,
            into_parent,
        } => {
            checkpoint::restore::check_fresh_dir(&dir, "restore target")?;
            if events && dir.to_str().is_none() {
                bail!(
                    "restore target {}: --events names files by their paths in JSON, which needs a UTF-8 path",
                    dir.display()
                );
            }
            let store = open(&url)?;
            // The whole step at most: a rank's share of sharded tensors is less.
            let len = if shows_bar(json) {
                progress_len(&store, step, &cancel, Manifest::raw_bytes).await?
            } else {
                0
            };
            let (pb, progress) = bar(json, len, "restore");
            let opts = ReadOptions {
                concurrency,
                progress,
                events: events.then(|| -> checkpoint::ReadEvents {
                    std::sync::Arc::new(|ev: &checkpoint::ReadEvent| {
                        // One line each, whole: stdout's lock is held for the line.
                        if let Ok(line) = serde_json::to_string(ev) {
                            println!("{line}");
                        }
                    })
                }),
                sync: !no_sync,
                no_copy,
                into_process: into_parent.then(|| reader_targets(&cancel)),
            };
            let report = store
                .restore(step, rank, world_size, &dir, &opts, &cancel)
                .await?;
            pb.finish_and_clear();
            for s in &report.skipped_steps {
                eprintln!(
                    "warning: skipped committed step {s}: it does not restore (see the warning above)"
                );
            }
            if json {
                let abs = |p: &std::path::Path| std::path::absolute(p).unwrap_or(p.to_path_buf());
                print_json(&serde_json::json!({
                    "step": report.step,
                    "rank": report.rank,
                    "world_size": report.world_size,
                    "tensors": report.tensors,
                    "bytes": report.bytes,
                    "skipped_steps": report.skipped_steps,
                    "files": {
                        "state": report.written.then(|| abs(&report.path)),
                        "metadata": abs(&report.metadata_path),
                    },
                }))?;
            } else {
                println!(
                    "restored step {} for rank {rank} of {world_size}: {} tensors, {} {} {}",
                    report.step,
                    report.tensors,
                    human_bytes(report.bytes),
                    if report.written {
                        "into"
                    } else {
                        "checked where the events say, none copied; metadata into"
                    },
                    dir.display()
                );
            }
        }
        Cmd::Ls { url, all } => {
            let store = open(&url)?;
            let steps: Vec<_> = store
                .list_steps(&cancel)
                .await?
                .into_iter()
                .filter(|s| all || s.committed)
                .collect();
            if json {
                print_json(&steps)?;
            } else {
                println!(
                    "{:>12}  {:>10}  {:>10}  {:>5}  {:<20}  state",
                    "STEP", "STORED", "RAW", "WORLD", "CREATED"
                );
                for s in steps {
                    match (&s.manifest, &s.manifest_error) {
                        (Some(m), _) => println!(
                            "{:>12}  {:>10}  {:>10}  {:>5}  {:<20}  committed",
                            s.step,
                            human_bytes(m.stored_bytes),
                            human_bytes(m.raw_bytes),
                            m.world_size,
                            utc(m.created_unix_ms)
                        ),
                        (None, Some(e)) => println!(
                            "{:>12}  {:>10}  {:>10}  {:>5}  {:<20}  committed but invalid: {}",
                            s.step,
                            "-",
                            "-",
                            "-",
                            "-",
                            printable(e)
                        ),
                        (None, None) => println!(
                            "{:>12}  {:>10}  {:>10}  {:>5}  {:<20}  uncommitted",
                            s.step, "-", "-", "-", "-"
                        ),
                    }
                }
            }
        }
        Cmd::Show { url, step } => {
            let store = open(&url)?;
            let step = newest_committed(&store, step, &cancel).await?;
            let m = store.read_manifest(step, &cancel).await?;
            if json {
                print_json(&m)?;
            } else {
                let ratio = m.raw_bytes() as f64 / m.stored_bytes().max(1) as f64;
                println!(
                    "step {}  world size {}  created {}",
                    m.step,
                    m.world_size,
                    utc(m.created_unix_ms)
                );
                println!(
                    "size {} raw, {} stored, ratio {ratio:.3}x, {} objects",
                    human_bytes(m.raw_bytes()),
                    human_bytes(m.stored_bytes()),
                    m.objects.len()
                );
                let mut codecs = std::collections::BTreeMap::new();
                for o in &m.objects {
                    *codecs.entry(o.codec.name()).or_insert(0usize) += 1;
                }
                println!("codecs {codecs:?}");
                println!("metadata {}", printable(&m.metadata.to_string()));
                println!("files:");
                for f in &m.files {
                    println!("  {}  {}", printable(&f.name), human_bytes(f.data_bytes));
                }
                println!("tensors:");
                for t in &m.tensors {
                    let bytes: u64 = t
                        .shards
                        .iter()
                        .map(|s| s.data_offsets[1] - s.data_offsets[0])
                        .sum();
                    let kind = if t.sharded {
                        format!("sharded x{}", t.shards.len())
                    } else {
                        "replicated".into()
                    };
                    println!(
                        "  {}  {}  {:?}  {}  {kind}",
                        printable(&t.name),
                        printable(&t.dtype),
                        t.shape,
                        human_bytes(bytes)
                    );
                }
            }
        }
        Cmd::Verify { url, step } => {
            let store = open(&url)?;
            let step = newest_committed(&store, step, &cancel).await?;
            let m = store.read_manifest(step, &cancel).await?;
            let (pb, progress) = bar(json, m.stored_bytes(), "verify");
            let opts = ReadOptions {
                concurrency,
                progress,
                ..Default::default()
            };
            let report = store.verify(step, &opts, &cancel).await?;
            pb.finish_and_clear();
            if json {
                print_json(&report)?;
            } else if report.bad.is_empty() {
                println!(
                    "step {step}: {} objects, {} verified",
                    report.objects_checked,
                    human_bytes(report.stored_bytes)
                );
            }
            if !report.bad.is_empty() {
                let list: Vec<String> = report
                    .bad
                    .iter()
                    .map(|(k, r)| format!("{k}: {r}"))
                    .collect();
                bail!(
                    "step {step} does not verify: {} bad object(s):\n  {}",
                    report.bad.len(),
                    list.join("\n  ")
                );
            }
        }
        Cmd::Gc {
            url,
            keep_last,
            keep_every,
            leftover_age_secs,
            dry_run,
            verify: _,
            fast,
        } => {
            let store = open(&url)?;
            let policy = RetentionPolicy {
                keep_last,
                keep_every,
                leftover_age_ms_min: leftover_age_secs.saturating_mul(1000),
                check: if fast {
                    GcCheck::Present
                } else {
                    GcCheck::Full
                },
                pinned: None,
            };
            let report = store.gc(&policy, dry_run, &cancel).await?;
            if json {
                print_json(&report)?;
            } else {
                for i in &report.items {
                    println!("{:>12}  {:?}  {}", i.step, i.decision, i.reason);
                }
                for f in &report.not_verifying {
                    println!("step {} does not verify: {}", f.step, printable(&f.error));
                }
                println!(
                    "{}deleted {} objects, {}",
                    if dry_run { "would have " } else { "" },
                    report.objects_deleted,
                    human_bytes(report.bytes_deleted)
                );
            }
        }
        Cmd::Cp { src, dst, step } => {
            let from = open(&src)?;
            let to = open(&dst)?;
            let steps = match step {
                Some(s) => vec![s],
                None => from.committed_steps(&cancel).await?,
            };
            if steps.is_empty() {
                bail!("no committed step in {}", from.url());
            }
            for s in &steps {
                let m = from.read_manifest(*s, &cancel).await?;
                let (pb, progress) = bar(json, m.stored_bytes(), &format!("cp {s}"));
                let opts = ReadOptions {
                    concurrency,
                    progress,
                    ..Default::default()
                };
                from.copy_step(&to, *s, &opts, &cancel)
                    .await
                    .with_context(|| format!("copying step {s}"))?;
                pb.finish_and_clear();
            }
            if json {
                print_json(&serde_json::json!({"copied": steps}))?;
            } else {
                println!("copied steps {steps:?} from {} to {}", from.url(), to.url());
            }
        }
    }
    Ok(())
}

/// Total size of the *.safetensors files under `dir`, for the progress bar (best effort).
fn walk_size(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    let mut dirs_seen = 0usize;
    while let Some(d) = stack.pop() {
        dirs_seen += 1;
        if dirs_seen > 100_000 {
            break;
        }
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(p),
                Ok(t) if t.is_file() && p.extension().is_some_and(|x| x == "safetensors") => {
                    total += e.metadata().map(|m| m.len()).unwrap_or(0);
                }
                _ => {}
            }
        }
    }
    total
}
