//! The conformance suite on Azure (Azurite). Its own test binary, with one test: object_store's
//! emulator mode reads `AZURITE_BLOB_STORAGE_URL` from the process environment.

mod common;

use checkpoint::Store;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_azure_azurite() {
    let azurite = services::azurite().unwrap();
    azurite.create_container("ckpt").unwrap();
    // SAFETY: this binary has a single test, and it sets the variable before any thread of
    // its own reads the environment.
    unsafe { std::env::set_var("AZURITE_BLOB_STORAGE_URL", azurite.service.url()) };
    let opts = vec![
        ("azure_storage_use_emulator".to_string(), "true".to_string()),
        ("azure_allow_http".to_string(), "true".to_string()),
    ];
    let files = tempfile::tempdir().unwrap();
    common::run_suite(
        |case| Store::open_with_options(&format!("az://ckpt/{case}"), opts.clone()).unwrap(),
        |case| Store::open(&format!("file://{}/{case}", files.path().display())).unwrap(),
    )
    .await;
}
