//! elastic-run's end-to-end tests, one binary (ripgrep's layout). Every test here runs against
//! real services started by the `services` crate: etcd, moto (S3), Azurite, fake-gcs-server,
//! and PyTorch in the worker environment.

/// The wheel's build lines re-link `target/<profile>/elastic-run` with other features; every
/// test that runs that binary holds this for reading, the wheel's build holds it for writing.
pub static BIN_LOCK: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Holds [`BIN_LOCK`] for reading (a test that panicked while holding it poisons nothing).
pub fn bin_in_use() -> std::sync::RwLockReadGuard<'static, ()> {
    BIN_LOCK.read().unwrap_or_else(|e| e.into_inner())
}

mod kubernetes;
mod readme;
mod real_services;
#[cfg(feature = "tch")]
mod tch_worker;
mod wheel;
