//! Copying committed steps between stores (for example `file://` to `s3://`).
//!
//! Objects are copied as stored (no re-encoding), each checked against the manifest's length
//! and checksum on the way, `concurrency` at a time; the manifest bytes go last with a
//! create-only put, so the copy commits atomically at the destination.

use futures::{StreamExt, TryStreamExt};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::format;
use crate::restore::ReadOptions;
use crate::store::Store;

impl Store {
    /// Copies committed `step` from `self` to `dst`. Fails with [`Error::StepExists`] when
    /// `dst` already has a different manifest for the step; an identical one is a no-op.
    pub async fn copy_step(
        &self,
        dst: &Store,
        step: u64,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let key = format::manifest_key(step);
        let manifest_bytes = self
            .get_bounded(&key, format::MANIFEST_BYTES_MAX, cancel)
            .await
            .map_err(|e| match e.store_kind() {
                Some(crate::error::StoreErrorKind::NotFound) => Error::StepNotFound {
                    store: self.url().to_string(),
                    step,
                },
                _ => e,
            })?;
        let m = format::Manifest::parse(&manifest_bytes, step)
            .map_err(|e| self.manifest_error(&key, e))?;
        if let Ok(existing) = dst.read_manifest(step, cancel).await {
            if existing == m {
                return Ok(());
            }
            return Err(Error::StepExists {
                store: dst.url().to_string(),
                step,
            });
        }
        let m = &m;
        futures::stream::iter(0..m.objects.len())
            .map(|i| async move {
                let data = self.fetch_stored(m, i, cancel).await?;
                let n = data.len() as u64;
                dst.put(&m.objects[i].key, data, cancel).await?;
                if let Some(p) = &opts.progress {
                    p(n);
                }
                Ok::<_, Error>(())
            })
            .buffer_unordered(opts.concurrency.max(1))
            .try_collect::<Vec<()>>()
            .await?;
        if !dst.put_create(&key, manifest_bytes, cancel).await? {
            let existing = dst.read_manifest(step, cancel).await?;
            if existing != *m {
                return Err(Error::StepExists {
                    store: dst.url().to_string(),
                    step,
                });
            }
        }
        tracing::info!(step, from = %self, to = %dst, "step copied");
        Ok(())
    }
}
