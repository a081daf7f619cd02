//! Integration tests: the conformance suite on memory, file and S3 (moto); bad input; crash
//! safety of `elastic-ckpt push`; injected faults; reads from GCS (fake-gcs-server);
//! interop with PyTorch-written and PyTorch-loaded files; export to Hugging Face safetensors and the
//! restore command. Azure runs in its own binary (`azure.rs`) because the
//! emulator's address is process-wide state.

#[path = "suite/bad_input.rs"]
mod bad_input;
#[path = "suite/cli.rs"]
mod cli;
mod common;
#[path = "suite/crash.rs"]
mod crash;
#[path = "suite/export.rs"]
mod export;
#[path = "suite/faults.rs"]
mod faults;
#[path = "suite/gc_verify.rs"]
mod gc_verify;
#[path = "suite/gcs.rs"]
mod gcs;
#[path = "suite/hostile.rs"]
mod hostile;
#[path = "suite/local_stream.rs"]
mod local_stream;
#[path = "suite/python.rs"]
mod python;

use checkpoint::Store;
use common::run_suite;

fn file_store(root: &std::path::Path, case: &str) -> Store {
    Store::open(&format!("file://{}/{case}", root.display())).unwrap()
}

#[tokio::test]
async fn conformance_memory() {
    let files = tempfile::tempdir().unwrap();
    run_suite(
        |_| Store::open("memory://").unwrap(),
        |case| file_store(files.path(), case),
    )
    .await;
}

#[tokio::test]
async fn conformance_file() {
    let root = tempfile::tempdir().unwrap();
    run_suite(
        |case| file_store(root.path(), case),
        |_| Store::open("memory://").unwrap(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_s3_moto() {
    let moto = services::moto().unwrap();
    moto.create_bucket("ckpt").unwrap();
    let opts: Vec<(String, String)> = moto
        .env()
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    let files = tempfile::tempdir().unwrap();
    run_suite(
        |case| Store::open_with_options(&format!("s3://ckpt/{case}"), opts.clone()).unwrap(),
        |case| file_store(files.path(), case),
    )
    .await;
}
