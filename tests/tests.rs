//! elastic-run's end-to-end tests, one binary (ripgrep's layout). Every test here runs against
//! real services started by the `services` crate: etcd, moto (S3), Azurite, fake-gcs-server,
//! and PyTorch in the worker environment.

mod kubernetes;
mod readme;
mod real_services;
#[cfg(feature = "tch")]
mod tch_worker;
mod wheel;
