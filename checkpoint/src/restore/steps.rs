//! Which steps exist, which are committed, and which one to read: the newest committed step
//! that verifies, falling back past one whose data is bad or missing.

use std::collections::BTreeSet;

use futures::{StreamExt, TryStreamExt};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::format::{self, Manifest};
use crate::store::Store;

/// One step as `ls` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct StepInfo {
    pub step: u64,
    pub committed: bool,
    /// From the manifest, for committed steps whose manifest is valid.
    pub manifest: Option<StepSummary>,
    /// Why a manifest that exists could not be used.
    pub manifest_error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepSummary {
    pub created_unix_ms: u64,
    pub world_size: u32,
    pub stored_bytes: u64,
    pub raw_bytes: u64,
    pub objects: usize,
    pub files: usize,
    pub tensors: usize,
}

impl From<&Manifest> for StepSummary {
    fn from(m: &Manifest) -> Self {
        StepSummary {
            created_unix_ms: m.created_unix_ms,
            world_size: m.world_size,
            stored_bytes: m.stored_bytes(),
            raw_bytes: m.raw_bytes(),
            objects: m.objects.len(),
            files: m.files.len(),
            tensors: m.tensors.len(),
        }
    }
}

/// The most keys one page of a listing holds on S3, GCS and Azure: what a presence check
/// weighs a listing's requests by.
const LIST_PAGE_KEYS: usize = 1000;

impl Store {
    /// Every step that has a directory, ascending, committed or not.
    pub async fn steps(&self, cancel: &CancellationToken) -> Result<Vec<u64>> {
        let mut steps: Vec<u64> = self
            .list_dirs(format::STEPS_DIR, cancel)
            .await?
            .iter()
            .filter_map(|n| format::parse_step_dir(n))
            .collect();
        steps.sort_unstable();
        Ok(steps)
    }

    /// Steps whose manifest exists, ascending (validity not checked).
    pub async fn committed_steps(&self, cancel: &CancellationToken) -> Result<Vec<u64>> {
        let steps = self.steps(cancel).await?;
        let flags: Vec<(u64, bool)> = futures::stream::iter(steps)
            .map(|s| async move {
                match self.head(&format::manifest_key(s), cancel).await {
                    Ok(_) => Ok((s, true)),
                    Err(e) if e.store_kind() == Some(crate::error::StoreErrorKind::NotFound) => {
                        Ok((s, false))
                    }
                    // Something stands where the manifest belongs: the step counts as
                    // committed and invalid, so readers see it, say why, and fall back.
                    Err(e)
                        if e.store_kind()
                            == Some(crate::error::StoreErrorKind::NotARegularFile) =>
                    {
                        Ok((s, true))
                    }
                    Err(e) => Err(e),
                }
            })
            .buffered(16)
            .try_collect()
            .await?;
        Ok(flags.into_iter().filter(|f| f.1).map(|f| f.0).collect())
    }

    /// Every step with its state, for `ls`.
    pub async fn list_steps(&self, cancel: &CancellationToken) -> Result<Vec<StepInfo>> {
        let committed: BTreeSet<u64> = self.committed_steps(cancel).await?.into_iter().collect();
        let mut out = Vec::new();
        for step in self.steps(cancel).await? {
            if !committed.contains(&step) {
                out.push(StepInfo {
                    step,
                    committed: false,
                    manifest: None,
                    manifest_error: None,
                });
                continue;
            }
            let (manifest, manifest_error) = match self.read_manifest(step, cancel).await {
                Ok(m) => (Some(StepSummary::from(&m)), None),
                Err(e) if e.is_integrity() => (None, Some(e.to_string())),
                Err(e) => return Err(e),
            };
            out.push(StepInfo {
                step,
                committed: true,
                manifest,
                manifest_error,
            });
        }
        Ok(out)
    }

    /// Checks that every object a manifest lists exists with its recorded length.
    pub async fn check_objects_present(
        &self,
        m: &Manifest,
        cancel: &CancellationToken,
    ) -> Result<()> {
        self.check_objects_present_where(m, |_| true, cancel).await
    }

