//! Looking at what a store holds: `ls`, `show`, `verify`.

use anyhow::{Result, bail};
use checkpoint::ReadOptions;

use super::{Ctx, newest_committed, open};
use crate::output::{bar, human_bytes, print_json, printable, utc};

// The arguments of `ls`; their help is the subcommand's, in main.rs.
#[derive(clap::Args)]
pub(crate) struct LsArgs {
    url: String,
    #[arg(long)]
    all: bool,
}

pub(crate) async fn ls(ctx: &Ctx, args: LsArgs) -> Result<()> {
    let (json, cancel) = (ctx.json, ctx.cancel.clone());
    let LsArgs { url, all } = args;
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
    Ok(())
}

// The arguments of `show`; their help is the subcommand's, in main.rs.
#[derive(clap::Args)]
pub(crate) struct ShowArgs {
    url: String,
    #[arg(long)]
    step: Option<u64>,
}

pub(crate) async fn show(ctx: &Ctx, args: ShowArgs) -> Result<()> {
    let (json, cancel) = (ctx.json, ctx.cancel.clone());
    let ShowArgs { url, step } = args;
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
    Ok(())
}

// The arguments of `verify`; their help is the subcommand's, in main.rs.
#[derive(clap::Args)]
pub(crate) struct VerifyArgs {
    url: String,
    #[arg(long)]
    step: Option<u64>,
}

pub(crate) async fn verify(ctx: &Ctx, args: VerifyArgs) -> Result<()> {
    let (json, concurrency, cancel) = (ctx.json, ctx.concurrency, ctx.cancel.clone());
    let VerifyArgs { url, step } = args;
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
    Ok(())
}
