include!("runtime/build.rs");