    /// [`Store::check_objects_present`] of the objects whose index `which` picks.
    ///
    /// On a local directory each gets an `lstat`, which also finds a symlink or FIFO where an
    /// object belongs. On a remote store, where each HEAD is a request, the step's data
    /// directory is listed instead when that takes fewer requests (a listing page holds up to
    /// [`LIST_PAGE_KEYS`] objects): a step of thousands of chunks is checked in a few
    /// requests, not thousands. A listing says as much as the HEADs would: whether each key
    /// is there, and its length; an object it does not show as the manifest has it still
    /// gets its HEAD before the step counts as lost.
    pub(crate) async fn check_objects_present_where(
        &self,
        m: &Manifest,
        which: impl Fn(usize) -> bool,
        cancel: &CancellationToken,
    ) -> Result<()> {
        // Owned (key, length) pairs: a stream of futures borrowing each entry would make
        // every future awaiting this one fail rustc's higher-ranked `Send` check once spawned
        // (the agent's commit loop runs retention, which calls this).
        let objects: Vec<(String, u64)> = m
            .objects
            .iter()
            .enumerate()
            .filter(|(i, _)| which(*i))
            .map(|(_, o)| (o.key.clone(), o.stored_bytes))
            .collect();
        let list_pages = m.objects.len().div_ceil(LIST_PAGE_KEYS).max(1);
        if !self.has_local_root() && objects.len() >= 2 * list_pages {
            return self.check_listed(m.step, objects, cancel).await;
        }
        self.check_heads(m.step, objects, cancel).await
    }

    /// Checks `objects` (`(key, stored length)` of step `step`), a HEAD (or `lstat`) each.
    async fn check_heads(
        &self,
        step: u64,
        objects: Vec<(String, u64)>,
        cancel: &CancellationToken,
    ) -> Result<()> {
        futures::stream::iter(objects)
            .map(|(key, stored_bytes)| async move {
                let size = self.head(&key, cancel).await?;
                if size != stored_bytes {
                    return Err(self.corrupt(
                        step,
                        &key,
                        format!("{size} bytes, manifest says {stored_bytes}"),
                    ));
                }
                Ok(())
            })
            .buffer_unordered(16)
            .try_collect::<Vec<()>>()
            .await
            .map(|_| ())
    }

    /// Checks `objects` (`(key, stored length)` of step `step`) against one listing of the
    /// step's data directory, where every object of a valid manifest lies. An object the
    /// listing does not show as the manifest has it gets a HEAD of its own, whose answer
    /// stands: a listing that lags behind the writes (an S3-compatible store that lists
    /// eventually) or that spells a key otherwise must not make a good step look lost, and
    /// the HEADs cost nothing while every object is there.
    async fn check_listed(
        &self,
        step: u64,
        objects: Vec<(String, u64)>,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let dir = format::data_root(step);
        let listed: std::collections::HashMap<String, u64> = self
            .list(&dir, cancel)
            .await?
            .into_iter()
            .map(|(key, size, _)| (key, size))
            .collect();
        let doubtful: Vec<(String, u64)> = objects
            .into_iter()
            .filter(|(key, stored_bytes)| {
                // As the listing spells it: the store's path of the key, less the prefix.
                let path = self.path(key);
                listed.get(self.rel_key(&path)) != Some(stored_bytes)
            })
            .collect();
        if doubtful.is_empty() {
            return Ok(());
        }
        self.check_heads(step, doubtful, cancel).await
    }

    /// The newest committed step whose manifest is valid and whose objects are all present.
    /// Newer steps that fail are skipped with a warning that says why.
    pub async fn latest_committed(&self, cancel: &CancellationToken) -> Result<Option<Manifest>> {
        for step in self.committed_steps(cancel).await?.into_iter().rev() {
            let r = async {
                let m = self.read_manifest(step, cancel).await?;
                self.check_objects_present(&m, cancel).await?;
                Ok::<_, Error>(m)
            }
            .await;
            match r {
                Ok(m) => return Ok(Some(m)),
                Err(e) if e.is_integrity() => {
                    tracing::warn!(step, error = %e, "committed step does not verify; falling back to the previous committed step");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Resolves `step` (or the newest committed one when `None`).
    pub async fn resolve_step(&self, step: Option<u64>, cancel: &CancellationToken) -> Result<u64> {
        match step {
            Some(s) => Ok(s),
            None => self
                .latest_committed(cancel)
                .await?
                .map(|m| m.step)
                .ok_or_else(|| Error::NoCommittedStep {
                    store: self.url().to_string(),
                }),
        }
    }

    /// Runs `attempt` on the committed steps from the newest down until one succeeds. A step
    /// that fails with an integrity error (a corrupt or missing object, a bad manifest) is
    /// skipped with a warning naming the step and the bad object, and the next older one is
    /// tried; any other error (the store unreachable, cancellation) ends the search. Returns
    /// the result and the steps skipped, newest first.
    pub(crate) async fn newest_committed_that<T, F, Fut>(
        &self,
        what: &'static str,
        cancel: &CancellationToken,
        mut attempt: F,
    ) -> Result<(T, Vec<u64>)>
    where
        F: FnMut(u64) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut skipped = Vec::new();
        for step in self.committed_steps(cancel).await?.into_iter().rev() {
            match attempt(step).await {
                Ok(v) => return Ok((v, skipped)),
                Err(e) if e.is_integrity() => {
                    tracing::warn!(step, error = %e, "committed step does not {what}; falling back to the previous committed step");
                    skipped.push(step);
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::NoCommittedStep {
            store: self.url().to_string(),
        })
    }
}
