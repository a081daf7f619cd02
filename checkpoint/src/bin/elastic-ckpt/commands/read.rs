//! Reading a step out of the store: `pull`, `export`, `restore`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use checkpoint::export::{EXPORT_KEY_DEFAULT, parse_size_bytes};
use checkpoint::{Manifest, ReadOptions};

use super::{Ctx, open, progress_len};
use crate::output::{bar, human_bytes, print_json, printable, shows_bar};
use crate::reader::reader_targets;

// The arguments of `pull`; their help is the subcommand's, in main.rs.
#[derive(clap::Args)]
pub(crate) struct PullArgs {
    url: String,
    dir: PathBuf,
    #[arg(long)]
    step: Option<u64>,
    /// Pull into a DIR that already holds files: files of the same name are replaced
    /// (never written through, and never when a symlink stands there), others are kept.
    #[arg(long)]
    force: bool,
}

pub(crate) async fn pull(ctx: &Ctx, args: PullArgs) -> Result<()> {
    let (json, concurrency, cancel) = (ctx.json, ctx.concurrency, ctx.cancel.clone());
    let PullArgs {
        url,
        dir,
        step,
        force,
    } = args;
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
    Ok(())
}

// The arguments of `export`; their help is the subcommand's, in main.rs.
#[derive(clap::Args)]
pub(crate) struct ExportArgs {
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
}

pub(crate) async fn export(ctx: &Ctx, args: ExportArgs) -> Result<()> {
    let (json, concurrency, cancel) = (ctx.json, ctx.concurrency, ctx.cancel.clone());
    let ExportArgs {
        url,
        dir,
        step,
        key,
        max_shard_size,
    } = args;
    checkpoint::restore::check_fresh_dir(&dir, "export target")?;
    let store = open(&url)?;
    let len = progress_len(&store, step, &cancel, |m| {
        checkpoint::export::plan(m, &key, max_shard_size).map_or(m.raw_bytes(), |p| p.total_bytes)
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
    Ok(())
}

// The arguments of `restore`; their help is the subcommand's, in main.rs.
#[derive(clap::Args)]
pub(crate) struct RestoreArgs {
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
}

pub(crate) async fn restore(ctx: &Ctx, args: RestoreArgs) -> Result<()> {
    let (json, concurrency, cancel) = (ctx.json, ctx.concurrency, ctx.cancel.clone());
    let RestoreArgs {
        url,
        dir,
        step,
        rank,
        world_size,
        events,
        no_sync,
        no_copy,
        into_parent,
    } = args;
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
    Ok(())
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
