//! Committing a directory of safetensors files as a step: `push`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use checkpoint::{CommitOutcome, CommitRequest, Compression, PartInput, PartSource, SaveOptions};

use super::{Ctx, open};
use crate::output::{bar, human_bytes, print_json};

/// Default chunk size bound.
const CHUNK_MIB_DEFAULT: usize = 32;

// The arguments of `push`; their help is the subcommand's, in main.rs.
#[derive(clap::Args)]
pub(crate) struct PushArgs {
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
}

pub(crate) async fn push(ctx: &Ctx, args: PushArgs) -> Result<()> {
    let (json, concurrency, cancel) = (ctx.json, ctx.concurrency, ctx.cancel.clone());
    let PushArgs {
        dir,
        url,
        step,
        world_size,
        metadata,
        chunk_mib,
        compress,
        no_compress,
    } = args;
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
