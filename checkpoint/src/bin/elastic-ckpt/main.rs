//! `elastic-ckpt`: inspect, move and check checkpoints in object storage.
//!
//! - Here: the command line, and which function runs each subcommand.
//! - `commands`: what each subcommand does.
//! - `output`: what it prints (terminal-safe text, progress bars, sizes, times, JSON).
//! - `reader`: `restore --into-parent`'s answers from the reader on stdin.

mod commands;
mod output;
mod reader;

use std::process::ExitCode;

use anyhow::Result;
use checkpoint::CancellationToken;
use clap::{Parser, Subcommand};

use output::printable;

/// Default chunks in flight.
const CONCURRENCY_DEFAULT: usize = 8;

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
    Push(commands::PushArgs),
    /// Write a step's files under DIR, byte-identical to what was pushed. By default the
    /// newest committed step that reads back whole: a newer one that fails its checks is
    /// skipped with a warning naming the bad object. DIR must be empty or absent.
    Pull(commands::PullArgs),
    /// Write one entry of a step's state (a module's weights) under DIR as Hugging Face
    /// safetensors: `model.safetensors`, or, above --max-shard-size,
    /// `model-00001-of-0000N.safetensors`... and `model.safetensors.index.json`. Tensors are
    /// named as in the module's state_dict(), sharded ones written whole. By default the
    /// newest committed step that reads back whole: a newer one that fails its checks is
    /// skipped with a warning naming the bad object. DIR must be empty or absent.
    Export(commands::ExportArgs),
    /// Restore what rank R of a world of W needs into DIR, as the agent does for a worker:
    /// DIR/state.safetensors (replicated tensors whole, rows [rows*R/W, rows*(R+1)/W) of
    /// sharded ones) and DIR/metadata.json. By default the newest committed step that
    /// restores, falling back past a corrupt one. DIR must be empty or absent.
    Restore(commands::RestoreArgs),
    /// List committed steps (with --all, uncommitted leftovers too).
    Ls(commands::LsArgs),
    /// Show a step's tensors, files, compression and metadata (newest by default).
    Show(commands::ShowArgs),
    /// Read every object of a step and check lengths and checksums.
    Verify(commands::VerifyArgs),
    /// Delete steps outside the retention policy and old uncommitted leftovers.
    ///
    /// Never deletes the newest step that verifies. Committed steps are checked newest first
    /// until K verify (only those are read, never the ones deleted); a step that does not
    /// verify does not count toward K, and is kept when it is newer than every step that does.
    Gc(commands::GcArgs),
    /// Copy committed steps (all, or --step N) from SRC to DST.
    Cp(commands::CpArgs),
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
    let ctx = commands::Ctx {
        json: cli.json,
        concurrency: cli.concurrency.max(1),
        cancel,
    };
    match cli.cmd {
        Cmd::Push(args) => commands::push(&ctx, args).await,
        Cmd::Pull(args) => commands::pull(&ctx, args).await,
        Cmd::Export(args) => commands::export(&ctx, args).await,
        Cmd::Restore(args) => commands::restore(&ctx, args).await,
        Cmd::Ls(args) => commands::ls(&ctx, args).await,
        Cmd::Show(args) => commands::show(&ctx, args).await,
        Cmd::Verify(args) => commands::verify(&ctx, args).await,
        Cmd::Gc(args) => commands::gc(&ctx, args).await,
        Cmd::Cp(args) => commands::cp(&ctx, args).await,
    }
}
