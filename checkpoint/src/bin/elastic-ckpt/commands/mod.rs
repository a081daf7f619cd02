//! What each subcommand does, a function each, beside its arguments: `write` (push),
//! `read` (pull, export, restore), `inspect` (ls, show, verify), `manage` (gc, cp).

mod inspect;
mod manage;
mod read;
mod write;

pub(crate) use inspect::{LsArgs, ShowArgs, VerifyArgs, ls, show, verify};
pub(crate) use manage::{CpArgs, GcArgs, cp, gc};
pub(crate) use read::{ExportArgs, PullArgs, RestoreArgs, export, pull, restore};
pub(crate) use write::{PushArgs, push};

use anyhow::{Context, Result};
use checkpoint::{CancellationToken, Manifest, Store};

/// What every subcommand takes from the command line's global flags.
pub(crate) struct Ctx {
    /// `--json`: JSON output, no progress bars.
    pub json: bool,
    /// `--concurrency`, at least 1.
    pub concurrency: usize,
    /// Cancelled on Ctrl-C.
    pub cancel: CancellationToken,
}

pub(crate) fn open(url: &str) -> Result<Store> {
    Store::open(url).with_context(|| format!("opening {url}"))
}

/// The step a command acts on: the one asked for, else the newest with a manifest (valid or
/// not, so `verify` and `show` report on it rather than silently on an older one).
pub(crate) async fn newest_committed(
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

/// The length of a read's progress bar: `len` of the step asked for, or of the newest
/// committed one (a fallback's bytes carry on past it); 0 when there is none or its manifest
/// does not read (the read itself then says why).
pub(crate) async fn progress_len(
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
