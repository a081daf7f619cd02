include!("runtime/worker-tch/build.rs");
