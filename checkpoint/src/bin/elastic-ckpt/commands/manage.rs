//! Deleting and copying steps: `gc`, `cp`.

use anyhow::{Context, Result, bail};
use checkpoint::retention::GcCheck;
use checkpoint::{ReadOptions, RetentionPolicy};

use super::{Ctx, open};
use crate::output::{bar, human_bytes, print_json, printable};

/// Default age after which an uncommitted leftover may be deleted.
const LEFTOVER_AGE_SECS_DEFAULT: u64 = 3600;

// The arguments of `gc`; their help is the subcommand's, in main.rs.
#[derive(clap::Args)]
pub(crate) struct GcArgs {
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
}

pub(crate) async fn gc(ctx: &Ctx, args: GcArgs) -> Result<()> {
    let (json, cancel) = (ctx.json, ctx.cancel.clone());
    let GcArgs {
        url,
        keep_last,
        keep_every,
        leftover_age_secs,
        dry_run,
        verify: _,
        fast,
    } = args;
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
    Ok(())
}

// The arguments of `cp`; their help is the subcommand's, in main.rs.
#[derive(clap::Args)]
pub(crate) struct CpArgs {
    src: String,
    dst: String,
    #[arg(long)]
    step: Option<u64>,
}

pub(crate) async fn cp(ctx: &Ctx, args: CpArgs) -> Result<()> {
    let (json, concurrency, cancel) = (ctx.json, ctx.concurrency, ctx.cancel.clone());
    let CpArgs { src, dst, step } = args;
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
    Ok(())
}

/// `gc --keep-last`: at least 1, since gc never deletes the newest step that verifies.
fn parse_keep_last(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1: gc never deletes the newest step that verifies".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}
