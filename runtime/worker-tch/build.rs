// Binaries that use tch link the libtorch that ships inside PyPI `torch`. This adds an rpath
// to that library directory so they start without a hand-set `LD_LIBRARY_PATH`. The root
// package's build script includes this file (for its `tch` feature).

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    println!("cargo:rerun-if-env-changed=PATH");
    // In this crate tch is always on; the root package includes this script under its
    // optional `tch` feature.
    if std::env::var("CARGO_PKG_NAME").as_deref() != Ok("elastic-run-worker-tch")
        && std::env::var_os("CARGO_FEATURE_TCH").is_none()
    {
        return;
    }
    let lib_dir = match std::env::var("LIBTORCH") {
        Ok(root) => format!("{root}/lib"),
        Err(_) => {
            let out = Command::new("python3")
                .args([
                    "-c",
                    "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))",
                ])
                .output()
                .expect(
                    "the tch feature needs python3 with torch on PATH (LIBTORCH_USE_PYTORCH=1)",
                );
            assert!(
                out.status.success(),
                "python3 could not import torch: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout)
                .expect("torch's path is UTF-8")
                .trim()
                .to_string()
        }
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
}
