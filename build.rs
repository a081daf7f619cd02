include!("runtime/worker/build.rs");
