//! A restore the workers ask for (`restore`): their node joined a generation without restoring
//! its resume step, because the generation's continuing members hold the state in memory; a
//! worker that cannot take it from them (no live rank holds the step, or a client that heals
//! from no one) asks the agent for it. The agent implements the restore; this is what the
//! socket server sees of it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use crate::worker_env::ResumePoint;

/// The restore's outcome: the step restored (maybe older than asked, when the newer one does
/// not verify) and where, or why not.
pub type RestoreFuture<'a> = Pin<Box<dyn Future<Output = Result<ResumePoint, String>> + Send + 'a>>;

/// One node's restore of the step it joined at, run at most once however many ranks ask.
pub trait OnDemandRestore: Send + Sync + fmt::Debug {
    /// The step the node joined at (`ELASTIC_HEAL_STEP`).
    fn step(&self) -> u64;
    /// Restores it for every local rank: the first call runs the restore, later ones get its
    /// outcome.
    fn restore(&self) -> RestoreFuture<'_>;
    /// Ends a restore under way: the worker group it was for is gone, and the next one's
    /// restore must not share the restore directory with it.
    fn cancel(&self);
}
